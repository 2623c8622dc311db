"""What a rank's optimizer sent, how long each phase took, and the clock that times them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


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
        return asdict(self)


class Clock:
    """time.perf_counter(), after the device's queue has drained when `sync_cuda` (exact phase times)."""

    def __init__(self, sync_cuda: bool):
        self.sync_cuda = sync_cuda

    def __call__(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
