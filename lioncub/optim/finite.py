"""The non-finite check of the gradients (and l1-pbit's L1 scales), taken during backward.

step() takes a step only if every gradient is finite, and learning that reads every gradient once more: at
world size 1 plain Lion moves 20 bytes per fp32 parameter, and the check adds 4. So where nothing else reads
the gradients during backward (world size 1, or a compressed step that communicates inside step(): no
overlap), hooks check each bucket as soon as its last gradient is final, while backward goes on (on CUDA on a
side stream that waits for that moment), and step() takes those flags instead of reading the gradients again.
Where the coming step is l1-pbit's, the hooks run its whole pre-pass instead (the check and the L1 scales of
c = b1 m + (1 - b1) g, which read g and m: 8 of its 30 bytes per fp32 parameter), and step() takes the scales
too while the momenta and beta1 are as they were.

step() takes a flag only while it describes the gradients step() is about to use: taken in the last
backward, every gradient of the buckets still its view, and the buffers' version counters as they were when
that backward ended (torch's clip_grad_norm_, an edited or replaced .grad change them; LionCub's own clipping
keeps the flags, and a loss scaler's unscale_ replaces them, below). A bucket whose gradients
were not all written into their views (model.zero_grad() sets .grad to None, so backward allocates new ones),
or that got no gradient for some parameter, gets no flag, and step() reads it as before.

Under a loss scaler (lioncub.GradScaler) the hooks stand aside: its unscale_ reads every gradient anyway, and its
verdict becomes the flags (`vouch`; torch's unscale_ does not bump the version counters, so it must say so).
"""

from __future__ import annotations

import weakref

import torch

from lioncub import kernels
from lioncub.optim.overlap import at_end_of_backward
from lioncub.optim.runs import Run

_SKIP: list = []  # a backward whose gradients the hooks leave alone


class BackwardCheck:
    """The hooks of one optimizer engine (lioncub.optim.engine.Engine); `flags` is what step() reads."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self._buckets = buckets = engine.buckets
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(k, i))
                       for k, b in enumerate(buckets) for i, p in enumerate(b.params)]
        self._stream = torch.cuda.Stream(device=buckets.device) if buckets.is_cuda else None
        # per bucket in a running backward: gradients still to come; 0 once checked, -1 once spoiled (written
        # outside its view, or after it was checked); None between backwards, _SKIP in one not to check
        self._pending: list | None = None
        self._flags: list = []  # per bucket: the 0-dim "all finite" flag, or None
        self._versions: list | None = None  # the gradient buffers' versions when the last backward ended
        self._l1 = None  # (codec, levels) when the hooks also compute the L1 scales (l1_codec)
        self._mults: list = []  # per bucket: its L1 multipliers (taken with its flag), or None
        self._betas: list = []  # per bucket: the beta1 they were computed with
        self._momenta: list | None = None  # the momentum buffers' versions when the last backward ended

    def _make_hook(self, k: int, i: int):
        ref = weakref.ref(self)

        def hook(param):
            self = ref()
            if self is not None:
                self._on_grad(param, k, i)
        return hook

    def _on_grad(self, param, k: int, i: int) -> None:
        pending = self._pending
        if pending is None:  # the first gradient of a backward
            engine = self._engine()
            if engine is None:
                return
            checking = active(engine)
            pending = self._pending = [len(b.params) for b in self._buckets] if checking else _SKIP
            n, self._l1 = len(self._buckets), l1_codec(engine) if checking else None
            self._flags, self._mults, self._betas, self._versions = [None] * n, [None] * n, [None] * n, None
            at_end_of_backward(self._end_of_backward)
        if pending is _SKIP:
            return
        left, b, grad = pending[k], self._buckets[k], param.grad
        if left <= 0 or grad is None or grad.data_ptr() != b.grad_ptrs[i]:  # after the check, or outside its view
            pending[k], self._flags[k], self._mults[k] = -1, None, None
            return
        pending[k] = left - 1
        if left == 1:
            self._flags[k], self._mults[k] = self._on_side(self._take, k, b)

    def _take(self, k: int, b) -> tuple:
        """(bucket b's "all finite" flag, its L1 multipliers or None)."""
        if self._l1 is None:
            return kernels.finite_flag(b.g), None
        codec, levels = self._l1
        beta1 = self._betas[k] = self._buckets.hyper(b).beta1
        return kernels.prepass(codec, b.g, b.m, beta1=beta1, offsets=b.offsets, levels=levels)

    def _on_side(self, fn, *args):
        if self._stream is None:
            return fn(*args)
        ready = torch.cuda.Event()
        ready.record()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            return fn(*args)

    def _end_of_backward(self) -> None:
        skipped, self._pending = self._pending is _SKIP, None
        engine = self._engine()
        if engine is None or skipped:
            return
        if self._stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._stream)
            for t in self._flags + self._mults:
                if t is not None:
                    t.record_stream(current)
        self._versions, self._momenta = engine.buckets.versions(), engine.buckets.momentum_versions()

    def flags(self, buckets) -> list:
        """Per bucket: the flag the last backward took, where it still describes the gradients; else None."""
        current = (self._pending is None and self._versions is not None and len(self._flags) == len(buckets)
                   and not buckets.private and buckets.as_exchanged(self._versions))
        return list(self._flags) if current else [None] * len(buckets)

    def multipliers(self, buckets, held: list, codec, levels: int) -> list:
        """Per bucket: the L1 multipliers of `codec` with `levels` the last backward took with its flag, where
        they still hold (its flag in `held`, from flags(), does; the momenta and beta1 are as they were); else
        None."""
        if self._l1 != (codec, levels) or self._momenta != buckets.momentum_versions():
            return [None] * len(buckets)
        return [mult if f is not None and beta == buckets.hyper(b).beta1 else None
                for f, mult, beta, b in zip(held, self._mults, self._betas, buckets)]

    def scale(self, buckets, factor: float) -> None:
        """Multiply every gradient by `factor` in (0, 1] (clipping), keeping the flags if they held: such a
        factor leaves every element as finite, or not, as it was."""
        held = self.flags(buckets)
        buckets.scale_(factor)
        self._mults = [None] * len(self._mults)  # (the scales of c change with g)
        if any(f is not None for f in held):
            self._versions = buckets.versions()

    def vouch(self, buckets, finite: bool) -> None:
        """Another pass rewrote every gradient in place (a loss scaler's unscale_, which torch's version counters
        do not see) after reading them: if it found them all `finite`, flags that say so, holding while the
        gradients stay as they are now; else no flags."""
        if self._pending is None:
            self._mults = [None] * len(buckets)
        if self._pending is None and finite:
            true = torch.ones((), dtype=torch.bool, device=buckets.device)
            self._flags, self._versions = [true] * len(buckets), buckets.versions()
        elif self._pending is None:
            self._flags, self._versions = [], None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self):
        self.close()


def active(engine) -> bool:
    """Whether the check during backward is of use: skipping is on, the buckets hold .grad itself (not copies:
    torch DDP, FSDP2), no overlap pass reads the gradients during backward anyway, no loss scaler rewrites
    them after backward (its unscale_ checks them itself), and the coming step() reads the flags."""
    overlap = engine.overlap
    return ((overlap is None or not overlap.enabled) and engine.skip_nonfinite and not engine.buckets.private
            and not engine.ddp_alongside and not engine.loss_scaled and read_by_step(engine))


def read_by_step(engine) -> bool:
    """Whether the coming step() checks this rank's own gradients (and so can take the flags): one rank, local
    steps in the flat layout, or a compressed step whose codec reads them (not a dense step at several
    ranks, which checks their mean)."""
    if engine.world_size == 1 or engine.local_checks:
        return True
    return not engine.next_method().dense and engine.layout.codec_reads_local


def l1_codec(engine):
    """(codec, levels) where the coming step() is a compressed step whose pre-pass computes L1 scales of this
    rank's own gradients (l1-pbit in the flat layout); else None."""
    if engine.world_size == 1 or engine.local_checks:
        return None
    method = engine.next_method()
    if method.dense or not method.codec.l1 or not engine.layout.codec_reads_local:
        return None
    return method.codec, engine.levels if method is engine.spec else 0


def finite_flags(engine) -> list:
    """Per bucket, whether all its gradients are finite (0-dim bool tensors, no host sync): the flag backward
    took where it still holds, else a read of the bucket now."""
    buckets = engine.buckets
    early = engine.backward_check.flags(buckets) if engine.backward_check else [None] * len(buckets)
    return [kernels.finite_flag(b.g) if f is None else f for f, b in zip(early, buckets)]


def all_finite(engine) -> bool:
    """Whether every gradient of this rank is finite (one host sync), from finite_flags."""
    return not bool(kernels.nonfinite_flag(finite_flags(engine))) if len(engine.buckets) else True


def taken_in_backward(engine, units, x) -> tuple | None:
    """The pre-pass of exchange x's codec, if backward took it for every bucket and it still holds: (the
    gradients' "all finite" flag, 0-dim bool; per unit (a bucket, or a run of them: lioncub.optim.runs) the L1
    multipliers, or None for a codec without them); else None."""
    check, buckets = engine.backward_check, engine.buckets
    if check is None:
        return None
    flags = check.flags(buckets)
    if not flags or any(f is None for f in flags):
        return None
    if not x.codec.l1:
        return torch.stack(flags).all(), [None] * len(units)
    per_bucket = check.multipliers(buckets, flags, x.codec, x.levels)
    if any(m is None for m in per_bucket):
        return None
    at = {id(b): k for k, b in enumerate(buckets)}
    return torch.stack(flags).all(), [unit.joined(per_bucket) if isinstance(unit, Run) else per_bucket[at[id(unit)]]
                                      for unit in units]
