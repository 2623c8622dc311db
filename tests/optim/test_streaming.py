"""LionCub(local=LocalSteps(H, fragments=F, delay=D)): streamed outer steps. Checked against the independent
replay of every rank (tests/helpers/local_cases.py's oracle, with fragments and a delay): parameters after every
step, residuals, each fragment bit-identical on every rank right after its outer step is applied, the order of
the exchanges the same on every rank, the non-finite rule, fragments=1 equal to the unstreamed steps bit for bit,
an exact resume across an exchange in flight, a failing exchange surfacing in step(), and the options' errors."""

import local_cases as lc
import pytest
import torch

from lioncub import LionCub, LocalSteps
from lioncub.comm.fragment_schedule import split
from lioncub.comm.spawn import spawn
from lioncub.optim.local import parse_outer

N = 3
# the test model's buckets (STREAM_BUCKET_MB, backward order) hold the tensors [4], [3], [2, 1], [0] (34, 33, 40
# and 35 elements): F fragments of about 142 / F elements each
EXPECTED = {1: [[4, 3, 2, 1, 0]], 2: [[4, 3], [2, 1, 0]], 3: [[4], [3, 2, 1], [0]]}


def _check(reports, method, outer, H, F, D, steps, bad=None):
    kind, outer = lc.KINDS[method], parse_outer(outer)
    fragments = reports[0]["fragments"]
    assert fragments == EXPECTED[F] and all(r["fragments"] == fragments for r in reports)
    history, residual = lc.oracle(kind, N, H, (outer.kind, outer.lr, outer.momentum), steps,
                                  lc.levels_for(method, N), bad, True, 1, fragments, D)
    for rank, rep in enumerate(reports):
        for step, rec in enumerate(rep["records"], start=1):
            for got, want in zip(rec["params"], history[step - 1][rank]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{method} rank {rank} step {step}")
        if kind != "dense":
            for got, want in zip(rep["residual"], residual[rank]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{method} rank {rank} residual")
    applied = lc.check_stream_order(reports, H, F, D, steps)
    for rep in reports:  # bytes only where an exchange is applied
        due = {d for d, _ in applied}
        assert [r["bytes"] > 0 for r in rep["records"]] == [s in due for s in range(1, steps + 1)]


@pytest.mark.parametrize("method,outer,H,F,D", [("allreduce", "nesterov", 4, 2, 1), ("vote-1bit", "nesterov", 5, 3, 1),
                                               ("l1-pbit", "sign:0.5:0.9", 6, 3, 1), ("avg-pbit", "avg:1:0.5", 6, 2, 2),
                                               ("vote-pbit", "avg:0.5", 4, 2, 0), ("vote-1bit", "avg", 4, 1, 3)])
def test_streamed_outer_steps_match_an_independent_replay(method, outer, H, F, D):
    steps = 2 * H + D + 1
    reports = spawn(lc.stream_scenario, N, method, H, outer, steps, F, D, timeout=240)
    _check(reports, method, outer, H, F, D, steps)
    assert all(r["delay"] == D for r in reports)


def test_the_script_s_collectives_meanwhile_do_not_interleave_with_the_exchanges():
    """An all-reduce on the default group before every step, while the dense exchanges (all-reduces too) are in
    flight on the streaming thread: they run on a group of their own, made with the optimizer (making it waits
    for every rank, which inside a step would be time counted nowhere), so both give the right sums."""
    reports = spawn(lc.stream_scenario, N, "allreduce", 6, "avg", 14, 2, 2, None, None, True, timeout=240)
    _check(reports, "allreduce", "avg", 6, 2, 2, 14)
    assert all(r["own_group"] for r in reports)


def test_a_bad_inner_step_is_its_rank_s_alone_and_the_default_delay_is_one():
    bad = (1, 3)
    reports = spawn(lc.stream_scenario, N, "vote-1bit", 4, "nesterov", 9, 2, None, bad, timeout=240)
    assert [r["local_skips"] for r in reports] == [0, 1, 0] and reports[0]["delay"] == 1
    _check(reports, "vote-1bit", "nesterov", 4, 2, 1, 9, bad=bad)


def test_a_non_finite_pseudo_gradient_skips_that_fragment_everywhere():
    """Tensor 0 (fragment 1 of 2, launched at t % 4 == 0) turns NaN on rank 2 at step 4: that fragment's outer
    step is skipped on every rank, which restart it from its unchanged anchor; fragment 0's (at 2 and 6) stand."""
    reports = spawn(lc.stream_scenario, N, "l1-pbit", 4, "nesterov", 7, 2, 1, None, (2, 4), timeout=240)
    start = lc.initial()
    for rep in reports:
        assert rep["outer_skips"] == 1 and rep["outer_steps"] == 2
        at5 = rep["records"][4]["params"]
        assert all(torch.equal(at5[t], start[t]) for t in (2, 1, 0))  # back at the anchor, the initial values
        assert all(not rep["residual"][t].any() for t in (2, 1, 0))  # nothing agreed, nothing dropped
        assert not torch.equal(rep["records"][6]["params"][4], start[4])


def test_one_fragment_is_the_unstreamed_outer_step_bit_for_bit():
    for method, outer in (("l1-pbit", "nesterov"), ("allreduce", "avg")):
        reports = spawn(lc.one_fragment_case, N, method, 3, outer, 7, timeout=240)
        assert all(r["same"] and r["bytes"] and r["launches"] == [(3, 0), (6, 0)] for r in reports), method


@pytest.mark.parametrize("cut", [2, 5, 6])
def test_resume_across_an_exchange_in_flight_is_bit_exact(cut):
    """H=4, F=2, D=1: fragment 0 is in flight after steps 2 and 6, fragment 1 after step 4; 5 has none."""
    reports = spawn(lc.stream_resume_case, N, "l1-pbit", 4, "nesterov", 10, cut, 2, 1, timeout=240)
    assert all(r["same"] and r["steps"] == 10 - cut for r in reports)
    assert all(r["in_flight"] == (0 if cut == 5 else 1) for r in reports)


def test_a_failing_exchange_surfaces_in_step():
    params, opt = lc.make("vote-1bit", 4, "avg", fragments=2)

    def broken(ks, step):
        raise OSError("link down")

    opt.local.exchange.agree_taken = broken
    lc.run(params, opt, 0, 1, 2)  # fragment 0 launched at 2, applied at 3
    with pytest.raises(RuntimeError, match="fragment 0's streamed outer exchange of step 2 failed: OSError"):
        lc.run(params, opt, 0, 3, 3)


def test_split_is_about_equal_and_never_empty():
    assert split([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]
    assert split([5], 1) == [[0]]


def test_options_are_checked_with_one_line_errors():
    net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])  # 8 buckets at bucket_mb=1e-5, 1 at 1
    cases = [(dict(delay=1), "delay applies only with fragments"),
             (dict(fragments=0), r"fragments must be an int in \[1, every=4\]"),
             (dict(fragments=5), r"fragments must be an int in \[1, every=4\]"),
             (dict(fragments=True), "fragments must be an int"),
             (dict(fragments=2, delay=2), "delay must be an int >= 0 below"),
             (dict(fragments=2, delay=-1), "delay must be")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LocalSteps(4, **kwargs)
    with pytest.raises(ValueError, match="more than the optimizer's 1 buckets"):
        LionCub(net.parameters(), method="vote-1bit", local=LocalSteps(4, fragments=4), bucket_mb=1.0)
    opt = LionCub(net.parameters(), method="vote-1bit", local=LocalSteps(6, fragments=3), bucket_mb=1e-5)
    assert opt.local.stream.D == 1 and opt.local.stream.offsets == [2, 4, 0]
    one = LionCub(net.parameters(), method="vote-1bit", local=LocalSteps(6, fragments=1), bucket_mb=1e-5)
    assert one.local.stream.D == 0
    plain = LionCub(net.parameters(), method="vote-1bit", local=LocalSteps(6), bucket_mb=1e-5)
    with pytest.raises(ValueError, match="streamed"):
        plain.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="fragments=3 outer_delay=1; this optimizer has fragments=1"):
        one.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("cut", [6, 5])
def test_lioncub_checkpoint_resumes_across_an_exchange_in_flight(tmp_path, cut):
    """lioncub.checkpoint.save after step 6 (fragment 0's exchange of step 6 in flight: its agreed update is saved)
    and after 5 (none in flight); each rank resumes from its own parameters: bit for bit to step 10, with the
    momenta, residuals, anchor, outer momentum and counters."""
    path = str(tmp_path / f"cut{cut}")
    reports = spawn(lc.stream_dcp_case, N, "vote-1bit", 4, "nesterov", 10, cut, path, (1, 3), 2, 1, timeout=240)
    for rank, r in enumerate(reports):
        assert r["same"] and r["same_state"] and r["steps"] == 10 - cut and r["loaded_own"], rank
        assert r["counts"][0] == (1 if rank == 1 else 0)
