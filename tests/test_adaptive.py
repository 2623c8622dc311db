"""The agreement statistic (lioncub.agreement) and momentum_sync="adaptive" on local Gloo ranks."""

import math

import adaptive_cases
import pytest
import torch

from lioncub import agreement, schedules, wire
from lioncub.distributed import spawn
from lioncub.methods import get


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
        got = agreement.agreement(spec.codec, [code], [n], N, levels, [layout])
        assert got == pytest.approx(expected)


def test_onebit_agreement_from_ties():
    codec = wire.SIGNS
    n = 8 * 512
    signs = torch.zeros(n // 8, dtype=torch.uint8)
    assert agreement.agreement(codec, [(signs, torch.full((n // 8,), 255, dtype=torch.uint8))], [n], 4) == 1.0
    assert agreement.agreement(codec, [(signs, torch.zeros(n // 8, dtype=torch.uint8))], [n], 4) == 0.0
    # ties at the fair-coin rate read as no agreement; odd N carries no margin
    assert agreement.tie_share_at_random(4) == pytest.approx(0.375)
    assert agreement.agreement(codec, [(signs, None)], [n], 3) is None


def test_parse_describe_adaptive():
    a = schedules.parse("adaptive")
    assert isinstance(a, schedules.Adaptive) and schedules.describe(a) == "adaptive"
    b = schedules.parse("adaptive:0.3:0.5")
    assert (b.threshold, b.budget) == (0.3, 0.5) and schedules.describe(b) == "adaptive:0.3:0.5"
    with pytest.raises(ValueError):
        schedules.parse("adaptive:2")


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
    out = spawn(adaptive_cases.adaptive_run, N, method, "adaptive:0.6", 24, timeout=300)
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
    a = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", "adaptive:0.6", 16, True, timeout=300)
    b = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", "adaptive:0.6", 16, False, timeout=300)
    assert torch.equal(a[0]["params"], b[0]["params"]) and a[0]["log"] == b[0]["log"]


def test_adaptive_resume_bit_exact():
    full = spawn(adaptive_cases.adaptive_run, 2, "vote-1bit", "adaptive:0.6", 20, timeout=300)
    resumed = spawn(adaptive_cases.adaptive_resume, 2, "vote-1bit", "adaptive:0.6", 20, 11, timeout=300)
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
        assert f["log"][11:] == r["log"]
        assert f["state"] == r["state"]
        assert not math.isnan(f["state"]["credit"])
