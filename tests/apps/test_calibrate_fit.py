"""Calibration without a lab: the fit recovers known parameters from synthetic measurements, its file
drives `lioncub simulate --calibration`, the bundled lab profile loads, and bad input is a clear error."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
from lioncub.simulator import BackendProfile, Cluster, get_profile, simulate_collective, simulate_step

from lioncub.apps.calibrate import (
    DEFAULT_LAB_PROFILE,
    CalibrationError,
    default_lab_profile,
    default_lab_profile_info,
    fit,
    host_kernel_figures,
    plan,
    predict,
)
from lioncub.cli import main

MiB = 2**20
RATE = 500e6
BUCKET = int(RATE / 8 * 0.004) + 1514  # the lab's tbf bucket at this rate: 4 ms + one frame

# Gloo's structure, written out here rather than imported from the code under test
GLOO_STRUCTURE = dict(
    rendezvous=True,
    slice_bytes=float(MiB),
    algorithms={"allreduce": ["ring"], "allgather": ["ring"], "reducescatter": ["ring"],
                "alltoall": ["all-at-once"], "broadcast": ["binomial-tree"], "reduce": ["binomial-tree"]},
)
TRUTH = get_profile("gloo").replace(
    name="truth", wire_efficiency=0.93, call_overhead=150e-6, message_overhead=45e-6, link_burst=1.2e-3,
    efficiency={"allreduce": 0.95, "allgather": 0.88, "reducescatter": 0.48}, rendezvous_stagger=0.6,
    **GLOO_STRUCTURE)


def synthetic(profile: BackendProfile, noise: float, seed: int = 0, ranks: int = 4) -> list[dict]:
    """The calibration probes as the simulator with `profile` times them, times log-normal noise."""
    rng = random.Random(seed)
    out = []
    for p in plan(ranks, RATE):
        m = {"op": p["op"], "size": p["size"], "ranks": ranks, "bandwidth_bps": RATE, "tbf_burst_bytes": BUCKET}
        t = predict(profile, m)
        m["seconds"] = t * math.exp(rng.gauss(0, noise))
        m["min"] = t * math.exp(rng.gauss(0, noise))
        out.append(m)
    return out


@pytest.fixture(scope="module")
def noisy_fit():
    return fit(synthetic(TRUTH, noise=0.01, seed=1))


def test_fit_recovers_known_parameters_from_exact_measurements():
    prof, rep = fit(synthetic(TRUTH, noise=0.0))
    assert prof.wire_efficiency == pytest.approx(0.93, rel=2e-3)
    for fam, v in TRUTH.efficiency.items():
        assert prof.efficiency[fam] == pytest.approx(v, rel=0.01), fam
    assert prof.rendezvous is True and prof.rendezvous_stagger == pytest.approx(0.6, abs=0.02)
    assert prof.call_overhead == pytest.approx(150e-6, rel=0.05)
    assert prof.message_overhead == pytest.approx(45e-6, rel=0.05)
    assert prof.link_burst == pytest.approx(1.2e-3, rel=0.1)
    assert rep["max_abs_rel_error"] < 0.01


def test_fit_recovers_known_parameters_through_noise(noisy_fit):
    prof, rep = noisy_fit
    assert prof.wire_efficiency == pytest.approx(0.93, rel=0.02)
    for fam, v in TRUTH.efficiency.items():
        assert prof.efficiency[fam] == pytest.approx(v, rel=0.04), fam
    assert prof.rendezvous_stagger == pytest.approx(0.6, abs=0.1)
    assert prof.call_overhead == pytest.approx(150e-6, rel=0.3)
    assert prof.message_overhead == pytest.approx(45e-6, rel=0.3)
    assert 0.5e-3 < prof.link_burst < 2e-3
    assert rep["median_abs_rel_error"] < 0.02


def test_fitted_profile_predicts_settings_it_did_not_see(noisy_fit):
    prof, _ = noisy_fit
    for ranks, rate, op, size in ((8, 1e9, "allreduce", 64 * MiB), (3, 100e6, "allgather", 16 * MiB),
                                  (6, 250e6, "alltoall", 16 * MiB), (2, 1e9, "l1-pbit", 64 * MiB)):
        m = {"op": op, "size": size, "ranks": ranks, "bandwidth_bps": rate}
        assert predict(prof, m) == pytest.approx(predict(TRUTH, m), rel=0.05), (ranks, rate, op)


def test_wire_efficiency_is_the_slope_of_the_two_largest_ping_pongs():
    # one way: a + size / (rate/8 * w), whatever a is; the fit must return w
    w, a = 0.9564, 0.004
    ms = []
    for size in (4096, 4 * MiB, 16 * MiB):
        t = a + size / (RATE / 8 * w)
        ms.append({"op": "p2p", "size": size, "ranks": 2, "bandwidth_bps": RATE, "seconds": t, "min": t})
    ms.append({"op": "allreduce", "size": 8 * MiB, "ranks": 2, "bandwidth_bps": RATE, "seconds": 0.3, "min": 0.3})
    prof, _ = fit(ms)
    assert prof.wire_efficiency == pytest.approx(w, rel=1e-3)


def test_host_kernel_figures():
    n, world = 1 << 20, 4
    hk = {"elements": n, "world_size": world, "vote_bytes": 8 << 20,
          "seconds": {"update": 0.010, "sum": 0.002, "vote-pbit": 0.019, "vote": 0.016}}
    got = host_kernel_figures(hk)
    assert got["reduce_bandwidth"] == pytest.approx(4 * n / 0.002)
    assert got["update"] == pytest.approx(20 * n / 0.010)  # read p, g, m; write p, m
    # vote-pbit at 4 ranks moves 9 bytes per parameter beyond the update (see test_calibrate_mechanisms);
    # its codec is what it takes beyond the plain update: 19 ms - 10 ms
    assert got["vote-pbit"] == pytest.approx(9 * n / 0.009)
    assert got["vote"] == pytest.approx((8 << 20) / 0.016)
    with pytest.raises(CalibrationError, match="positive"):
        host_kernel_figures(dict(hk, seconds={"update": 0.0}))
    with pytest.raises(CalibrationError, match="lack"):
        host_kernel_figures({"seconds": {}})


# ---- the calibration file and the CLI --------------------------------------------------------------
@pytest.fixture()
def saved(tmp_path):
    raw = {"measurements": synthetic(TRUTH, noise=0.005, seed=2),
           "host_kernels": {"elements": 1 << 20, "world_size": 4, "vote_bytes": 8 << 20,
                            "seconds": {"update": 0.010, "sum": 0.002, "vote-pbit": 0.019, "vote-allgather": 0.02,
                                        "vote-1bit": 0.02, "avg-pbit": 0.019, "l1-pbit": 0.03, "vote": 0.016}},
           "setting": {"where": "synthetic", "ranks": 4, "bandwidth_bps": RATE}}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    return path


def test_cli_fits_saved_measurements_and_simulate_reads_the_file(saved, tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--from-measurements", str(saved), "--output", str(out), "--json",
                 "--name", "gloo-test"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["output"] == str(out) and summary["profile"]["name"] == "gloo-test"
    assert set(summary["fitted"]) >= {"wire_efficiency", "call_overhead", "message_overhead", "efficiency",
                                      "link_burst", "rendezvous_stagger", "codec_bandwidth"}
    assert len(summary["residuals"]) == len(json.loads(saved.read_text())["measurements"])
    assert summary["median_abs_rel_error"] < 0.03
    prof = BackendProfile.load(out)
    assert prof.to_dict() == summary["profile"]

    # `lioncub simulate ... --calibration FILE` uses it, with any --backend as the base
    args = ["simulate", "collective", "--op", "alltoall", "--algorithm", "auto", "--ranks", "6", "--size", "16MiB",
            "--bandwidth", "250Mbit", "--latency", "0", "--calibration", str(out), "--json"]
    for backend in ("gloo", "nccl"):
        assert main(args + ["--backend", backend]) == 0
        sim = json.loads(capsys.readouterr().out)
        expect = predict(prof, {"op": "alltoall", "size": 16 * MiB, "ranks": 6, "bandwidth_bps": 250e6})
        assert sim["seconds"] == pytest.approx(expect, rel=1e-9)
    plain = simulate_collective(Cluster(nodes=6, bandwidth=250e6, latency=0), "alltoall", "auto", 16 * MiB, "gloo")
    assert abs(sim["seconds"] / plain.seconds - 1) > 0.2  # the calibration changes the answer

    # the step model reads the measured codec speeds from the file
    assert main(["simulate", "step", "--method", "vote-pbit", "--params", "1M", "--compute-seconds", "0.1",
                 "--ranks", "4", "--bandwidth", "500Mbit", "--latency", "0", "--calibration", str(out), "--json"]) == 0
    step = json.loads(capsys.readouterr().out)
    assert step["codec_seconds"] == pytest.approx(9 * 1e6 / prof.codec_bandwidth["vote-pbit"], rel=1e-9)
    ref = simulate_step(Cluster(nodes=4, bandwidth=500e6, latency=0), "vote-pbit", params=1e6, compute_seconds=0.1,
                        backend=prof)
    assert step["step_seconds"] == pytest.approx(ref.step_seconds, rel=1e-9)


def test_cli_text_summary(saved, tmp_path, capsys):
    assert main(["calibrate", "--from-measurements", str(saved), "--output", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "wire_efficiency" in out and "rendezvous" in out and "allreduce" in out


@pytest.mark.parametrize("content, match", [
    ("not json", "not valid JSON"),
    ('{"foo": 1}', "measurements"),
    ('{"measurements": []}', "no measurements"),
    ('[{"op": "allreduce", "size": 4096}]', "lacks"),
    ('[{"op": "allreduce", "size": 4096, "ranks": 4, "bandwidth_bps": 1e9, "seconds": -1, "min": 1}]', "positive"),
    ('[{"op": "bcast", "size": 4096, "ranks": 4, "bandwidth_bps": 1e9, "seconds": 1, "min": 1}]', "unknown op"),
    ('[{"op": "allreduce", "size": 4096, "ranks": 1, "bandwidth_bps": 1e9, "seconds": 1, "min": 1}]', "2 ranks"),
    ('[{"op": "allreduce", "size": 4096, "ranks": 4, "bandwidth_bps": 1e9, "seconds": 1, "min": 1}]', "above 16 KiB"),
])
def test_bad_measurements_are_clear_errors(tmp_path, capsys, content, match):
    path = tmp_path / "m.json"
    path.write_text(content)
    assert main(["calibrate", "--from-measurements", str(path), "--output", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "lioncub: error:" in err and match in err
    assert not (tmp_path / "c.json").exists()


def test_bad_invocations_are_clear_errors(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["calibrate", "--output", str(tmp_path / "c.json")]) == 2
    assert "--lab" in capsys.readouterr().err
    assert main(["calibrate", "--from-measurements", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["calibrate", "--lab", "--base", "nccl"]) == 2
    assert "Gloo" in capsys.readouterr().err
    assert main(["calibrate", "--lab", "--latency", "1ms"]) == 2
    assert "netem" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 ranks"):
        plan(1, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        plan(4, 0)


@pytest.mark.parametrize("flag", ["--output", "--save-measurements"])
def test_files_to_write_are_checked_before_measuring(saved, tmp_path, capsys, flag):
    argv = ["calibrate", "--from-measurements", str(saved), "--output", str(tmp_path / "c.json")]
    assert main(argv + [flag, "/nonexistent/dir/out.json"]) == 2
    err = capsys.readouterr().err
    assert err == f"lioncub: error: {flag} /nonexistent/dir/out.json: no such directory /nonexistent/dir\n"


def test_lab_calibration_without_privileges_says_what_is_missing(monkeypatch, capsys, tmp_path):
    from lioncub.apps.lab import netns

    monkeypatch.setattr(netns, "missing_privileges", lambda: "lioncub lab needs root: CAP_NET_ADMIN (test)")
    assert main(["calibrate", "--lab", "--output", str(tmp_path / "c.json")]) == 1
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


# ---- the bundled lab calibration ---------------------------------------------------------------------
def test_bundled_lab_profile_loads_and_says_where_it_came_from():
    prof = default_lab_profile()
    info = default_lab_profile_info()
    assert prof.name == "gloo-lab" and prof.rendezvous is True
    assert 0.9 < prof.wire_efficiency <= 1 and prof.link_burst > 0
    assert {"allreduce", "allgather"} <= set(prof.efficiency)
    assert {"update", "vote", "vote-1bit", "l1-pbit"} <= set(prof.codec_bandwidth)
    assert info["profile"] == "gloo-lab.json" and "lioncub calibrate --lab" in info["command"]
    assert info["generated"] and info["setting"]["ranks"] >= 2 and info["residuals"]
    # the file as it is on disk is a complete profile, whatever base it is laid over
    on_nccl, on_gloo = (BackendProfile.load(DEFAULT_LAB_PROFILE, base=b) for b in ("nccl", "gloo"))
    assert on_nccl == on_gloo


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_calibration_writes_a_profile(tmp_path):
    """`lioncub calibrate` without --lab under torchrun: every rank measures, rank 0 fits and writes (here on
    this machine's loopback, so the fitted numbers mean little; the path is what is tested)."""
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29611",
           "-m", "lioncub.cli", "calibrate", "--bandwidth", "10Gbit", "--quick", "--no-codec", "--json",
           "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["setting"]["where"] == "torchrun" and summary["setting"]["ranks"] == 2
    prof = BackendProfile.load(out)
    assert prof.to_dict() == summary["profile"]
    assert {m["op"] for m in summary["residuals"]} >= {"p2p", "allreduce", "allgather", "alltoall"}
