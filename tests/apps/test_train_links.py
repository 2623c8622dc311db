"""Link bytes in `lioncub train --lab` and `lioncub bench train`, the hierarchical rows' plumbing (`+hier`,
`--ranks-per-host`, `lioncub train --hierarchical/--node-size`) and their prediction hook; train flags reaching
the config."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from lioncub.apps.benchmarks.train import HIER, _configs, bench_convergence, bench_train, format_train, reforecast
from lioncub.apps.lab import missing_privileges
from lioncub.apps.train.cli import config_from_args, register
from lioncub.apps.train.lab import link_per_step, predicted, prediction
from lioncub.apps.train.loop import TrainConfig, _lr
from lioncub.cli import main

WHY = missing_privileges()


def lab_test(fn):
    """Gated as the lab tests are: root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and the iproute2 tools."""
    for mark in (pytest.mark.root, pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(300)):
        fn = mark(fn)
    return fn


def _train_args(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_config_syntax_marks_hierarchical_rows():
    assert _configs("vote-1bit,vote-1bit+hier,l1-pbit@every:10+hier,allreduce@none") == [
        ("vote-1bit", "none", False), ("vote-1bit", "none", True), ("l1-pbit", "every:10", True),
        ("allreduce", "none", False)]
    with pytest.raises(ValueError, match=r"\+hier needs nodes of several ranks: give --ranks-per-host"):
        bench_train(["25Mbit"], ranks=4, configs="vote-1bit,vote-1bit+hier")
    with pytest.raises(ValueError, match="multiple of --ranks-per-host 3"):
        bench_train(["25Mbit"], ranks=8, ranks_per_host=3, configs="vote-1bit")
    with pytest.raises(ValueError, match=r"\+hier runs on the lab's hosts"):
        bench_convergence(ranks=2, steps=2, configs="vote-1bit+hier", model="mlp")


def test_bench_train_help_documents_the_syntax(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "method[+local:H[:outer][+stream:F[:D]]][@sync][+hier]" in out and "--ranks-per-host" in out
    assert "hierarchical layout" in out


def test_train_flags_and_config_keys_reach_the_config(tmp_path):
    cfg = config_from_args(_train_args(["--method", "vote-1bit", "--hierarchical", "--node-size", "2"]))
    assert (cfg.hierarchical, cfg.node_size) == (True, 2)
    assert config_from_args(_train_args(["--method", "vote-1bit"])).hierarchical is False
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"method": "vote-1bit", "hierarchical": True, "node_size": 4}}))
    cfg = config_from_args(_train_args(["--config", str(path)]))
    assert (cfg.hierarchical, cfg.node_size) == (True, 4)
    with pytest.raises(ValueError, match="compressed methods"):
        config_from_args(_train_args(["--method", "allreduce", "--hierarchical"]))



def test_warmup_flag_sets_the_linear_ramp_and_bad_values_are_refused(capsys):
    cfg = config_from_args(_train_args(["--warmup", "4", "--lr", "1e-3", "--steps", "24"]))
    assert cfg.warmup == 4
    assert [_lr(cfg, s) for s in (1, 2, 4)] == pytest.approx([2.5e-4, 5e-4, 1e-3])
    # then cosine from lr to 0.1 x lr over the remaining 20 steps
    assert _lr(cfg, 14) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 2))))
    assert _lr(cfg, 24) == pytest.approx(1e-4)
    assert main(["train", "--warmup", "-1", "--steps", "1"]) == 2
    assert "warmup >= 0" in capsys.readouterr().err

def test_hierarchical_local_ranks_need_a_node_size(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert main(["train", "--model", "mlp", "--ranks", "2", "--steps", "2", "--method", "vote-1bit",
                 "--hierarchical"]) == 2
    assert "--hierarchical on local ranks needs --node-size" in capsys.readouterr().err


def test_link_figures_are_per_step_means_over_hosts():
    def window(host, tx, rx):
        zero = dict(tx_bytes=0, rx_bytes=0, tx_frames=0, rx_frames=0)
        return dict(host=host, steps=4, start=zero, end=dict(tx_bytes=tx, rx_bytes=rx, tx_frames=4, rx_frames=8))

    got = link_per_step([window(1, 400, 800), None, window(0, 4000, 8000)])
    assert got["link_window_steps"] == 4 and [h["host"] for h in got["link_hosts"]] == [0, 1]
    assert got["link_hosts"][1] == dict(host=1, tx_bytes=100, rx_bytes=200, tx_frames=1, rx_frames=2)
    assert got["link_bytes_per_step"] == (3000 + 300) / 2 and got["link_tx_bytes_per_step"] == (1000 + 100) / 2
    assert link_per_step([None, None]) == {}


def test_hierarchical_prediction_uses_the_lab_nodes_or_is_absent():
    """Predicted with the simulator's hierarchical layout, nodes = the lab's hosts; None (no prediction, never
    the flat layout's) for nodes the simulator's cluster does not have."""
    summary = dict(params=3_220_480, compute_seconds=0.1)
    flat = prediction(TrainConfig(model="char-small", method="vote-1bit"), summary, 8, "25Mbit", 2)
    hier = prediction(TrainConfig(model="char-small", method="vote-1bit", hierarchical=True), summary, 8,
                      "25Mbit", 2)
    assert (flat.hierarchical, hier.hierarchical, hier.node_size) == (False, True, 2)
    assert 0.1 < hier.step_seconds < flat.step_seconds  # 25 Mbit/s: the link bytes decide
    assert 0 < hier.nic_bytes_per_node < flat.nic_bytes_per_node
    assert predicted(TrainConfig(model="char-small", method="vote-1bit"), summary, 8, "25Mbit", 2) == flat.step_seconds
    other = TrainConfig(model="char-small", method="vote-1bit", hierarchical=True, node_size=4)
    assert prediction(other, summary, 8, "25Mbit", 2) is None and predicted(other, summary, 8, "25Mbit", 2) is None


def test_table_shows_link_bytes_and_marks_hierarchical_rows():
    row = dict(method="vote-1bit", momentum_sync="none", hierarchical=False, mean_step_seconds=0.5, speedup=1.0,
               final_loss=2.0, loss_vs_baseline=0.0, bytes_per_step=1e6, bytes_vs_fp32=1.0,
               link_bytes_per_step=3e6, link_vs_baseline=1.0, predicted_step_seconds=0.45, prediction_error=-0.1,
               of_limit=0.9)
    hier = dict(row, hierarchical=True, link_bytes_per_step=1.5e6, link_vs_baseline=0.5,
                predicted_step_seconds=None, prediction_error=None)
    res = dict(model="char-small", results=[dict(ranks=8, ranks_per_host=2, bandwidth="25Mbit", steps=100,
                                                 compute_seconds=0.1, baseline="vote-1bit@none",
                                                 baseline_comm_fraction=0.8, rows=[row, hier])])
    text = format_train(res)
    assert "8 lab ranks (2 per host)" in text and "| link kB/step | vs base |" in text
    assert "| vote-1bit | none | 500.0 |" in text and "| 3000.0 | 100.0% | 450.0 | -10.0% |" in text
    assert f"| vote-1bit{HIER} | none |" in text and "| 1500.0 | 50.0% | n/a | n/a |" in text


@lab_test
def test_lab_train_counts_the_link_bytes_of_the_timed_steps(capsys):
    assert main(["train", "--lab", "--ranks", "2", "--bandwidth", "200Mbit", "--model", "char-tiny", "--steps", "6",
                 "--method", "vote-1bit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["link_window_steps"] == 4 and [h["host"] for h in out["link_hosts"]] == [0, 1]
    # one rank per host: what its link carries up is what the optimizer sent, plus TCP/IP/Ethernet framing
    # (1514 bytes per 1448 of payload), the ACKs of what it received and the small control messages
    ratio = out["link_tx_bytes_per_step"] / out["bytes_per_step"]
    assert 1514 / 1448 <= ratio <= 1.3, (ratio, out)
    assert out["link_bytes_per_step"] == pytest.approx(2 * out["link_tx_bytes_per_step"], rel=0.05)


@lab_test
def test_bench_train_runs_hierarchical_rows_on_hosts_of_two_ranks(capsys):
    assert main(["bench", "train", "--ranks", "4", "--ranks-per-host", "2", "--bandwidth", "200Mbit", "--steps", "6",
                 "--model", "char-tiny", "--configs", f"vote-1bit,vote-1bit{HIER}", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not res["failed"], res["failed"]
    assert res["model"] == res["scenario"]["model"] == "char-tiny"  # what ran, not the demo's char-small
    r = res["results"][0]
    assert r["ranks_per_host"] == 2 and r["baseline"] == "vote-1bit@none"
    assert r["congestion_control"] == "cubic"  # the lab's hosts' (netns.CONGESTION), recorded with the figures
    flat, hier = r["rows"]
    assert (flat["hierarchical"], hier["hierarchical"]) == (False, True)
    assert [h["host"] for h in flat["link_hosts"]] == [0, 1] == [h["host"] for h in hier["link_hosts"]]
    # the hierarchical layout votes across 2 nodes on half the bucket, where the flat one's 4 ranks
    # exchange all of it with one another (2 of each host's 3 peers across the link): fewer link bytes
    assert hier["link_bytes_per_step"] < flat["link_bytes_per_step"]
    assert hier["link_vs_baseline"] == pytest.approx(hier["link_bytes_per_step"] / flat["link_bytes_per_step"])
    assert 0 < hier["predicted_nic_bytes_per_step"] < flat["predicted_nic_bytes_per_step"]
    assert hier["predicted_step_seconds"] > 0
    # the JSON holds what its forecasts were made from: made again from it, each is the same
    for row in (flat, hier):
        assert reforecast(res, r, row).step_seconds == pytest.approx(row["predicted_step_seconds"], rel=1e-9)
        # and from the calibration's raw probes, fitted again as the present calibration fits them
        assert reforecast(res, r, row, refit=True).step_seconds == pytest.approx(row["predicted_step_seconds"],
                                                                                 rel=1e-9)
