"""What a rank's optimizer sent, how long each phase took, and the clock that times them."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from lioncub import methods
from lioncub.optim.versus import Comparison, compare_components, forecast_of

WINDOW = 64  # steps opt.stats.versus looks back on


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
    # on every rank; lioncub.optim.agreement); None for the dense method, one rank or an odd N's 1-bit votes
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
        than the forecast dense one (lioncub.optim.versus). print() it for the lines."""
        if not self.recent:
            raise ValueError("opt.stats.versus needs LionCub(..., timing=True) and two steps or more")
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
