"""LionCub(local=LocalSteps(H)): H local Lion steps, then an outer step agreed through the method's codec with error
feedback. Checked against an independent replay of every rank (tests/helpers/local_cases.py): parameters after
every step, the residuals, replicas bit-identical after each outer step, the non-finite rule, no_sync, an exact
resume, and the options' errors."""

import local_cases as lc
import pytest
import torch

from lioncub import LionCub, LocalSteps
from lioncub.comm.spawn import spawn
from lioncub.optim.local import Outer, parse_outer

N, H, STEPS = 3, 3, 7  # outer steps at 3 and 6, and one local step after


def _check_against_oracle(reports, method, outer, steps=STEPS, bad=None, error_feedback=True, G=1):
    kind = lc.KINDS[method]
    history, residual = lc.oracle(kind, len(reports), H, (outer.kind, outer.lr, outer.momentum), steps,
                                  lc.levels_for(method, len(reports) // G), bad, error_feedback, G)
    for rank, rep in enumerate(reports):
        for step, rec in enumerate(rep["records"], start=1):
            for got, want in zip(rec["params"], history[step - 1][rank]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{method} rank {rank} step {step}")
        if error_feedback and kind != "dense":
            for got, want in zip(rep["residual"], residual[rank]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{method} rank {rank} residual")
        else:
            assert rep["residual"] is None
    for step in range(H, steps + 1, H):  # every replica the same bits after each outer step
        first = reports[0]["records"][step - 1]["params"]
        for rep in reports[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, rep["records"][step - 1]["params"])), step
    diverged = reports[0]["records"][steps - 1]["params"]  # and apart after a local step (the next node's rank)
    if steps % H:
        assert not all(torch.equal(a, b) for a, b in zip(diverged, reports[G]["records"][steps - 1]["params"]))


@pytest.mark.parametrize("method,outer", [("allreduce", "nesterov"), ("vote-1bit", "nesterov"),
                                          ("vote-pbit", "avg:0.5"), ("avg-pbit", "avg:1:0.5"),
                                          ("l1-pbit", "sign:0.5:0.9")])
def test_local_steps_match_an_independent_replay(method, outer):
    reports = spawn(lc.scenario, N, method, H, outer, STEPS, timeout=180)
    _check_against_oracle(reports, method, parse_outer(outer))
    for rep in reports:
        sent = [r["bytes"] for r in rep["records"]]
        assert [s > 0 for s in sent] == [step % H == 0 for step in range(1, STEPS + 1)]  # only outer steps talk
        assert rep["outer_steps"] == STEPS // H and rep["local_skips"] == rep["outer_skips"] == 0


def test_without_error_feedback_and_with_an_even_world():
    reports = spawn(lc.scenario, 4, "vote-1bit", H, "avg", 6, None, None, False, timeout=180)
    _check_against_oracle(reports, "vote-1bit", parse_outer("avg"), steps=6, error_feedback=False)


def test_a_bad_inner_step_is_skipped_by_its_rank_alone():
    bad = (1, 2)  # rank 1's gradient at step 2 holds an inf
    reports = spawn(lc.scenario, N, "vote-1bit", H, "nesterov", STEPS, bad, timeout=180)
    assert [r["local_skips"] for r in reports] == [0, 1, 0]
    _check_against_oracle(reports, "vote-1bit", parse_outer("nesterov"), bad=bad)


def test_a_non_finite_pseudo_gradient_skips_the_outer_step_everywhere():
    reports = spawn(lc.scenario, N, "l1-pbit", H, "nesterov", H, None, (2, H), timeout=180)
    start = lc.initial()
    for rep in reports:
        assert rep["outer_skips"] == 1 and rep["outer_steps"] == 0
        assert all(torch.equal(a, b) for a, b in zip(rep["records"][-1]["params"], start))  # back at the anchor
        assert all(not r.any() for r in rep["residual"])  # nothing was agreed, nothing dropped


def test_resume_mid_interval_and_at_the_boundary_is_bit_exact():
    for cut in (4, 3):
        reports = spawn(lc.resume_case, N, "l1-pbit", H, "nesterov", STEPS, cut, timeout=180)
        assert all(r["same"] and r["steps"] == STEPS - cut for r in reports), cut


def test_no_sync_accumulates_and_only_outer_steps_communicate():
    reports = spawn(lc.no_sync_case, 2, 2, timeout=120)
    for r in reports:
        assert r["same"] and r["replicas"]
        assert r["sent"][0] == 0 and r["sent"][1] > 0


def test_one_rank_runs_the_outer_optimizer_on_its_own_pseudo_gradient():
    params, opt = lc.make("vote-1bit", H, "nesterov")  # no process group: G is the rank's own delta
    recs = lc.run(params, opt, 0, 1, STEPS)
    history, _ = lc.oracle("dense", 1, H, ("nesterov", 0.7, 0.9), STEPS)
    for step, rec in enumerate(recs, start=1):
        for got, want in zip(rec["params"], history[step - 1][0]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method,outer,world", [("vote-1bit", "nesterov", 6), ("l1-pbit", "sign:0.5:0.9", 4),
                                                ("avg-pbit", "avg", 4)])
def test_nodes_step_on_their_mean_and_vote_as_one(method, outer, world):
    """node_size=G: the G ranks of a node take every inner step on the node's mean gradient, and local
    rank 0 of each node votes for it across the nodes at the outer steps (the only bytes that leave a node)."""
    G, bad = 2, (1, 2)  # rank 1's inf at step 2: its whole node skips that step
    reports = spawn(lc.node_scenario, world, method, H, outer, STEPS, G, bad, timeout=300)
    _check_against_oracle(reports, method, parse_outer(outer), bad=bad, G=G)
    for rank, rep in enumerate(reports):
        assert rep["local_skips"] == (1 if rank < G else 0)
        nic = [r["bytes"] - r["node_bytes"] for r in rep["records"]]
        assert [b > 0 for b in nic] == [rank % G == 0 and step % H == 0 for step in range(1, STEPS + 1)]
        assert all(r["node_bytes"] > 0 for r in rep["records"])


def test_options_are_checked_with_one_line_errors():
    net = torch.nn.Linear(3, 2)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="every must be an int >= 1"):
            LocalSteps(bad)
    for outer, match in (("adam", "outer must be"), ("nesterov:x", "numbers"), ("avg:0", "LR must be > 0")):
        with pytest.raises(ValueError, match=match):
            LocalSteps(4, outer=outer)
    cases = [(dict(dense_warmup=3), "dense_warmup"),
             (dict(momentum_sync=5), "momentum_sync"),
             (dict(node_size=2), "needs torch.distributed initialised")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LionCub(net.parameters(), local=LocalSteps(4), **kwargs)
    with pytest.raises(ValueError, match="local must be a lioncub.LocalSteps"):
        LionCub(net.parameters(), local=4)
    assert parse_outer("nesterov") == Outer("nesterov", 0.7, 0.9)
    assert parse_outer("sign:0.25") == Outer("sign", 0.25, 0.9)
    opt = LionCub(net.parameters(), method="vote-1bit", local=LocalSteps(8))
    assert opt.local_steps == 8 and opt.engine.overlap is None
    assert opt.local.outer == Outer("avg", 1.0, 0.0)  # the default: the measured best (research/notebook/BENCHMARKS.md)
    with pytest.raises(ValueError, match="cannot add param groups"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))]))
    plain = LionCub(torch.nn.Linear(3, 2).parameters(), method="vote-1bit")
    with pytest.raises(ValueError, match="without local_steps"):
        LionCub(torch.nn.Linear(3, 2).parameters(), method="vote-1bit", local=LocalSteps(2)).load_state_dict(
            plain.state_dict())
