"""What a rank's optimizer sent, how long each phase took, the clock that times them, and a measured step beside
its forecast.

The comparison (`compare_components`, `opt.stats.versus`): step, compute, codec and exposed communication,
which component differs most, whether the step fell inside the forecast's interval, and, when a compressed step
is measured slower than the forecast dense step, what to do about it. `lioncub train` prints it
(lioncub.apps.train.forecast); `opt.stats.versus(forecast)` gives it for any loop that set `opt.timing = True`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from lioncub import methods

WINDOW = 64  # steps opt.stats.versus looks back on

COMPONENTS = ("step", "compute", "codec", "exposed communication")


class Comparison(dict):
    """compare_components' dict, printed as format_comparison's lines."""

    def __str__(self) -> str:
        return format_comparison(self)


def forecast_components(result) -> dict:
    """The same components of a StepResult (with a host: compute as it ran beside the codec and collectives)."""
    c = result.contention or {}
    return {"step": result.step_seconds, "compute": c.get("compute", result.compute_seconds),
            "codec": result.codec_seconds, "exposed communication": result.exposed_communication_seconds}


def forecast_of(result) -> dict:
    """What a run's ranks need of its forecast to compare as they go (JSON-able)."""
    return dict(components=forecast_components(result), interval=result.step_interval,
                dense_step=result.baseline_step_seconds)


def compare_components(meas: dict, forecast: dict, compressed: bool) -> dict:
    """Per component measured, forecast and their difference (seconds); the component that differs most; the
    step's place against the interval; a remedy where one is due."""
    fore, band, dense = forecast["components"], forecast["interval"], forecast["dense_step"]
    rows = [dict(component=k, measured=meas[k], forecast=fore[k], difference=meas[k] - fore[k])
            for k in COMPONENTS if k in meas]
    parts = [r for r in rows if r["component"] != "step"] or rows
    worst = max(parts, key=lambda r: abs(r["difference"]))["component"]
    out = Comparison(rows=rows, differs_most=worst, step_error=meas["step"] / fore["step"] - 1, interval=band,
               inside=None if band is None else band[0] <= meas["step"] <= band[1], remedy=None)
    if compressed and meas["step"] > dense:
        out["remedy"] = (f"the compressed step measured {1e3 * meas['step']:.1f} ms, slower than the forecast dense "
                         f"step ({1e3 * dense:.1f} ms): calibrate this machine (`lioncub demo` "
                         f"or `lioncub calibrate`), or choose another method (`lioncub autotune`)")
    return out


def format_comparison(c: dict, when: str = "per step") -> str:
    lines = [f"  forecast vs measured ({when}):"]
    for r in c["rows"]:
        lines.append(f"    {r['component']:<22} measured {1e3 * r['measured']:8.1f} ms   forecast "
                     f"{1e3 * r['forecast']:8.1f} ms   {1e3 * r['difference']:+8.1f} ms")
    where = ""
    if c["interval"]:
        lo, hi = c["interval"]
        where = f", {'inside' if c['inside'] else 'outside'} the forecast's {1e3 * lo:.1f}-{1e3 * hi:.1f} ms"
    lines.append(f"    step {c['step_error']:+.0%} against the forecast{where}; {c['differs_most']} differs most")
    if c["remedy"]:
        lines.append(f"    {c['remedy']}")
    return "\n".join(lines)


@dataclass
class CommStats:
    """Per-rank communication and timing figures. `last_*` describe the most recent step."""

    steps: int = 0
    skipped_steps: int = 0
    overlapped_steps: int = 0  # steps whose exchange ran during backward
    momentum_syncs: int = 0
    last_bytes_sent: int = 0
    last_bytes_recv: int = 0
    # of last_bytes_sent, what went to the rank's own node (the hierarchical layout's node collectives:
    # NVLink/PCIe, not the NIC); 0 in the flat layout
    last_node_bytes_sent: int = 0
    last_collectives: int = 0
    last_quantize_s: float = 0.0
    last_comm_s: float = 0.0
    last_apply_s: float = 0.0
    last_sync_s: float = 0.0
    last_exposed_comm_s: float = 0.0
    last_backward_wait_s: float = 0.0  # the part of last_exposed_comm_s that backward waited for
    # how much the ranks agreed on the last compressed step, in [0, 1], read off the agreed code (identical
    # on every rank; lioncub.optim.schedules.agreement); None for the dense method, one rank or an odd N's 1-bit votes
    last_agreement: float | None = None
    total_bytes_sent: int = 0
    total_bytes_recv: int = 0
    total_node_bytes_sent: int = 0
    total_collectives: int = 0
    total_quantize_s: float = 0.0
    total_comm_s: float = 0.0
    total_apply_s: float = 0.0
    total_sync_s: float = 0.0
    total_exposed_comm_s: float = 0.0
    # LionCub(timing=True): (seconds since the previous step() began, codec, exposed communication) of the
    # latest WINDOW steps, the first step excepted: what `versus` compares with a forecast
    recent: list = field(default_factory=list, repr=False)
    _began: float | None = field(default=None, repr=False)

    def tick(self, began: float) -> None:
        """A timed step that began at `began` (perf_counter) has been recorded."""
        if self._began is not None:
            self.recent.append((began - self._began, self.last_quantize_s, self.last_exposed_comm_s))
            del self.recent[:-WINDOW]
        self._began = began

    def versus(self, forecast) -> Comparison:
        """This rank's recent steps beside `forecast` (the lioncub.simulator StepResult of the run): the mean
        time from one step() to the next, the median codec and exposed communication, the component that differs
        most, whether the step is inside the forecast's interval, and a remedy when a compressed step is slower
        than the forecast dense one (compare_components). print() it for the lines."""
        if not self.recent:
            raise ValueError("opt.stats.versus needs opt.timing = True and two steps or more")
        timed = self.recent[2:] if len(self.recent) > 4 else self.recent
        meas = {"step": statistics.fmean(r[0] for r in timed), "codec": statistics.median(r[1] for r in timed),
                "exposed communication": statistics.median(r[2] for r in timed)}
        return compare_components(meas, forecast_of(forecast), not methods.get(forecast.method).dense)

    def record(self, sent, recv, collectives, quantize, comm, apply, sync, exposed=None, node_sent=0):
        """`exposed`: the communication time the training loop waited for (default: all of comm and sync;
        with overlap, what backward and step() waited beyond the compute)."""
        exposed = comm + sync if exposed is None else exposed
        self.last_bytes_sent, self.last_bytes_recv, self.last_collectives = sent, recv, collectives
        self.last_node_bytes_sent = node_sent
        self.total_node_bytes_sent += node_sent
        self.last_quantize_s, self.last_comm_s, self.last_apply_s, self.last_sync_s = quantize, comm, apply, sync
        self.last_exposed_comm_s = exposed
        self.total_exposed_comm_s += exposed
        self.total_bytes_sent += sent
        self.total_bytes_recv += recv
        self.total_collectives += collectives
        self.total_quantize_s += quantize
        self.total_comm_s += comm
        self.total_apply_s += apply
        self.total_sync_s += sync

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("recent", "_began")}


class Clock:
    """time.perf_counter(), after the device's queue has drained when `sync_cuda` (exact phase times)."""

    def __init__(self, sync_cuda: bool):
        self.sync_cuda = sync_cuda

    def __call__(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
