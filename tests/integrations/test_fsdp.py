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


@pytest.mark.parametrize("method, overlap", [("vote-1bit", True), ("l1-pbit", False), ("allreduce", True)])
def test_clip_grad_norm_is_the_rms_over_nodes_of_the_node_means_norm(method, overlap):
    """Each rank holds a shard of its node's mean gradient: the norm is one number on every rank, the RMS over
    nodes of the node means' norms (dense: the mean's), as an oracle computes it from every rank's gradient."""
    results = spawn(fsdp_cases.clipped, 4, 2, method, overlap, timeout=180)
    for r in results:
        assert r["norms"] == results[0]["norms"] and r["replicas_equal"] and r["skipped"] == 0
        assert r["norms"] == pytest.approx(r["oracle"], rel=1e-5)
        assert all(n > 0.005 for n in r["norms"]), r["norms"]  # (so every step clipped)


@pytest.mark.parametrize("method", ["vote-1bit", "allreduce"])
def test_grad_scaler_skips_an_overflow_on_one_rank_everywhere(method):
    for r in spawn(fsdp_cases.scaled, 4, 2, method, timeout=180):
        assert r["changed"] == [True, False, True, True] and r["replicas_equal"] and r["finite"]
        assert r["scales"][1] == r["scales"][0] / 2


def test_lioncub_train_hsdp_configurations():
    """`lioncub train --method hsdp+lion` (FSDP2's own HSDP, plain Lion) trains as ddp+lion does (the same mean
    gradient: equal losses); hsdp+vote-1bit votes across the two nodes and sends a fraction of hsdp+lion's
    cross-node bytes; FSDP's bytes inside the node are the ring formulas' (FSDP2 keeps the root unit gathered from
    forward to backward)."""
    from lioncub.apps.train.loop import TrainConfig, train_local

    def run(method):
        return train_local(TrainConfig(model="char-tiny", method=method, steps=6, node_size=2, eval_batches=2), 4,
                           progress=False)

    ddp, hsdp, vote = run("ddp+lion"), run("hsdp+lion"), run("hsdp+vote-1bit")
    assert hsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-6)
    full = 4 * hsdp["params"]
    root = 4 * (103 * 128 + 64 * 128 + 2 * 128 + 128 * 103)  # the root unit's own: embeddings, final norm, head
    node = 1 / 2 * full + 1 / 2 * (2 * full - root)  # reduce-scatter; all-gathers among 2, the root's once
    assert hsdp["node_bytes_per_step"] == vote["node_bytes_per_step"] == pytest.approx(node, abs=1)
    assert hsdp["bytes_per_step"] - node == pytest.approx(full / 2, abs=1)  # all-reduce of a half among 2 nodes
    assert 0 < vote["bytes_per_step"] - node < (hsdp["bytes_per_step"] - node) / 10
    assert vote["final_loss"] < 4.0 and vote["skipped_steps"] == 0


def _saved_tensors(path) -> dict:
    """Every tensor of a DCP checkpoint (model and optimizer state), read in this process with torch's converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path) + ".pt")
    out, todo = {}, [("", torch.load(str(path) + ".pt", weights_only=False))]
    while todo:
        prefix, d = todo.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                todo.append((f"{prefix}{k}.", v))
            elif isinstance(v, torch.Tensor):
                out[prefix + k] = v
    return out


@pytest.mark.parametrize("method", ["hsdp+lion", "hsdp+l1-pbit"])
def test_lioncub_train_hsdp_resumes_from_its_dcp_checkpoint_exactly(tmp_path, method):
    """6 steps straight against 3 steps, a checkpoint (DCP, sharded: lioncub.checkpoint for LionCub, torch's
    sharded state dicts for hsdp+lion's plain Lion) and a second run that resumes to 6: the same losses step by
    step, and the final checkpoints of both runs hold identical parameters and momenta."""
    from lioncub.apps.train.loop import TrainConfig, train_local

    common = dict(model="char-tiny", method=method, momentum_sync="every:2", node_size=2, eval_batches=2)
    if method == "hsdp+lion":
        common.pop("momentum_sync")
    full = train_local(TrainConfig(**common, steps=6, checkpoint_dir=str(tmp_path / "full")), 4, progress=False)
    part = dict(common, checkpoint_dir=str(tmp_path / "ckpt"))
    train_local(TrainConfig(**part, steps=3), 4, progress=False)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step0000003"]
    resumed = train_local(TrainConfig(**part, steps=6, resume=True), 4, progress=False)
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"]]
    assert resumed["final_loss"] == full["final_loss"]
    straight = _saved_tensors(tmp_path / "full" / "step0000006")
    again = _saved_tensors(tmp_path / "ckpt" / "step0000006")
    assert sorted(straight) == sorted(again)
    momenta = "optim.state." if method == "hsdp+lion" else ".momentum_shards."  # (LionCub's are sharded by node)
    assert any(momenta in k for k in straight) and any(k.startswith("model.") for k in straight)
    for k in straight:
        assert torch.equal(straight[k], again[k]), k
    at3 = _saved_tensors(tmp_path / "ckpt" / "step0000003")
    assert any(not torch.equal(at3[k], straight[k]) for k in straight if k.startswith("model."))  # it trained on
