"""Issue 30's pre-registration of the risk rule's calls (research.risk.preregister): the calls, what it
refuses, the report per level, and the committed pre-registration."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from lioncub.apps.autotune import risk_rule
from lioncub.apps.train.configs import split_run
from lioncub.apps.tuned_lr import DEFAULT_LR
from research import RESULTS
from research import convergence_map as cm
from research.risk import preregister
from research.risk.fit import parse_regime

SETUP = dict(data="pydoc-topics", block_size=64, amp="none", eval_batches=8)


def _plan(**over):
    s = dict(name="a", model="char-tiny", steps=200, regimes=["N3-b24-x0.5", "N7-b12-x1", "N5-b8-x2"],
             configs=["vote-1bit", "l1-pbit@every:10"], seeds=[0, 1, 2], min_seeds=3, setup=SETUP, where="here")
    s.update(over)
    return dict(protocol="test", sets=[s])


def test_split_run_reads_sync_and_dense_warmup():
    assert split_run("vote-1bit") == ("vote-1bit", "none", 0)
    assert split_run("l1-pbit@every:10+warmup:100") == ("l1-pbit", "every:10", 100)
    assert cm.is_baseline("allreduce") and not cm.is_baseline("allreduce+warmup:5")
    with pytest.raises(ValueError, match="warmup:K with K >= 1"):
        split_run("vote-1bit+warmup:x")


def test_register_makes_the_rules_calls_and_prescriptions():
    p = preregister.register(_plan(), today="2026-11-27")
    assert p["written"] == "2026-11-27" and p["fit_digest"] == preregister.fit_digest()
    assert len(p["calls"]) == 3 * 2
    for c in p["calls"]:  # the oracle: the rule itself, called directly
        _, n, b, x = parse_regime(c["regime"])
        method, sync, _ = split_run(c["config"])
        r = risk_rule.risk(method, n, None, sync, 200, batch_size=b, lr=x * 5e-4, tuned_lr=5e-4)
        assert (c["level"], c["score"]) == (r["level"], r["score"])
    assert p["counts"] == {lv: sum(c["level"] == lv for c in p["calls"]) for lv in preregister.LEVELS}
    assert all(v > 0 for v in p["counts"].values())
    # plain vote-1bit's prescription where it is not low: autotune's dense warm-up for the level and the run
    for rx in p["prescriptions"]:
        level = next(c["level"] for c in p["calls"] if c["regime"] == rx["regime"] and c["config"] == "vote-1bit")
        assert level != "low" and rx["config"] == f"vote-1bit+warmup:{risk_rule.dense_warmup_for(level, 200)}"
    assert preregister.run_configs(p, "a") == ["allreduce", "vote-1bit", "l1-pbit@every:10", "vote-1bit+warmup:20"]


def test_register_refuses_seen_regimes_missing_levels_bad_sets_and_overwriting(tmp_path):
    construction = risk_rule.FIT["construction"][0]
    with pytest.raises(ValueError, match="not fresh"):
        preregister.register(_plan(regimes=[construction]))
    seen = preregister.seen_regimes([dict(model="char-tiny", cells=[dict(ranks=7, batch_size=12, lr=5e-4)])])
    assert seen == {("char-tiny", "N7-b12-x1")}
    with pytest.raises(ValueError, match="char-tiny:N7-b12-x1 has been run"):
        preregister.register(_plan(), seen)
    with pytest.raises(ValueError, match="no high call"):
        preregister.register(_plan(regimes=["N3-b24-x0.5", "N7-b12-x1"]))
    with pytest.raises(ValueError, match="is not a call"):
        preregister.register(_plan(configs=["vote-1bit+warmup:20"]))
    with pytest.raises(ValueError, match="lacks seeds"):
        preregister.register(dict(protocol="x", sets=[{k: v for k, v in _plan()["sets"][0].items() if k != "seeds"}]))
    path = tmp_path / "p.json"
    preregister.write(preregister.register(_plan()), str(path))
    with pytest.raises(ValueError, match="written once"):
        preregister.write(preregister.register(_plan()), str(path))


def _map_for(prereg, loss, seeds, model="char-tiny", steps=200):
    """A merged map whose runs have the given final loss per (config, regime, seed)."""
    rows = []
    s = prereg["sets"][0]
    for reg in s["regimes"]:
        _, n, b, x = parse_regime(reg)
        for config in preregister.run_configs(prereg, s["name"]):
            for seed in seeds:
                rows.append(dict(config=config, ranks=n, batch_size=b, lr=round(DEFAULT_LR[model] * x, 10), seed=seed,
                                 final_loss=loss(config, reg, seed), bytes_per_step=1.0, momentum_syncs=0,
                                 agreement=None, final_agreement=None))
    part = dict(model=model, steps=steps, device="cpu", **SETUP, runs=rows)
    return part


def test_report_counts_per_level_with_the_registered_seeds_only(tmp_path):
    p = preregister.register(_plan())
    # vote-1bit 1% behind on seeds 0-2, l1-pbit@every:10 3% behind; a fourth seed (not registered) 50% behind
    loss = lambda config, reg, seed: 2.0 * (1.5 if seed == 3 and config != "allreduce" else
                                            1.0 + {"vote-1bit": 0.01, "l1-pbit@every:10": 0.03}.get(config, 0)
                                            + (0.002 * seed if config != "allreduce" else 0))
    part = tmp_path / "part.json"
    part.write_text(json.dumps(_map_for(p, loss, [0, 1, 2, 3])))
    rep = preregister.report(p, {"char-tiny": cm.merge([str(part)])})
    calls = [c for c in rep["cells"] if c["kind"] == "call"]
    assert all(c["seeds"] == [0, 1, 2] and c["complete"] for c in calls)
    for c in calls:  # the oracle: the ratios recomputed here
        ratios = [loss(c["config"], c["regime"], s) / loss("allreduce", c["regime"], s) for s in (0, 1, 2)]
        assert c["measured"] == pytest.approx(statistics.fmean(ratios) - 1, abs=1e-5)
        assert c["se"] == pytest.approx(statistics.stdev(ratios) / 3 ** 0.5, abs=1e-5)
        assert c["within_2pct"] == (c["config"] == "vote-1bit")
    for lv in preregister.LEVELS:
        mine = [c for c in calls if c["level"] == lv]
        x = rep["all"]["levels"][lv]
        assert (x["calls"], x["complete"], x["within_2pct"]) == (len(mine), len(mine),
                                                                 sum(c["config"] == "vote-1bit" for c in mine))
    assert rep["all"]["base_rate"]["share"] == pytest.approx(0.5)  # vote-1bit's three regimes of six calls
    assert rep["sets"]["a"] == rep["all"] and len(rep["prescriptions"]) == len(p["prescriptions"])
    text = preregister.format_report(rep)
    assert "| all | base rate (every level) | 6 | 6 | 3 | 50% |" in text


def test_report_marks_missing_seeds_incomplete_and_refuses_another_fit_or_setup(tmp_path):
    p = preregister.register(_plan())
    part = tmp_path / "part.json"
    part.write_text(json.dumps(_map_for(p, lambda *a: 2.0, [0, 1])))
    rep = preregister.report(p, {"char-tiny": cm.merge([str(part)])})
    assert all(not c["complete"] and not c["within_2pct"] for c in rep["cells"])
    assert rep["all"]["base_rate"]["share"] is None
    assert preregister.report(p, {})["all"]["base_rate"]["complete"] == 0  # nothing run yet
    with pytest.raises(ValueError, match="fit digest differs"):
        preregister.report(dict(p, fit_digest="0" * 64), {})
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(_map_for(p, lambda *a: 2.0, [0, 1, 2]), block_size=16)))
    with pytest.raises(ValueError, match="registered"):
        preregister.report(p, {"char-tiny": cm.merge([str(other)])})


def test_the_committed_preregistration_covers_every_level_and_its_regimes_were_fresh():
    p = json.loads((RESULTS / "issue30" / "risk-rule-preregistered.json").read_text())
    assert p["fit_digest"] == preregister.fit_digest()
    assert all(p["counts"][lv] > 0 for lv in preregister.LEVELS)
    gpu = next(s for s in p["sets"] if s["name"] == "gpu")
    assert gpu["model"] == "byte-30m" and gpu["steps"] >= 1000 and len(gpu["seeds"]) >= 3
    assert {int(r.split("-")[0][1:]) for r in gpu["regimes"]} == {4, 8}
    # the maps' paths were recorded while the notebook was under docs/
    seen = [json.loads((RESULTS / m.removeprefix("docs/results/")).read_text()) for m in p["seen_maps"]]
    again = preregister.register({k: p[k] for k in ("protocol", "sets", "issue")}, preregister.seen_regimes(seen),
                                 today=p["written"])
    assert again["calls"] == p["calls"] and again["prescriptions"] == p["prescriptions"]


def _binomial_tail(hits, n, p):
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(hits, n + 1))


@pytest.mark.parametrize("hits, n", [(3, 3), (29, 29), (9, 10), (7, 9), (1, 5)])
def test_the_lower_bound_is_where_so_many_hits_become_unlikely(hits, n):
    b = preregister.lower_bound(hits, n)
    if hits == n:
        assert b == pytest.approx(0.05 ** (1 / n), abs=1e-9)  # P(all n hold) = b^n = alpha
    assert _binomial_tail(hits, n, b) == pytest.approx(0.05, abs=1e-9)
    assert _binomial_tail(hits, n, b + 0.01) > 0.05
    assert preregister.lower_bound(0, 4) == 0.0 and preregister.lower_bound(0, 0) is None
    assert preregister.lower_bound(9, 10) == pytest.approx(0.6058, abs=1e-4)  # the tabled Clopper-Pearson bound


def test_fisher_counts_every_split_of_the_hits_at_least_as_extreme():
    # low 3 of 3, medium and high 7 of 9: the two misses both among the 9 others: C(9, 2) / C(12, 2)
    assert preregister.fisher_greater(3, 3, 7, 9) == pytest.approx(36 / 66)
    # enumerate the hypergeometric directly for an uneven case
    a_hits, a_n, b_hits, b_n = 5, 6, 2, 7
    hits, total = a_hits + b_hits, a_n + b_n
    brute = sum(math.comb(a_n, k) * math.comb(b_n, hits - k) for k in range(hits + 1) if k >= a_hits and
                hits - k <= b_n) / math.comb(total, hits)
    assert preregister.fisher_greater(a_hits, a_n, b_hits, b_n) == pytest.approx(brute)
    assert preregister.fisher_greater(1, 1, 0, 0) is None


def _entry(low, medium, high):
    level = lambda hits, n: dict(complete=n, within_2pct=hits, share=hits / n if n else None)
    return dict(levels=dict(low=level(*low), medium=level(*medium), high=level(*high)),
                base_rate=dict(complete=low[1] + medium[1] + high[1]))


def test_the_verdict_says_when_the_levels_carry_no_information():
    v = preregister.verdict(_entry((3, 3), (3, 4), (4, 5)))  # the cpu set of 2026-11-27
    assert not v["low_shown"] and not v["levels_shown"] and v["levels_p"] == pytest.approx(36 / 66)
    line = preregister.verdict_line("cpu", dict(_entry((3, 3), (3, 4), (4, 5)), verdict=v))
    assert "p = 0.55" in line and "carry no information" in line and "does not show >= 90%" in line
    shown = preregister.verdict(_entry((30, 30), (5, 15), (3, 15)))
    assert shown["low_shown"] and shown["levels_shown"] and shown["levels_p"] < 1e-6
    text = preregister.verdict_line("all", dict(_entry((30, 30), (5, 15), (3, 15)), verdict=shown))
    assert text.endswith("shown.") and "shows >= 90%" in text
    alone = preregister.verdict(_entry((2, 2), (0, 0), (0, 0)))
    assert alone["levels_p"] is None
    assert "nothing compares" in preregister.verdict_line("x", dict(_entry((2, 2), (0, 0), (0, 0)), verdict=alone))
