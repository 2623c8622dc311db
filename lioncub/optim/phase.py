"""Which method runs at each step. A dense start is just the baseline method for a while, as PowerSGD's
warm-up is the default all-reduce hook: LionCub(dense_warmup=K) and the adaptive guard's start
(schedules.Adaptive) run the dense method first, then the chosen one."""

from __future__ import annotations

from lioncub import methods


class Phase:
    def __init__(self, method, dense_warmup: int = 0, guard_start: int = 0):
        self.method, self.dense_warmup, self.guard_start = method, dense_warmup, guard_start
        self.dense_method = methods.get(methods.BASELINE)

    def method_at(self, step: int):
        """The method of step `step` (1-based)."""
        return self.dense_method if step <= max(self.dense_warmup, self.guard_start) else self.method

    @property
    def first_compressed_step(self) -> int | None:
        return None if self.method.dense else max(self.dense_warmup, self.guard_start) + 1

    def charges_guard(self, step: int) -> bool:
        """Whether a dense step's bytes count against the adaptive guard's budget (its own start, not the
        warm-up the user asked for)."""
        return self.dense_warmup < step <= self.guard_start
