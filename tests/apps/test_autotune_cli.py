"""`lioncub autotune` from the command line: JSON, --output configs that LionCub and `lioncub train` accept,
bad input, calibration files and pilots."""

from __future__ import annotations

import json
import math

import pytest
from lioncub.simulator import BackendProfile, Cluster, get_profile, simulate_step

from lioncub import methods
from lioncub.apps import autotune
from lioncub.cli import main
from lioncub.optim import schedules

SLOW = ["--ranks", "4", "--bandwidth", "100Mbit", "--latency", "50us"]


def run_json(capsys, *argv):
    assert main(["autotune", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_ranked_list_and_output_config(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    out = run_json(capsys, "--model", "char-tiny", *SLOW, "--compute-seconds", "0.1", "--output", str(path))
    cfg = json.loads(path.read_text())
    assert out["recommended"] == cfg
    ranked = out["ranked"]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert [r["run_step_seconds"] for r in ranked] == sorted(r["run_step_seconds"] for r in ranked)
    assert all(r["risk"]["score"] < 0.45 for r in ranked)  # the default bound: medium
    # the config is the top (flat) row, and its prediction is simulate_step's on the same cluster and backend
    top = next(r for r in ranked if r["deployable"])
    assert (cfg["optimizer"]["method"], cfg["optimizer"]["bucket_mb"]) == (top["method"], top["bucket_mb"])
    assert cfg["optimizer"]["method"] != "allreduce"  # 100 Mbit/s: compression pays
    cluster = Cluster.for_ranks(4, bandwidth="100Mbit", latency="50us")
    sim = lambda method, k: simulate_step(cluster, method, autotune.builtin_params("char-tiny"), k, top["bucket_mb"],
                                          0.1, backend="gloo", levels=top["levels"], memory_bandwidth=2e12)
    if top["momentum_sync"] == "adaptive":
        # the guard, priced at worst: 12 dense steps (betas 0.9, 0.99), then every byte of its credit (1x the
        # method's own bytes, less the dense steps') spent on momentum syncs over the planned run
        steps = cfg["search"]["steps"]
        direct, every, dense = sim(top["method"], None), sim(top["method"], 1), sim("allreduce", None)
        syncs = max(0, math.floor((direct.bytes_sent_per_rank * (steps - 12) - 12 * dense.bytes_sent_per_rank)
                                  / (every.bytes_sent_per_rank - direct.bytes_sent_per_rank)))
        step = direct.step_seconds + syncs / (steps - 12) * every.momentum_sync_seconds
        assert cfg["predicted"]["dense_steps"] == 12 and "dense_warmup" not in cfg["optimizer"]
        assert cfg["predicted"]["run_step_seconds"] == pytest.approx(
            (12 * dense.step_seconds + (steps - 12) * step) / steps, rel=1e-12)
    else:
        k = None if top["momentum_sync"] == "none" else int(top["momentum_sync"].split(":")[1])
        direct = sim(top["method"], k)
        step = direct.step_seconds
    assert cfg["predicted"]["step_seconds"] == pytest.approx(step, rel=1e-12)
    assert cfg["predicted"]["baseline"]["step_seconds"] == pytest.approx(direct.baseline_step_seconds, rel=1e-12)
    assert cfg["cluster"]["backend"] == "gloo" and cfg["cluster"]["ranks"] == 4
    assert cfg["train"]["model"] == "char-tiny" and cfg["risk"]["level"] in ("low", "medium")
    assert {"within_risk", "configurations", "seconds"} <= set(cfg["search"])
    # best_per_method: one flat row per method
    assert sorted(r["method"] for r in out["best_per_method"]) == sorted(methods.NAMES)


def test_config_round_trips_into_lioncub_and_trainconfig(tmp_path, capsys):
    import torch

    from lioncub.apps.train.loop import TrainConfig
    from lioncub.optim import LionCub

    cluster = Cluster.for_ranks(16, bandwidth="1Gbit", latency="50us")
    model = autotune.model_spec("char-small", compute_seconds=0.05)
    res = autotune.search(cluster, model.params, model.compute_seconds, steps=200, backend="gloo")
    for c in res.best_per_method():
        cfg = json.loads(json.dumps(autotune.build_config(c, res, model, cluster, "test", get_profile("gloo"),
                                                          "v", steps=200)))
        net = torch.nn.Linear(8, 3)
        opt = LionCub(net.parameters(), lr=1e-3, **cfg["optimizer"])
        assert opt.method == c.method and opt.bucket_mb == c.bucket_mb
        assert opt.levels == (c.levels or 0)
        want = "none" if c.method == "allreduce" else c.momentum_sync
        assert schedules.describe(opt.schedule) == want
        tc = TrainConfig.from_dict(cfg["train"])
        assert (tc.model, tc.method, tc.levels, tc.momentum_sync, tc.bucket_mb, tc.steps) == (
            "char-small", c.method, c.levels, want, c.bucket_mb, 200)
    # a preset model: the train section carries the optimizer fields only
    path = tmp_path / "gpt.json"
    run_json(capsys, "--model", "gpt2-124m", "--ranks", "8", "--bandwidth", "1Gbit", "--output", str(path))
    cfg = json.loads(path.read_text())
    LionCub(torch.nn.Linear(4, 4).parameters(), lr=1e-4, **cfg["optimizer"])
    tc = TrainConfig.from_dict(cfg["train"])
    assert tc.method == cfg["optimizer"]["method"] and "model" not in cfg["train"]


def test_lioncub_train_accepts_the_config(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    run_json(capsys, "--model", "mlp", *SLOW, "--methods", "l1-pbit,allreduce", "--max-risk", "high",
             "--output", str(path))
    cfg = json.loads(path.read_text())
    assert main(["train", "--config", str(path), "--steps", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["model"], summary["method"], summary["steps"]) == ("mlp", cfg["train"]["method"], 2)
    assert math.isfinite(summary["final_loss"])


def test_text_output_says_when_compression_does_not_pay(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    assert main(["autotune", "--params", "25M", "--compute-seconds", "0.05", "--ranks", "8", "--bandwidth",
                 "100Gbit", "--latency", "5us", "--momentum-sync", "none,every:16", "--output", str(path)]) == 0
    text = capsys.readouterr().out
    coll = json.loads(path.read_text())["collective"]
    if "NCCL_ALGO" in coll["env"]:  # pinned only when it is what every allreduce of the step uses
        want = {"Ring": "ring", "Tree": "binomial-tree"}[coll["env"]["NCCL_ALGO"]]
        assert {c["algorithm"].split(":")[-1] for c in coll["collectives"]} == {want}
    assert "compression does not pay" in text and "Use allreduce" in text
    assert "recommended: allreduce" in text
    rows = [line.split() for line in text[text.index("-  -"):].splitlines()[1:] if line.strip()]
    assert any(r[0].endswith("*") and r[1] == "allreduce" for r in rows)  # the recommended row


def test_max_risk_and_top(capsys):
    # 4 ranks: on the convergence map, where the risk rule can call a compressed method low
    args = ["--params", "100M", "--compute-seconds", "0.1", "--ranks", "4", "--bandwidth", "1Gbit",
            "--bucket-mb", "25,100", "--momentum-sync", "none,every:1,every:8,every:64"]
    out = run_json(capsys, *args, "--max-risk", "low", "--top", "5")
    assert len(out["ranked"]) == 5 and all(r["risk"]["level"] == "low" for r in out["ranked"])
    out_all = run_json(capsys, *args, "--max-risk", "high")
    lows = [r for r in out_all["ranked"] if r["risk"]["score"] < 0.2]
    assert [(r["method"], r["momentum_sync"], r["bucket_mb"], r["levels"]) for r in lows[:5]] == [
        (r["method"], r["momentum_sync"], r["bucket_mb"], r["levels"]) for r in out["ranked"]]
    assert out_all["search"]["within_risk"] == out_all["search"]["configurations"]


def test_the_risk_rule_reads_lr_against_the_models_tuned_lr(capsys):
    args = ["--ranks", "4", "--bandwidth", "1Gbit", "--bucket-mb", "25", "--momentum-sync", "none",
            "--max-risk", "high"]
    custom = ["--params", "3M", "--compute-seconds", "0.02", *args]
    risks = lambda out: {(r["method"], r["levels"]): r["risk"]["score"] for r in out["ranked"]}
    tuned = risks(run_json(capsys, *custom))
    assert risks(run_json(capsys, *custom, "--lr", "3e-3")) == tuned  # another model's --lr alone: taken as tuned
    twice = risks(run_json(capsys, *custom, "--lr", "1e-3", "--tuned-lr", "5e-4"))
    assert any(twice[k] > tuned[k] for k in tuned) and all(twice[k] >= tuned[k] for k in tuned)
    # a built-in model's tuned lr is its default: char-small at 5e-4 is twice its 2.5e-4
    small = ["--model", "char-small", "--compute-seconds", "0.02", *args]
    assert risks(run_json(capsys, *small, "--lr", "5e-4")) == risks(run_json(capsys, *custom, "--lr", "2e-3",
                                                                             "--tuned-lr", "1e-3"))
    for bad in (["--tuned-lr", "0"], ["--lr=-1e-3"]):
        assert main(["autotune", *custom, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lioncub: error:") and "must be > 0" in err and "Traceback" not in err


def test_calibration_file_is_used(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"name": "gloo-lab", "message_overhead": 2e-3, "window_bytes": 65536}))
    args = ["--params", "3M", "--compute-seconds", "0.02", *SLOW, "--backend", "gloo", "--momentum-sync", "none"]
    plain = run_json(capsys, *args)
    calibrated = run_json(capsys, *args, "--calibration", str(cal))
    cluster = Cluster.for_ranks(4, bandwidth="100Mbit", latency="50us")
    want = simulate_step(cluster, "allreduce", 3_000_000, None, 25, 0.02, backend=BackendProfile.load(cal, base="gloo"),
                         memory_bandwidth=2e12).step_seconds
    assert calibrated["baseline"]["step_seconds"] == pytest.approx(want, rel=1e-12)
    assert calibrated["baseline"]["step_seconds"] > plain["baseline"]["step_seconds"]
    assert calibrated["cluster"]["backend"] == "gloo-lab"


@pytest.mark.parametrize("argv, match", [
    (["--model", "gpt5", *SLOW], "unknown model"),
    (["--model", "mlp"], "describe the cluster"),
    (["--model", "mlp", "--preset", "nope"], "unknown cluster preset"),
    (["--model", "mlp", "--ranks", "6", "--gpus-per-node", "4"], "multiple"),
    (["--model", "mlp", *SLOW, "--max-risk", "extreme"], "max-risk"),
    (["--model", "mlp", *SLOW, "--bucket-mb", "4,x"], "bucket-mb"),
    (["--model", "mlp", *SLOW, "--momentum-sync", "every:x"], "momentum-sync"),
    (["--model", "mlp", *SLOW, "--methods", "adam"], "unknown method"),
    (["--model", "mlp", *SLOW, "--levels", "0"], "levels"),
    (["--model", "mlp", *SLOW, "--pilot", "0"], "pilot"),
    (["--model", "mlp", *SLOW, "--pilot", "3", "--pilot-model", "gpt2-124m"], "pilot-model"),
    (["--model", "mlp", *SLOW, "--top", "0"], "top"),
    (["--model", "mlp", *SLOW, "--calibration", "/nonexistent/cal.json"], "calibration"),
    (["--params", "lots", *SLOW], "--params"),
    (["--model", "mlp", "--ranks", "4", "--bandwidth=0Gbit"], "bandwidth must be positive"),
    (["--model", "mlp", *SLOW, "--output", "/nonexistent/dir/cfg.json"], "--output /nonexistent/dir/cfg.json: no such"),
    (["--model", "mlp", *SLOW, "--output", "/"], "is a directory"),
    (["--model", "mlp", *SLOW, "--memory-per-rank", "lots"], "malformed size"),
    (["--model", "mlp", *SLOW, "--local-steps", "0"], "local steps must be positive integers"),
    (["--model", "mlp", *SLOW, "--local-steps", "ten"], "--local-steps: not an integer"),
    (["--model", "mlp", *SLOW, "--local-steps", "10", "--fragments", "x"], "--fragments: not an integer"),
    (["--model", "mlp", *SLOW, "--fragments", "5"], "fragments apply to the local steps given as a list"),
    (["--model", "mlp", *SLOW, "--outer-delay", "3"], "outer delays apply to the local steps given as a list"),
    (["--model", "mlp", *SLOW, "--local-steps", "10", "--fragments", "5", "--outer-delay", "-1"],
     "outer delays must be integers >= 0"),
])
def test_bad_input_is_a_clear_error(argv, match, capsys):
    assert main(["autotune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lioncub: error:") and match in err and "Traceback" not in err


def test_the_pilot_overrules_the_simulator_only_when_a_run_reaches_the_target():
    from types import SimpleNamespace

    def cand(name, step):
        return SimpleNamespace(label=lambda: name, step_seconds=step)

    pick, other = cand("vote-1bit", 0.01), cand("l1-pbit", 0.02)
    runs = lambda *rs: {"runs": [dict(candidate=c, time_to_target=t, steps_to_target=k) for c, t, k in rs]}
    rec, verdict = autotune.pilot_verdict(pick, "vote-1bit pays.", runs((other, 0.2, 10), (pick, 0.3, 30)))
    assert rec is other and verdict.startswith("the pilot overrides the simulator's pick (vote-1bit): l1-pbit")
    assert autotune.pilot_verdict(pick, "vote-1bit pays.", runs((pick, 0.3, 30), (other, 0.4, 20))) == (
        pick, "vote-1bit pays. The pilot agrees: it reaches the target loss first in predicted time.")
    assert autotune.pilot_verdict(pick, "vote-1bit pays.", runs((other, None, None), (pick, None, None))) == (
        pick, "vote-1bit pays.")


def test_pilot_ranking_by_predicted_time_to_target(monkeypatch):
    """A runner with known loss curves: the ranking is (first step the smoothed loss reaches the target)
    x (predicted step time), computed here by hand."""
    cluster = Cluster.for_ranks(4, bandwidth="100Mbit", latency="50us")
    res = autotune.search(cluster, 100_000, 0.01, steps=200, momentum_syncs=["none", "every:2"], bucket_mbs=[25])
    cands = autotune.pilot_candidates(res.ranked, 3, steps=20)
    assert cands[0].method == "allreduce" and len(cands) == 4
    keys = [(c.method, c.levels, c.momentum_sync) for c in cands[1:]]
    assert len(set(keys)) == 3 and all(c.deployable for c in cands)
    curves = {  # loss at step t (1-based); same value held so the trailing mean is exact
        0: [5.0 - 0.1 * t for t in range(1, 21)],  # allreduce
        1: [5.0 - 0.05 * t for t in range(1, 21)],  # half as fast per step: never reaches the target
        2: [5.0 - 0.2 * t for t in range(1, 21)],  # twice as fast per step
        3: [5.0 - 0.1 * t for t in range(1, 21)],  # as fast per step as allreduce
    }
    seen = []

    def fake(cfg, ranks, cluster=None):
        i = len(seen)
        seen.append((cfg, ranks))
        return {"final_loss": curves[i][-1], "records": [{"loss": x} for x in curves[i]], "step_seconds": 0.01}

    monkeypatch.setitem(autotune.PILOT_RUNNERS, "fake", fake)
    p = autotune.run_pilots(cands, steps=20, ranks=2, model="char-tiny", runner="fake")
    assert [cfg.method for cfg, _ in seen] == [c.method for c in cands] and all(r == 2 for _, r in seen)
    assert all(cfg.steps == 20 and cfg.model == "char-tiny" for cfg, _ in seen)
    w = max(1, 20 // 10)
    sm = {i: [sum(c[max(0, j - w + 1): j + 1]) / len(c[max(0, j - w + 1): j + 1]) for j in range(20)]
          for i, c in curves.items()}
    target = sm[0][math.ceil(20 * 2 / 3) - 1]
    assert p["target_loss"] == pytest.approx(target)
    expect = []
    for i, c in enumerate(cands):
        hit = next((j + 1 for j, x in enumerate(sm[i]) if x <= target + 1e-12), None)
        expect.append((hit is None, hit * c.step_seconds if hit else sm[i][-1], i))
    order = [i for *_, i in sorted(expect)]
    assert [r["candidate"] for r in p["runs"]] == [cands[i] for i in order]
    assert p["runs"][-1]["candidate"] is cands[1] and p["runs"][-1]["time_to_target"] is None
    # an explicit target
    seen.clear()
    p = autotune.run_pilots(cands, steps=20, ranks=2, model="char-tiny", runner="fake", target_loss=1.5)
    assert p["target_loss"] == 1.5 and p["runs"][0]["candidate"] is cands[2]


def test_pilot_time_to_target_of_the_guard_counts_its_dense_start(monkeypatch):
    cluster = Cluster.for_ranks(4, bandwidth="100Mbit", latency="50us")
    res = autotune.search(cluster, 100_000, 0.01, steps=200, methods=["allreduce", "vote-1bit"],
                          momentum_syncs=["adaptive"], bucket_mbs=[25], batch_size=32, lr=2.5e-4, tuned_lr=5e-4)
    guard = next(c for c in res.candidates if c.momentum_sync == "adaptive")  # low risk: no warm-up beyond its start
    dense = simulate_step(cluster, "allreduce", 100_000, None, 25, 0.01).step_seconds
    assert guard.dense_steps == 12 and guard.dense_step_seconds == pytest.approx(dense, rel=1e-12)
    curve = [5.0 - 0.1 * t for t in range(1, 21)]  # the smoothed loss reaches 3.5 at step 15 or 16
    fake = lambda cfg, ranks, cluster=None: {"final_loss": curve[-1], "records": [{"loss": x} for x in curve]}
    monkeypatch.setitem(autotune.PILOT_RUNNERS, "fake", fake)
    (r,) = autotune.run_pilots([guard], steps=20, ranks=2, model="char-tiny", runner="fake", target_loss=3.5)["runs"]
    hit = r["steps_to_target"]
    assert hit > 12 and r["time_to_target"] == pytest.approx(12 * dense + (hit - 12) * guard.step_seconds, rel=1e-12)


def test_tiny_real_pilot(capsys):
    out = run_json(capsys, "--model", "mlp", "--ranks", "2", "--bandwidth", "100Mbit", "--pilot", "3",
                   "--pilot-ranks", "2", "--pilot-top", "1", "--momentum-sync", "none,every:2")
    p = out["pilot"]
    assert (p["steps"], p["ranks"], p["model"], p["runner"]) == (3, 2, "mlp", "local")
    assert len(p["runs"]) == 2 and {r["method"] for r in p["runs"]} >= {"allreduce"}
    for r in p["runs"]:
        assert math.isfinite(r["final_eval_loss"]) and r["train_config"]["steps"] == 3
    reached = [r["predicted_time_to_target_seconds"] for r in p["runs"] if r["steps_to_target"] is not None]
    assert reached == sorted(reached) and reached  # the allreduce pilot reaches its own target
    assert out["recommended"]["pilot"] == p


def test_hierarchical_candidates_are_piloted_in_their_layout(monkeypatch):
    """A hierarchical candidate trains differently (node means vote), so its pilot runs hierarchical, on
    nodes the pilot's ranks can hold."""
    assert [autotune.pilot_node_size(r, 8) for r in (16, 8, 6, 4, 3, 2)] == [8, 4, 3, 2, 1, 1]
    cluster = Cluster.for_ranks(16, 4, bandwidth="10Gbit", latency="20us")
    res = autotune.search(cluster, 100_000_000, 0.05, methods=["vote-1bit"], momentum_syncs=["none"],
                          bucket_mbs=[25])
    cands = autotune.pilot_candidates(res.ranked, 4, steps=10)
    # the sharded layout trains the hierarchical arithmetic: one pilot for the faster of the two, in that layout
    assert sorted(c.layout for c in cands if c.method == "vote-1bit") in (["flat", "hierarchical"], ["flat", "sharded"])
    seen = []

    def fake(cfg, ranks, cluster=None):
        seen.append(cfg)
        return {"final_loss": 1.0, "records": [{"loss": 1.0}] * 10, "step_seconds": 0.01}

    monkeypatch.setitem(autotune.PILOT_RUNNERS, "fake", fake)
    autotune.run_pilots(cands, steps=10, ranks=4, model="char-tiny", runner="fake", cluster=cluster, target_loss=1.0)
    layouts = {(cfg.method, cfg.hierarchical, cfg.node_size) for cfg in seen}
    assert layouts == {("vote-1bit", False, None), ("vote-1bit", True, 2)}


def test_memory_per_rank_recommends_the_sharded_layout(tmp_path, capsys):
    path = tmp_path / "tuned.json"
    argv = ["--params", "500M", "--compute-seconds", "0.2", "--ranks", "16", "--gpus-per-node", "4", "--bandwidth",
            "100Gbit", "--intra-bandwidth", "20Gbit", "--methods", "allreduce,vote-1bit", "--momentum-sync", "none",
            "--bucket-mb", "25"]
    assert run_json(capsys, *argv)["recommended"]["train"].get("node_size") is None  # flat is fastest
    out = run_json(capsys, *argv, "--memory-per-rank", "1.6GiB", "--output", str(path))
    assert {c["layout"] for c in out["ranked"]} == {"sharded"}
    assert all(c["memory_fraction"] == 0.25 for c in out["ranked"])
    cfg = json.loads(path.read_text())
    assert cfg["train"]["method"].startswith("hsdp+") and cfg["train"]["node_size"] == 4
    assert cfg["search"]["memory_per_rank"] == "1.6GiB"
    assert main(["autotune", *argv, "--memory-per-rank", "1.6GiB"]) == 0
    text = capsys.readouterr().out
    assert "lioncub.attach_fsdp(model, opt, mesh)" in text and "0.250 of a replica's" in text
