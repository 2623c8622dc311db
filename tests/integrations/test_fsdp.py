"""LionCub on FSDP2: HSDP (shard inside a node, vote across nodes) gives the hierarchical layout's parameters on
the unsharded model bit for bit; plain FSDP runs the dense method."""

import fsdp_cases
import pytest
import torch

from lioncub.comm.spawn import spawn

CASES = [(m, 4, 2, {}) for m in ("vote-1bit", "vote-pbit", "l1-pbit")] + [
    ("vote-1bit", 8, 2, {}), ("l1-pbit", 8, 4, {}), ("vote-pbit", 8, 4, dict(overlap=False)),
    ("vote-1bit", 4, 2, dict(bf16=True)), ("l1-pbit", 8, 2, dict(bf16=True, overlap=False))]


@pytest.mark.parametrize("method, world, nodes, kw", CASES,
                         ids=[f"{m}-{n}x{w // n}-" + "-".join(k for k in kw) for m, w, n, kw in CASES])
def test_hsdp_is_the_hierarchical_layout_bit_for_bit(method, world, nodes, kw):
    """nodes x G ranks; fp32 and a bf16 MixedPrecisionPolicy; overlapped and in step(); momentum synced."""
    for rank, r in enumerate(spawn(fsdp_cases.both, world, nodes, method, kw, timeout=300)):
        hsdp, hier = r["hsdp"], r["hierarchical"]
        assert hsdp["replicas_equal"] and hier["replicas_equal"]
        assert torch.equal(hsdp["params"], hier["params"]), (rank, (hsdp["params"] - hier["params"]).abs().max())
        assert torch.equal(hsdp["momenta"], hier["momenta"]), rank
        assert hsdp["stats"]["skipped_steps"] == 0 and hsdp["stats"]["momentum_syncs"] == 2
        # with overlap, each unit's vote ran during backward, once its reduce-scatter was done
        assert hsdp["stats"]["overlapped_steps"] == (0 if kw.get("overlap") is False else 4)


def test_plain_fsdp_runs_the_dense_method_and_refuses_a_vote():
    for r in spawn(fsdp_cases.plain_fsdp, 2, "allreduce", timeout=120):
        assert torch.allclose(r["params"], r["ref"], rtol=0, atol=1e-6)  # (sums in another order: not bit for bit)
        assert r["collectives"] > 0  # (the control message only: FSDP averaged the gradients)
    for r in spawn(fsdp_cases.plain_fsdp, 2, "vote-1bit", timeout=120):
        assert "HSDP" in r["error"] and "mesh['shard']" in r["error"] and "\n" not in r["error"]


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere():
    for r in spawn(fsdp_cases.nonfinite_on_one_rank, 4, 2, 3, timeout=120):
        assert r["changed"] == [True, False, True] and r["skipped"] == 1


def test_checkpoints_resume_bit_for_bit(tmp_path):
    for r in spawn(fsdp_cases.checkpoint_resume, 4, 2, str(tmp_path / "ckpt"), 2, 5, timeout=180):
        assert torch.equal(r["resumed"], r["straight"])


@pytest.mark.parametrize("world, nodes", [(4, 2), (8, 2)])
def test_parameters_gradients_and_momenta_take_one_gth_of_a_replica(world, nodes):
    G = world // nodes
    for r in spawn(fsdp_cases.memory, world, nodes, timeout=180):
        for part in ("params", "grads", "momenta"):
            ratio = r["hsdp"][part] / r["replica"][part]
            assert 1 / G <= ratio <= 1 / G * 1.02, (part, ratio)  # (FSDP pads each tensor to G equal parts)
