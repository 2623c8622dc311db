"""The hierarchical layout on local Gloo ranks: every compressed method against an independent
re-derivation (nodes of G in {2, 4}, 2-3 nodes), bytes, momentum memory, non-finite skips, resume, bad input."""

import dist_cases
import hier_cases
import pytest
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("world_size,G,overlap", [(4, 2, True), (6, 2, False), (8, 4, True), (6, 3, True),
                                                  (2, 2, True)])  # the last: one node, one voter
def test_every_method_matches_oracle(world_size, G, overlap):
    reports = spawn(hier_cases.check_hierarchical, world_size, G, 4, 3, overlap, timeout=300)
    for rank, report in enumerate(reports):
        for method, r in report.items():
            assert r["elements"] > 0
            assert r["mismatch"] == 0, (rank, method, r)
            assert r["replicas_equal"], (rank, method)
            assert r["momentum_err"] <= 1e-6, (rank, method, r["momentum_err"])
            assert r["stats"]["overlapped_steps"] == (4 if overlap else 0)
            assert r["stats"]["momentum_syncs"] == 1
            # each rank holds the momenta of 1/G of the parameters (plus shard padding)
            assert r["momentum_elements"] * G >= r["param_elements"]
            assert r["momentum_elements"] * G <= r["param_elements"] + 64 * G * 8
    nodes = world_size // G
    assert reports[0]["l1-pbit"]["levels"] == 127 // nodes  # fields sized for N/G voters
    for method in reports[0]:  # the agreement of the nodes' vote: one number on every rank
        values = {report[method]["agreement"] for report in reports}
        assert len(values) == 1, (method, values)
        if method in ("vote-pbit", "avg-pbit", "l1-pbit") and nodes > 1:
            assert 0.0 <= values.pop() <= 1.0


def test_bytes_per_rank_fall_with_the_node_size():
    out = spawn(hier_cases.hierarchical_vs_flat_bytes, 4, 2)
    flat, hier = out[0][False], out[0][True]
    n, G = 1 << 16, 2
    # flat: all-to-all + all-gather of 2 planes, 3/4 of each; hierarchical: the same across 2 nodes on n/2,
    # plus the node's reduce-scatter (fp32) and all-gather of the codes (1/2 of each)
    assert flat == pytest.approx(0.75 * n / 8 * 3 + 16 * 0.5, rel=0.01)
    shard = n // G
    node = 0.5 * n * 4 + 0.5 * G * shard / 8 * 2  # the reduce-scatter and the codes' all-gather
    assert hier == pytest.approx(0.5 * shard / 8 * 3 + node + 16 * 0.5, rel=0.01)
    assert out[0]["node", True] == pytest.approx(node, rel=0.01) and out[0]["node", False] == 0


def test_adaptive_guard_credit_counts_only_bytes_that_leave_the_node():
    start, steps = 2, 5
    for r in spawn(hier_cases.guard_credit, 4, 2, start, steps):
        assert r["syncs"] == 0
        cross = [sent - node for sent, node in r["rows"]]
        assert all(node > sent / 2 for sent, node in r["rows"][start:])  # the node's fp32 reduce-scatter dominates
        # budget 1: each compressed step earns its cross-node bytes, each dense start step spends its own
        assert r["credit"] == pytest.approx(sum(cross[start:]) - sum(cross[:start]), rel=1e-12)


def test_nonfinite_on_one_rank_skips_everywhere():
    out = spawn(hier_cases.nonfinite_on_one_rank, 4, 2, 3)
    for r in out:
        assert [s["changed"] for s in r["steps"]] == [True, False, True]
        assert not r["steps"][1]["momenta_changed"]
        assert r["skipped"] == 1


def test_resume_reproduces_uninterrupted_run():
    full = spawn(hier_cases.resume, 4, 2, 6, 0)
    half = spawn(hier_cases.resume, 4, 2, 3, 0)
    resumed = spawn(hier_cases.resume, 4, 2, 3, 3, half)
    for a, b in zip(full, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert all(torch.equal(x, y) for x, y in zip(a["opt"]["lioncub"]["momentum_shards"],
                                                    b["opt"]["lioncub"]["momentum_shards"]))


def test_checkpoint_of_another_layout_or_rank_is_refused():
    half = spawn(hier_cases.resume, 4, 2, 2, 0)
    params, groups = dist_cases.make_params()
    flat = LionCub(groups, method="l1-pbit", bucket_mb=dist_cases.BUCKET_MB)
    with pytest.raises(ValueError, match="same layout"):
        flat.load_state_dict(half[0]["opt"])


def test_disagreeing_node_sizes_raise_instead_of_hanging():
    out = spawn(hier_cases.bad_node_size, 2)
    assert all(msg and "disagree on the node size" in msg for msg in out)


def test_bad_input(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="compressed methods"):
        LionCub([p], method="allreduce", node_size=2)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        LionCub([p], method="vote-1bit", node_size=2)  # node_size alone selects the node layout
    for bad in (0, -1, 1.5, True, "locall"):
        with pytest.raises(ValueError, match="node_size must be a positive integer or 'local'"):
            LionCub([p], method="vote-1bit", node_size=bad)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="node_size='local' needs torchrun's LOCAL_WORLD_SIZE"):
        LionCub([p], method="vote-1bit", node_size="local")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        LionCub([p], method="vote-1bit", node_size="local")


def test_dcp_checkpoint_resumes_momentum_shards_bit_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    full = spawn(hier_cases.dcp_train, 4, 2, None, 5, timeout=120)
    spawn(hier_cases.dcp_train, 4, 2, path, 3, timeout=120)
    resumed = spawn(hier_cases.dcp_train, 4, 2, path, 3, True, 5, timeout=120)
    for a, b in zip(full, resumed):
        assert a["step"] == b["step"] == 5
        assert torch.equal(a["params"], b["params"]) and torch.equal(a["shards"], b["shards"])
    with pytest.raises(Exception, match="same layout"):  # a flat optimizer cannot take momentum shards
        spawn(hier_cases.dcp_flat_load, 4, path, timeout=120)


def test_dense_warmup_is_plain_lion_on_the_mean_gradient():
    K = 3
    for runs in spawn(hier_cases.dense_warmup_matches_flat, 4, 2, K, 5, timeout=120):
        flat, hier = runs[False], runs[True]
        for step in range(K):  # the warm-up: bit-identical
            assert torch.equal(flat["trace"][step], hier["trace"][step]), step
        assert torch.equal(flat["momenta"], hier["momenta"])  # the shard of the one global momentum
        assert not torch.equal(flat["trace"][K], hier["trace"][K])  # then each layout votes its own way
        assert hier["stats"]["skipped_steps"] == 0


def test_timing_counts_every_collective_by_name():
    for r in spawn(hier_cases.timed_collectives, 4, 2, 3):
        times, k = r["times"], r["buckets"]
        assert {name: n for name, (n, _) in times.items()} == {
            "reduce_scatter (hierarchical gradients)": 3 * k, "all_to_all_single (1-bit votes)": 3 * k,
            "all_gather_into_tensor (1-bit result)": 3 * k, "all_gather_into_tensor (hierarchical codes)": 3 * k,
            # step 1: odd ranks have one gradient None (dist_cases.assign), so the ranks agree which parameters
            # any rank used; then nothing is tracked (no zero_grad(set_to_none=True))
            "all_reduce (control)": 3, "all_reduce (unused parameters)": 1,
                "all_reduce (same gradients)": 1,  # once, on the first step (Engine.check_replicas)
                "all_reduce (same parameters)": 1}  # once, before the first update (Engine.start_equal)
        # what opt.stats counted: all but the start check, a set-up collective (as the node-size agreement)
        assert sum(n for n, _ in times.values()) - 1 == r["collectives"]
        assert all(t > 0 for _, t in times.values())
