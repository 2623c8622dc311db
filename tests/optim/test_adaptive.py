"""The agreement statistic (lioncub.optim.schedules.agreement) and momentum_sync="adaptive" on local Gloo ranks."""

import math

import adaptive_cases
import pytest
import torch

from lioncub.comm import wire
from lioncub.comm.spawn import spawn
from lioncub.methods import get
from lioncub.optim import schedules


def _pack_fields(sums, layout):
    """Summed field values -> words (element i is field i // W of word i % W)."""
    n = sums.numel()
    W = layout.words(n)
    words = torch.zeros(W, dtype=getattr(torch, layout.dtype))
    for j in range(layout.per_word):
        part = sums[j * W:(j + 1) * W]
        if part.numel() == 0:
            break
        words[: part.numel()] |= part.to(words.dtype) << (layout.width * j)
    return words


@pytest.mark.parametrize("name", ["vote-pbit", "avg-pbit", "l1-pbit"])
@pytest.mark.parametrize("N", [2, 4, 5])
def test_field_agreement_unanimous_and_tied(name, N):
    spec = get(name)
    levels = spec.resolve_levels(N)
    layout = spec.layout(N, levels)
    n = 1000
    off = spec.codec.offset(N, levels)
    top = N * (levels if spec.codec.l1 else 1)
    for centred, expected in ((top, 1.0), (-top, 1.0), (0, 0.0)):
        code = _pack_fields(torch.full((n,), off + centred, dtype=torch.int64), layout)
        got = schedules.agreement(spec.codec, [code], [n], N, levels, [layout])
        assert got == pytest.approx(expected)


def test_onebit_agreement_from_ties():
    codec = wire.SIGNS
    n = 8 * 512
    signs = torch.zeros(n // 8, dtype=torch.uint8)
    assert schedules.agreement(codec, [(signs, torch.full((n // 8,), 255, dtype=torch.uint8))], [n], 4) == 1.0
    assert schedules.agreement(codec, [(signs, torch.zeros(n // 8, dtype=torch.uint8))], [n], 4) == 0.0
    # ties at the fair-coin rate read as no agreement; odd N carries no margin
    assert schedules.tie_share_at_random(4) == pytest.approx(0.375)
    assert schedules.agreement(codec, [(signs, None)], [n], 3) is None


def test_parse_describe_adaptive():
    a = schedules.parse("adaptive")
    assert isinstance(a, schedules.Adaptive) and schedules.describe(a) == "adaptive"
    b = schedules.parse("adaptive:0.3:0.5")
    assert (b.threshold, b.budget) == (0.3, 0.5) and schedules.describe(b) == "adaptive:0.3:0.5"
    c = schedules.parse("adaptive:0.3:0.5:7")
    assert c.start == 7 and schedules.parse(schedules.describe(c)) == c and a.start is None
    for bad in ("adaptive:2", "adaptive:0.5:1:2.5", "adaptive:0.5:1:-1", "adaptive:0.5:1:3:4"):
        with pytest.raises(ValueError):
            schedules.parse(bad)


def _lead_by_recursion(b1, b2):
    """Lion's momentum under a steady unit gradient, from zero, step by step (no closed form)."""
    m = 0.0
    for t in range(1, 100_000):
        m = b2 * m + (1 - b2) * 1.0
        if b1 * m >= (1 - b1) * (1 - 1e-12):
            return t
    return 0


@pytest.mark.parametrize("betas,expected", [((0.9, 0.99), 12), ((0.95, 0.98), 3), ((0.9, 0.999), 118),
                                            ((0.99, 0.99), 2), ((0.8, 0.95), 6)])
def test_momentum_lead_step(betas, expected):
    assert schedules.momentum_lead_step(*betas) == expected == _lead_by_recursion(*betas)
    assert schedules.momentum_lead_step(0.5, 0.99) == 0 and schedules.momentum_lead_step(0.3, 0.9) == 0
    a = schedules.Adaptive()
    assert a.start_steps([(0.9, 0.99), betas]) == max(12, expected)
    assert schedules.Adaptive(start=5).start_steps([betas]) == 5


def test_adaptive_start_is_charged_before_any_sync():
    s = schedules.Adaptive(threshold=1.0, budget=1.0)
    s.spend(12 * 1700)  # a 12-step dense start at 17x the method's 100 bytes a step
    syncs = [step for step in range(1, 600) if s.decide(step, 0.0, 100, 2100)]
    assert syncs[0] == (12 * 1700 + 2100 + 99) // 100  # once the credit has earned back the start and a sync
    assert len(syncs) * 2100 + 12 * 1700 <= 599 * 100


def test_adaptive_budget_bounds_bytes():
    s = schedules.Adaptive(threshold=1.0, budget=1.0)
    sent = syncs = 0
    for step in range(1, 500):
        if s.decide(step, 0.0, 100, 2100):
            syncs += 1
        sent += 100
    assert syncs * 2100 <= sent and syncs >= 20


@pytest.mark.parametrize("method,N", [("vote-1bit", 4), ("vote-pbit", 2), ("l1-pbit", 3)])
def test_adaptive_identical_on_ranks(method, N):
    out = spawn(adaptive_cases.adaptive_run, N, method, "adaptive:0.6:1:0", 24, timeout=300)
    logs = [r["log"] for r in out]
    assert all(log == logs[0] for log in logs), "every rank must measure and decide alike"
    assert all(r["replicas_equal"] for r in out)
    agreements = [x["agreement"] for x in logs[0]]
    assert all(a is not None and 0.0 <= a <= 1.0 for a in agreements)
    assert min(agreements[:8]) > max(agreements[10:]), "noisier ranks must agree less"
    syncs = logs[0][-1]["syncs"]
    assert syncs >= 1
    # plain method bytes: the same run without syncs
    plain = spawn(adaptive_cases.adaptive_run, N, method, "none", 24, timeout=300)
    assert out[0]["total_sent"] <= 2 * plain[0]["total_sent"]


def test_adaptive_overlap_matches_step():
    a = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", "adaptive:0.6:1:0", 16, True, timeout=300)
    b = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", "adaptive:0.6:1:0", 16, False, timeout=300)
    assert torch.equal(a[0]["params"], b[0]["params"]) and a[0]["log"] == b[0]["log"]


@pytest.mark.parametrize("sync", ["adaptive:0.6:1:0", "adaptive:0.6:1:14"])  # (resumed inside the dense start)
def test_adaptive_resume_bit_exact(sync):
    full = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", sync, 20, timeout=300)
    resumed = spawn(adaptive_cases.adaptive_resume, 2, "vote-1bit", sync, 20, 11, timeout=300)
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
        assert f["log"][11:] == r["log"]
        assert f["state"] == r["state"]
        assert not math.isnan(f["state"]["credit"])


def test_adaptive_default_start_runs_the_baseline():
    """"adaptive" with Lion's betas runs its first 12 steps as the allreduce baseline (bit-identical to
    it), charges their bytes to the guard and votes from step 13, syncing only once the credit allows."""
    guard = spawn(adaptive_cases.start_run, 2, "vote-1bit", "adaptive:0.6", 20, 12, timeout=300)
    base = spawn(adaptive_cases.start_run, 2, "allreduce", "none", 12, 12, timeout=300)
    log = guard[0]["log"]
    assert torch.equal(guard[0]["snapshot"], base[0]["snapshot"])
    assert [x["sent"] for x in log[:12]] == [x["sent"] for x in base[0]["log"]]
    assert all(x["agreement"] is None for x in log[:12]) and all(x["agreement"] is not None for x in log[12:])
    assert log[11]["credit"] == -sum(x["sent"] for x in log[:12])
    assert all(x["sent"] < log[0]["sent"] / 4 for x in log[12:]) and log[-1]["syncs"] == 0
    assert guard[0]["log"] == guard[1]["log"]
