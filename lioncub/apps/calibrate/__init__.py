"""`lioncub calibrate`: measure probes on the lab or a real cluster and fit the simulator's backend profile.

    sudo lioncub calibrate --lab --ranks 4 --bandwidth 500Mbit --output gloo-lab.json [--json]
    torchrun --nproc-per-node 8 --nnodes 4 ... -m lioncub.cli calibrate --bandwidth 25Gbit --output c.json
    lioncub simulate collective --op vote-1bit --backend gloo --calibration gloo-lab.json ...

Every rank times point-to-point ping-pongs and collectives from KiB to tens of MiB (ranks.py), and the
local work of LionCub's codecs; rank 0 (or the lab's launcher) fits the profile's physical parameters
(fit.py) and writes them as a JSON profile that `--calibration FILE` lays over a built-in backend. With
`--json` it prints a summary: the fitted values, what they mean, and every probe's residual.

From Python:

    from lioncub.apps.calibrate import calibrate_lab, fit, predict, default_lab_profile
    raw = calibrate_lab(ranks=4, bandwidth="500Mbit")           # measurements (needs root)
    profile, report = fit(raw["measurements"], raw["host_kernels"])
    default_lab_profile()   # the bundled calibration of the lab's Gloo (lioncub/apps/calibrate/data/gloo-lab.json)

The research tools' `python -m research lab validate` (research/calibration_validation.py, outside the package)
calibrates from one lab setting and tabulates predicted against measured times in settings the fit did not see
(research/notebook/VALIDATION.md). The command's argument handling and output are in cli.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lioncub.comm.wire import bus_factor
from lioncub.simulator import BackendProfile

from .fit import MEANINGS, SIM_OP, CalibrationError, fit, host_kernel_figures, predict, report

MiB = 2**20
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_LAB_PROFILE = DATA_DIR / "gloo-lab.json"
DEFAULT_LAB_PROFILE_INFO = DATA_DIR / "gloo-lab.meta.json"

__all__ = [
    "CalibrationError",
    "MEANINGS",
    "calibrate_lab",
    "default_lab_profile",
    "default_lab_profile_info",
    "fit",
    "host_kernel_figures",
    "plan",
    "predict",
    "report",
    "run_torchrun",
]


# ---- the bundled lab calibration ----------------------------------------------------------------------
def default_lab_profile() -> BackendProfile:
    """The lab's Gloo backend as calibrated when this package was built (lioncub/apps/calibrate/data/gloo-lab.json), for
    when a fresh calibration is not possible (not root). `default_lab_profile_info()` says how and when
    it was made."""
    return BackendProfile.load(DEFAULT_LAB_PROFILE, base="gloo")


def default_lab_profile_info() -> dict:
    """Provenance of the bundled lab calibration: command, setting, date, machine, fit residuals."""
    return json.loads(DEFAULT_LAB_PROFILE_INFO.read_text())


# ---- what to measure ----------------------------------------------------------------------------------
def _wire_seconds(op: str, size: int, ranks: int, rate_bps: float) -> float:
    """Rough line time of one call (for budgets): a ping-pong sends SIZE both ways; Gloo's reduce-scatter
    costs about a full all-reduce, and all-to-all is counted at half speed."""
    if op == "p2p":
        f = 2.0
    else:
        f = bus_factor(SIM_OP[op], ranks) * (2 if op in ("reduce_scatter", "alltoall") else 1)
    return f * size / (rate_bps / 8 * 0.95)


def plan(ranks: int, bandwidth_bps: float, quick: bool = False, max_call_seconds: float = 0.9) -> list[dict]:
    """The probes of one calibration: sizes from 4 KiB to tens of MiB, dropping those whose single call
    would take more than max_call_seconds of line time at this rate."""
    if ranks < 2:
        raise ValueError(f"a calibration needs at least 2 ranks, got {ranks}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bps!r}")
    if quick:
        sizes = {"p2p": [4096, MiB, 4 * MiB], "allreduce": [4096, 256 * 1024, 2 * MiB, 8 * MiB],
                 "allgather": [4096, 2 * MiB, 8 * MiB], "alltoall": [4096, 2 * MiB, 8 * MiB], "reduce_scatter": []}
    else:
        coll = [4096, 256 * 1024, 2 * MiB, 8 * MiB, 32 * MiB]
        sizes = {"p2p": [4096, 4 * MiB, 16 * MiB], "allreduce": coll, "allgather": coll,
                 "alltoall": coll, "reduce_scatter": [8 * MiB]}
    probes = []
    for op, ss in sizes.items():
        for s in ss:
            if s > 4 * MiB and _wire_seconds(op, s, ranks, bandwidth_bps) > max_call_seconds:
                continue
            small = s <= 16 * 1024
            probes.append({"op": op, "size": s, "repeat": (8 if quick else 15) if small else (3 if quick else 5),
                           "warmup": 2 if small else 1})
    return probes


def estimate_seconds(probes: list[dict], ranks: int, bandwidth_bps: float, rounds: int) -> float:
    return rounds * sum((p["repeat"] + p["warmup"]) * (0.004 + _wire_seconds(p["op"], p["size"], ranks, bandwidth_bps))
                        for p in probes)


def make_job(ranks: int, bandwidth_bps: float, quick: bool = False, rounds: int | None = None,
             host_kernels: bool = True, elements: int | None = None, device: str = "cpu",
             progress: bool = True) -> dict:
    probes = plan(ranks, bandwidth_bps, quick)
    rounds = rounds if rounds is not None else (1 if quick else 2)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    job = {"probes": probes, "rounds": rounds, "device": device, "progress": progress,
           "pg_timeout": 120 + 10 * estimate_seconds(probes, ranks, bandwidth_bps, rounds)}
    if host_kernels:
        job["host_kernels"] = {"elements": elements or (1 << 19 if quick else 1 << 22),
                               "vote_bytes": (2 << 20) if quick else (8 << 20)}
    return job


def _annotate(raw: dict, bandwidth_bps: float, ranks_per_host: int, extra: dict) -> dict:
    for m in raw["measurements"]:
        m.update(bandwidth_bps=bandwidth_bps, ranks_per_host=ranks_per_host,
                 hosts=-(-m["ranks"] // ranks_per_host), **extra)
    return raw


# ---- on the lab -------------------------------------------------------------------------------------
def calibrate_lab(ranks: int = 4, bandwidth="500Mbit", ranks_per_host: int = 1, burst=None, quick: bool = False,
                  rounds: int | None = None, host_kernels: bool = True, progress: bool = True, lab=None) -> dict:
    """Run the calibration probes on the lab (a new one, or `lab`, reshaped to `bandwidth`): returns
    {"measurements": [...], "host_kernels": {...} or None, "setting": {...}}. Needs root."""
    from lioncub.apps.lab import Lab
    from lioncub.simulator.units import parse_rate

    rate = parse_rate(bandwidth)
    job = make_job(ranks, rate, quick, rounds, host_kernels, progress=progress)
    argv = [sys.executable, "-m", "lioncub.apps.calibrate", json.dumps(job)]

    def run(lab):
        lab.set_bandwidth(rate)
        res = lab.run(argv, ranks=ranks, timeout=job["pg_timeout"] + 60, stream_rank0=progress,
                      env={"TORCH_CPP_LOG_LEVEL": "ERROR"})  # not c10d's warnings about namespace hostnames
        out = res[0].result
        if not out:
            raise CalibrationError("rank 0 reported no measurements")
        return _annotate(out, lab.network.rate_bps, lab.ranks_per_host,
                         {"tbf_burst_bytes": lab.network.burst, "backend": "gloo", "source": "lab"})

    if lab is not None:
        raw, congestion = run(lab), lab.describe()["congestion_control"]
    else:
        with Lab(ranks=ranks, ranks_per_host=ranks_per_host, bandwidth=rate, burst=burst) as new:
            raw, congestion = run(new), new.describe()["congestion_control"]
    raw["setting"] = {"where": "lab", "ranks": ranks, "ranks_per_host": ranks_per_host, "bandwidth_bps": rate,
                      "rounds": job["rounds"], "quick": quick, "congestion_control": congestion}
    return raw


# ---- under torchrun ---------------------------------------------------------------------------------
def _in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_torchrun(bandwidth, quick: bool = False, rounds: int | None = None, host_kernels: bool = True,
                 dist_backend: str | None = None, progress: bool = True) -> dict | None:
    """Measure on the cluster this process was started on by torchrun (initialising torch.distributed
    from its environment unless it already is). Every rank must call it; returns the raw measurements
    on rank 0 and None elsewhere."""
    import torch
    import torch.distributed as dist

    from lioncub.comm.distributed import finish
    from lioncub.simulator.units import parse_rate

    from .ranks import run

    rate = parse_rate(bandwidth)
    own = not dist.is_initialized()
    if own:
        if not _in_torchrun():
            raise CalibrationError("not under torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not "
                                   "set (start with torchrun, or calibrate the lab with --lab)")
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    try:
        backend = dist.get_backend()
        device = "cpu"
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        world = dist.get_world_size()
        job = make_job(world, rate, quick, rounds, host_kernels, device=device, progress=progress)
        out = run(job)
        rph = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if world % rph:
            rph = 1
        _annotate(out, rate, rph, {"backend": backend, "source": "torchrun"})
        out["setting"] = {"where": "torchrun", "ranks": world, "ranks_per_host": rph, "bandwidth_bps": rate,
                          "rounds": job["rounds"], "quick": quick, "backend": backend}
        rank = dist.get_rank()
    except BaseException:
        if own:
            dist.destroy_process_group()
        raise
    if own:
        finish()
    return out if rank == 0 else None
