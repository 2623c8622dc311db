"""Streamed outer steps in the node layout (LionCub(local=LocalSteps(H, fragments=F, delay=D), node_size=G)):
each node's ranks step on the node's mean gradient, and on the communication thread local rank 0 of every node
votes each fragment across the nodes and broadcasts the agreed update inside its node. Checked against the
independent replay of every rank (tests/helpers/local_cases.py's oracle with nodes, fragments and a delay),
fragments=1 against the unstreamed node layout bit for bit, the collectives each step records, an exact resume
across an exchange in flight, and the non-finite rules."""

import local_cases as lc
import pytest
import torch

from lioncub.comm.spawn import spawn
from lioncub.optim.local import parse_outer


def _check(reports, method, outer, H, F, D, steps, G, bad=None):
    kind, outer, world = lc.KINDS[method], parse_outer(outer), len(reports)
    fragments = reports[0]["fragments"]
    assert len(fragments) == F and all(r["fragments"] == fragments for r in reports)
    history, residual = lc.oracle(kind, world, H, (outer.kind, outer.lr, outer.momentum), steps,
                                  lc.levels_for(method, world // G), bad, True, G, fragments, D)
    for rank, rep in enumerate(reports):
        assert rep["own_group"], rank
        for step, rec in enumerate(rep["records"], start=1):
            for got, want in zip(rec["params"], history[step - 1][rank]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{method} rank {rank} step {step}")
        for got, want in zip(rep["residual"], residual[rank]):  # the leaders' own; the others' stay zero
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{method} rank {rank} residual")
    applied = lc.check_stream_order(reports, H, F, D, steps)
    _check_collectives(reports, G, steps, applied)


def _check_collectives(reports, G, steps, applied):
    """Every step the node's fp32 mean of each bucket, then (unless the node skips the step) its inner step's
    all-gathers in the node; at each application, the leader's exchange across the nodes ("cross"), then on
    every rank the node broadcasts of the voted flag and of the fragment's buckets."""
    cross = {}
    for rank, rep in enumerate(reports):
        sizes, frags = rep["buckets"], rep["stream_fragments"]
        mean = [("allreduce", 4 * n, "float32", "node") for n in sizes]
        first = rep["collectives"][0]
        for step, colls in enumerate(rep["collectives"], start=1):
            inner = [c for c in colls if c[3] == "node" and c[0] != "broadcast"]
            assert inner[: len(sizes)] == mean and inner in (first, mean), (rank, step)
            rest, want = colls[len(inner):], []
            for f in [f for due, f in applied if due == step]:
                want += [("broadcast", 4, "int32", "node")] + [("broadcast", 4 * sizes[k], "float32", "node")
                                                                for k in frags[f]]
            node = [c for c in rest if c[3] == "node"]
            assert node == want, (rank, step)
            voted = [c for c in rest if c[3] == "cross"]
            assert len(node) + len(voted) == len(rest)
            assert bool(voted) == (rank % G == 0 and bool(want)), (rank, step)  # only the leaders vote
            if voted:
                assert cross.setdefault(step, voted) == voted  # every node's leader the same collectives
            assert all(op != "broadcast" for op, *_ in voted)


@pytest.mark.parametrize("method,outer", [("vote-1bit", "nesterov"), ("l1-pbit", "sign:0.5:0.9"), ("avg-pbit", "avg")])
def test_fragments_1_is_the_unstreamed_node_layout_bit_for_bit(method, outer):
    reports = spawn(lc.one_fragment_case, 4, method, 3, outer, 7, 2, timeout=300)
    for rank, r in enumerate(reports):
        assert r["same"] and r["same_state"] and r["same_collectives"] and r["bytes"], (method, rank)
        assert r["launches"] == [(3, 0), (6, 0)]
        assert any(t.any() for t in r["residual"]) == (rank % 2 == 0)  # the leaders' residuals only


@pytest.mark.parametrize("method,outer,H,F,D", [("vote-1bit", "nesterov", 4, 2, 1),
                                               ("l1-pbit", "sign:0.5:0.9", 6, 3, 1),
                                               ("avg-pbit", "avg:1:0.5", 6, 2, 2)])
def test_streamed_node_layout_matches_an_independent_replay(method, outer, H, F, D):
    steps = 2 * H + D + 1
    reports = spawn(lc.stream_scenario, 4, method, H, outer, steps, F, D, None, None, True, 2, timeout=300)
    _check(reports, method, outer, H, F, D, steps, G=2)


def test_eight_ranks_in_nodes_of_four():
    H, F, D, steps = 4, 2, 1, 9
    reports = spawn(lc.stream_scenario, 8, "vote-1bit", H, "nesterov", steps, F, D, None, None, False, 4,
                    timeout=400)
    _check(reports, "vote-1bit", "nesterov", H, F, D, steps, G=4)


def test_a_bad_inner_step_is_its_node_s_alone():
    """Rank 1's inf at step 3: the node's mean is not finite, so both its ranks skip that inner step (and no
    other rank); the outer steps go on as the replay has them."""
    bad = (1, 3)
    reports = spawn(lc.stream_scenario, 4, "vote-1bit", 4, "nesterov", 9, 2, None, bad, None, False, 2, timeout=300)
    assert [r["local_skips"] for r in reports] == [1, 1, 0, 0] and reports[0]["delay"] == 1
    _check(reports, "vote-1bit", "nesterov", 4, 2, 1, 9, G=2, bad=bad)


def test_a_non_finite_pseudo_gradient_on_a_leader_skips_that_fragment_everywhere():
    """Tensor 0 turns NaN on rank 2 (node 1's leader) at step 4, where its fragment (launched at t % 4 == 0) takes
    its pseudo-gradient: that outer step is skipped on every rank of every node, which restart the fragment
    from its unchanged anchor; the other fragment's outer steps (at 2 and 6) stand."""
    reports = spawn(lc.stream_scenario, 4, "l1-pbit", 4, "nesterov", 7, 2, 1, None, (2, 4), False, 2, timeout=300)
    start = lc.initial()
    late = reports[0]["fragments"][1]  # launched at t % 4 == 0
    assert 0 in late and 4 not in late
    for rep in reports:
        assert rep["outer_skips"] == 1 and rep["outer_steps"] == 2 and rep["local_skips"] == 0
        at5 = rep["records"][4]["params"]
        assert all(torch.equal(at5[t], start[t]) for t in late)  # back at the anchor, the initial values
        assert all(not rep["residual"][t].any() for t in late)  # nothing agreed, nothing dropped
        assert not torch.equal(rep["records"][6]["params"][4], start[4])


@pytest.mark.parametrize("cut", [2, 5])
def test_resume_across_an_exchange_in_flight_is_bit_exact(cut):
    """H=4, F=2, D=1: fragment 0 is in flight after step 2; after 5 none is."""
    reports = spawn(lc.stream_resume_case, 4, "l1-pbit", 4, "nesterov", 10, cut, 2, 1, 2, timeout=300)
    assert all(r["same"] and r["steps"] == 10 - cut for r in reports)
    assert all(r["in_flight"] == (0 if cut == 5 else 1) for r in reports)


def test_lioncub_checkpoint_resumes_across_an_exchange_in_flight(tmp_path):
    """lioncub.checkpoint.save after step 6 (fragment 0's exchange in flight; each rank's momentum shards, the
    leaders' residuals): every rank resumes bit for bit to step 10, rank 1's inf at step 3 skipped by its node."""
    reports = spawn(lc.stream_dcp_case, 4, "vote-1bit", 4, "nesterov", 10, 6, str(tmp_path / "ckpt"), (1, 3), 2, 1, 2,
                    timeout=300)
    for rank, r in enumerate(reports):
        assert r["same"] and r["same_state"] and r["steps"] == 4 and r["loaded_own"], rank
        assert r["counts"][0] == (1 if rank < 2 else 0)


def test_the_node_layout_streams_on_gloo_only(monkeypatch):
    """On NCCL the thread's node broadcasts would run beside the inner steps' node all-reduce on another
    communicator: refused in one line, before any exchange."""
    from lioncub.optim import local as streaming

    monkeypatch.setattr(streaming.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(streaming.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"fragments in the node layout \(node_size=\) run on Gloo only"):
        streaming._check_backend(None)
    monkeypatch.setattr(streaming.dist, "get_backend", lambda group=None: "gloo")
    streaming._check_backend(None)
