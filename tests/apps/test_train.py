"""`lioncub train`, checkpoints and resume, predictions, and `bench train`/`bench convergence` at toy sizes."""

import dataclasses
import json
import os

import pytest

from lioncub.apps.train.loop import TrainConfig, summarize, train_local
from lioncub.apps.train.predict import momentum_interval, predict_step
from lioncub.cli import main

ROOT = os.geteuid() == 0


def _json_out(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_train_cli_json_has_the_documented_fields(capsys):
    out = _json_out(capsys, ["train", "--model", "mlp", "--ranks", "2", "--steps", "6", "--method", "l1-pbit",
                             "--momentum-sync", "every:3", "--json"])
    for key in ("step_seconds", "final_loss", "bytes_per_step", "compute_seconds", "codec_seconds",
                "comm_seconds", "mean_optimizer_seconds", "start_wait_seconds"):
        assert key in out and out[key] >= 0
    assert out["ranks"] == 2 and out["momentum_syncs"] == 2 and out["bytes_per_step"] > 0
    assert out["final_loss"] < 2.31  # below chance level (ln 10): it learns
    assert out["lr"] == TrainConfig(model="mlp").lr  # the model's default, reported


@pytest.mark.parametrize("argv, message", [
    (["--config", "{tmp}/missing.json"], "cannot read config file {tmp}/missing.json: No such file or directory"),
    (["--config", "{tmp}/bad.json"], "config file {tmp}/bad.json is not valid JSON"),
    (["--config", "{tmp}/list.json"], "config file {tmp}/list.json: expected a JSON object"),
    (["--config", "{tmp}/unknown.json"], "unknown training options: flavour"),
    (["--log", "/nonexistent/dir/log.jsonl"], "--log /nonexistent/dir/log.jsonl: no such directory"),
    (["--log", "{tmp}"], "--log {tmp}: is a directory"),
])
def test_bad_files_are_one_line_errors_before_training(tmp_path, capsys, argv, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "unknown.json").write_text('{"train": {"flavour": "vanilla"}}')
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["train", "--model", "mlp", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lioncub: error: " + message.format(tmp=tmp_path)) and err.count("\n") == 1, err


def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    common = dict(model="mlp", method="vote-1bit", momentum_sync="every:2", steps=6)
    full = train_local(TrainConfig(**common, checkpoint_dir=str(tmp_path / "a")), 2, progress=False)
    part = dict(common, steps=3, checkpoint_dir=str(tmp_path / "b"))
    train_local(TrainConfig(**part), 2, progress=False)
    assert sorted(os.listdir(tmp_path / "b")) == ["step0000003-rank0.pt", "step0000003-rank1.pt"]
    resumed = train_local(TrainConfig(**dict(part, steps=6, resume=True)), 2, progress=False)
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"]]
    assert resumed["final_loss"] == full["final_loss"]


def test_momentum_interval_and_prediction():
    assert momentum_interval("none", 100) is None
    assert momentum_interval("every:7", 700) == 7
    assert momentum_interval("first:1:10", 100) == 10  # 10 syncs in 100 steps
    cfg = TrainConfig(model="char-small", method="vote-1bit", steps=100)
    r = predict_step(cfg, 3_220_480, 0.1, ranks=4, bandwidth="100Mbit")
    assert r.baseline_step_seconds > 4 * r.step_seconds  # the scenario the demo relies on is comm-bound
    # without overlap LionCub exchanges runs of its automatic buckets (lioncub.optim.buckets.Run): one of 64 MiB here
    from lioncub.simulator import Cluster, simulate_step

    from lioncub.apps.calibrate import default_lab_profile

    plain = dataclasses.replace(cfg, overlap=False)
    want = simulate_step(Cluster.for_ranks(4, 1, bandwidth="100Mbit", latency=0.0), "vote-1bit", 3_220_480,
                         momentum_interval(cfg.momentum_sync, cfg.steps), 64.0, 0.1, backend=default_lab_profile(),
                         overlap=False, levels=cfg.levels, grad_dtype=cfg.grad_wire_dtype)
    got = predict_step(plain, 3_220_480, 0.1, ranks=4, bandwidth="100Mbit")
    assert got.buckets == want.buckets == 1 and got.step_seconds == want.step_seconds
    # local steps, in the node layout and streamed: LionCub's automatic buckets, its options
    from lioncub.comm.wire import auto_bucket_mb

    for extra, per_host in [(dict(local_steps=4, hierarchical=True, node_size=2), 2),
                            (dict(local_steps=10, fragments=5, outer_delay=1), 1)]:
        got = predict_step(dataclasses.replace(cfg, **extra), 3_220_480, 0.1, ranks=4, bandwidth="100Mbit",
                           ranks_per_host=per_host)
        kw = {k: v for k, v in extra.items() if k != "node_size"}
        want = simulate_step(Cluster.for_ranks(4, per_host, bandwidth="100Mbit", latency=0.0), "vote-1bit",
                             3_220_480, None, auto_bucket_mb(4 * 3_220_480), 0.1, backend=default_lab_profile(),
                             levels=cfg.levels, grad_dtype=cfg.grad_wire_dtype, **kw)
        assert got.step_seconds == want.step_seconds and got.local_steps == extra["local_steps"]
        assert got.hierarchical == bool(extra.get("hierarchical")) and got.fragments == extra.get("fragments")


def test_convergence_bench_checks_its_plot_path_first(capsys):
    assert main(["bench", "convergence", "--model", "mlp", "--plot", "/nonexistent/dir/c.png"]) == 2
    err = capsys.readouterr().err
    assert err == "lioncub: error: --plot /nonexistent/dir/c.png: no such directory /nonexistent/dir\n"


def test_convergence_bench_refuses_the_maps_grid_options(capsys):
    """The curves take no grid options: the convergence map is the research tools' (research/convergence_map.py)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "convergence", "--model", "mlp", "--lr", "1e-3", "--seeds", "0,1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: --lr 1e-3 --seeds 0,1\n")


def test_convergence_bench_writes_a_plot(tmp_path, capsys):
    png = tmp_path / "curves.png"
    out = _json_out(capsys, ["bench", "convergence", "--model", "mlp", "--ranks", "2", "--steps", "4",
                             "--configs", "allreduce,vote-pbit", "--plot", str(png), "--json"])
    assert [r["method"] for r in out["runs"]] == ["allreduce", "vote-pbit"]
    assert png.stat().st_size > 10_000


@pytest.mark.skipif(not ROOT, reason="the lab needs root (CAP_NET_ADMIN)")
def test_short_lab_train_bench_predicts_its_step_time(capsys):
    out = _json_out(capsys, ["bench", "train", "--bandwidth", "200Mbit", "--ranks", "2", "--steps", "4",
                             "--model", "char-tiny", "--configs", "allreduce,vote-1bit", "--json"])
    rows = {r["method"]: r for r in out["results"][0]["rows"]}
    assert rows["vote-1bit"]["bytes_vs_fp32"] < 0.05
    for r in rows.values():
        # a 4-step toy run: a busy machine only slows the measurement down, so only this side is checked
        # here; the prediction's accuracy is a benchmark figure (research/notebook/BENCHMARKS.md)
        assert 0 < r["predicted_step_seconds"] < 2.0 * r["step_seconds"], r
        assert 0 < r["of_limit"] <= 1.05


@pytest.mark.skipif(not ROOT, reason="the lab needs root (CAP_NET_ADMIN)")
def test_demo_runs_end_to_end(capsys):
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "4. train 3 steps each on the emulated Ethernet lab" in out
    assert "predicted" in out and "allreduce" in out
    # the machine is measured first, and every forecast carries the interval of the held-out probes
    assert "1. measure this machine" in out and "forecasts below carry the interval" in out
    assert "held-out probes:" in out



def test_summary_counts_every_steps_bytes_for_the_budget():
    """bytes_per_step leaves out the first two steps (as the lab's link counters do); a dense start's bytes
    are in total_bytes_sent."""
    records = [dict(step=i, loss=1.0, step_s=0.1, compute_s=0.05, codec_s=0.0, comm_s=0.05,
                    bytes_sent=1000 if i <= 3 else 10) for i in range(1, 11)]
    s = summarize(TrainConfig(steps=10), records, 1.0, 1, 2, object())
    assert s["total_bytes_sent"] == 3 * 1000 + 7 * 10
    assert s["bytes_per_step"] == pytest.approx((1000 + 7 * 10) / 8)


def test_a_learning_rate_not_above_zero_is_refused():
    with pytest.raises(ValueError, match="lr must be > 0"):
        TrainConfig(lr=0.0)
