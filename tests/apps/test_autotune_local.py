"""autotune with local steps: the measured loss table re-derived from the raw runs, the candidates checked against
simulate_step, the choice under a risk bound, and the config LionCub and `lioncub train` take."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
from lioncub.simulator import Cluster, get_profile, simulate_step
from repo import REPO

from lioncub.apps.autotune import local_evidence
from lioncub.apps.autotune.config import build_config
from lioncub.apps.autotune.models import model_spec
from lioncub.apps.autotune.space import recommend, search
from lioncub.comm import wire

RESULTS = REPO / "research" / "notebook" / "results" / "local-steps"
CLUSTER = Cluster(nodes=2, gpus_per_node=2, bandwidth="10Mbit")
P, COMPUTE = 3_220_480, 0.12


def _measured_runs() -> dict:
    """{(method, layout, H, fragments, outer_delay): {seed: eval loss}} of every run with outer avg, and the
    allreduce baselines under (allreduce, flat, None, None, None): from the grids' JSON and the single runs'."""
    runs: dict = {}
    for f in RESULTS.glob("*.json"):
        data = json.loads(f.read_text())
        for r in data.get("runs", []) if isinstance(data, dict) else []:  # (the convergence grids' files)
            m = re.fullmatch(r"([\w-]+?)(?:\+local:(\d+):avg)?", r["config"])
            if m:
                key = (m[1], "flat", int(m[2]) if m[2] else None, None, None)
                runs.setdefault(key, {})[r["seed"]] = r["final_loss"]
    for f in RESULTS.glob("*/*.json"):
        m = re.fullmatch(r"(\w+?)(?:_localsteps_\d+_outer_avg)?(?:_fragments_\d+)?(?:_delay_\d+)?"
                         r"(_hierarchical_nodesize_2)?_s(\d+)", f.stem)
        d = json.loads(f.read_text()) if m else {}
        if d.get("model") == "char-tiny" and d.get("steps") == 400:  # the table's regime (REGIME)
            key = (d["method"], "hierarchical" if m[2] else "flat", d.get("local_steps"), d.get("fragments"),
                   d.get("outer_delay") if d.get("fragments") else None)
            runs.setdefault(key, {})[int(m[3])] = d["final_loss"]
    return runs


def test_the_measured_table_is_what_the_raw_runs_give():
    runs = _measured_runs()
    base = runs.pop(("allreduce", "flat", None, None, None))
    derived = {}
    for key, seeds in runs.items():
        if key[2] is None or not set(seeds) <= set(base):
            continue
        gaps = [seeds[s] / base[s] - 1 for s in sorted(seeds)]
        se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
        derived[key] = (statistics.mean(gaps), se, len(gaps))
    assert set(derived) == set(local_evidence.MEASURED)
    for key, (mean, se, n) in local_evidence.MEASURED.items():
        got = derived[key]
        assert got[0] == pytest.approx(mean, abs=5e-5) and got[2] == n, key
        assert (se is None) == (got[1] is None) and (se is None or got[1] == pytest.approx(se, abs=5e-5)), key


def test_local_candidates_are_simulate_steps_with_their_measured_risk():
    r = search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, local_steps="measured")
    local = [c for c in r.candidates if c.local_steps]
    assert {(c.method, c.layout, c.local_steps, c.fragments, c.outer_delay) for c in local} == \
        set(local_evidence.MEASURED)
    bucket = wire.auto_bucket_mb(4 * P)
    for c in local:
        want = simulate_step(CLUSTER, c.method, P, None, bucket, COMPUTE, backend="gloo", local_steps=c.local_steps,
                             fragments=c.fragments, outer_delay=c.outer_delay, hierarchical=c.layout == "hierarchical")
        assert c.step_seconds == want.step_seconds and c.bytes_per_step == want.bytes_sent_per_rank
        excess = local_evidence.MEASURED[c.method, c.layout, c.local_steps, c.fragments, c.outer_delay][0]
        assert c.risk["excess"] == pytest.approx(excess) and c.risk["measured"] and c.dense_steps == 0
    # an interval not measured carries the worst measured excess
    other = search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, methods=["vote-1bit"], local_steps=[7],
                   fragments=[7])
    unmeasured = [c for c in other.candidates if c.local_steps == 7]
    assert {(c.layout, c.fragments) for c in unmeasured} == {("flat", None), ("flat", 7), ("hierarchical", None),
                                                             ("hierarchical", 7)}
    worst = max(v[0] for v in local_evidence.MEASURED.values())
    assert all(c.risk["excess"] == pytest.approx(worst) and not c.risk["measured"] for c in unmeasured)


def test_outer_delays_are_searched_with_their_own_measured_risk():
    """--outer-delay D: each streamed configuration with each D that F and H allow (D F < H), simulated with that D
    and carrying the loss measured with that D; the config writes it."""
    r = search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, methods=["vote-1bit"], local_steps=[25],
               fragments=[5], outer_delays=[1, 3, 5], algorithms="flat")
    streamed = {c.outer_delay: c for c in r.candidates if c.fragments == 5}
    assert set(streamed) == {1, 3}  # 5 x 5 is not below 25
    bucket = wire.auto_bucket_mb(4 * P)
    for D, c in streamed.items():
        want = simulate_step(CLUSTER, "vote-1bit", P, None, bucket, COMPUTE, backend="gloo", local_steps=25,
                             fragments=5, outer_delay=D)
        assert c.step_seconds == want.step_seconds
        assert c.risk["excess"] == pytest.approx(local_evidence.MEASURED["vote-1bit", "flat", 25, 5, D][0])
        assert f"+stream:5:{D}" in c.label()
    assert streamed[3].exposed_communication_seconds <= streamed[1].exposed_communication_seconds
    cfg = build_config(streamed[3], r, model_spec("char-small"), CLUSTER, "2 x 2", get_profile("gloo"), "", steps=2000)
    assert cfg["optimizer"]["outer_delay"] == 3 and cfg["optimizer"]["fragments"] == 5
    with pytest.raises(ValueError, match="outer delays apply to the local steps given as a list"):
        search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, local_steps="measured", outer_delays=[3])
    with pytest.raises(ValueError, match="outer delays must be integers >= 0"):
        search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, local_steps=[25], fragments=[5], outer_delays=[-1])


def test_the_risk_bound_decides_and_the_config_runs_them():
    """At 10 Mbit/s local steps are the fastest; at the default bound (medium) their measured loss keeps them out
    and the verdict says what they would give; with --max-risk high they are recommended, and the config is
    LionCub's local-step options without a dense warm-up."""
    medium = search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, local_steps="measured", max_risk=0.45 - 1e-9)
    rec, verdict = recommend(medium)
    fastest_local = min((c for c in medium.candidates if c.local_steps), key=lambda c: c.run_step_seconds)
    assert not rec.local_steps and fastest_local.run_step_seconds < rec.run_step_seconds
    assert f"local steps ({fastest_local.label()}) are forecast" in verdict and "over --max-risk" in verdict
    high = search(CLUSTER, P, COMPUTE, backend="gloo", steps=2000, local_steps="measured")
    rec, verdict = recommend(high)
    assert rec.label() == fastest_local.label()
    assert verdict.startswith("local steps pay") and rec.risk["evidence"] in verdict
    cfg = build_config(rec, high, model_spec("char-small"), CLUSTER, "2 x 2", get_profile("gloo"), verdict, steps=2000)
    assert cfg["optimizer"]["local_steps"] == rec.local_steps and "dense_warmup" not in cfg["optimizer"]
    assert cfg["optimizer"].get("hierarchical", False) == (rec.layout == "hierarchical")
    from lioncub.apps.train.loop import TrainConfig

    run = TrainConfig(**cfg["train"])
    assert run.local_steps == rec.local_steps and run.bucket_mb == rec.bucket_mb
