"""Steps skipped on the device. Alone on a GPU (world size 1), step() decides whether the gradients are finite on
the device (kernels.nonfinite_flag, read by the update kernel) instead of reading the answer back: a read-back
waits for everything queued before it, which leaves every later kernel launch exposed. The flag comes back
behind an event, and the step is counted as skipped once it has arrived."""

from __future__ import annotations

import torch


class DeviceSkips:
    """The flags of steps whose skip was decided on the device, until they are known on the host."""

    def __init__(self):
        self.pending: list[tuple[int, torch.Tensor, object]] = []

    def add(self, step: int, flag: torch.Tensor) -> None:
        if flag.is_cuda:
            host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            self.pending.append((step, host, arrived))
        else:
            self.pending.append((step, flag, None))

    def settle(self, wait: bool = False) -> list[int]:
        """The skipped steps among those whose flags have arrived (all of them with `wait`), in order."""
        skipped, left = [], []
        for step, flag, arrived in self.pending:
            if arrived is not None and not wait and not arrived.query():
                left.append((step, flag, arrived))
                continue
            if arrived is not None:
                arrived.synchronize()
            if int(flag):
                skipped.append(step)
        self.pending = left
        return skipped
