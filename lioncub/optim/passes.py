"""One exchange pass: the gradients of one step, encoded and exchanged by every rank before step() applies
them, during backward (lioncub.optim.overlap) or right before step() (`average`, for a dense step whose mean
clipping or the loss scaler must read first).

`ExchangePass` holds what a pass produced and says whether step() may still apply it (`current`). `exchange`
runs one bucket of a pass through the method's encode pipeline; `agree` ends a pass with the step's control
message (the ranks' non-finite count and sum of squared gradients, in one message).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lioncub.comm import wire
from lioncub.comm.transport import agree_control


@dataclass
class LossScale:
    """The loss scale a pass divided out of the gradients before the codec read them (lioncub.GradScaler):
    its generation (bumped whenever the scale may change) and 1/scale as torch's unscale_ computes it."""

    generation: int
    inv_scale: torch.Tensor


@dataclass(eq=False)
class ExchangePass:
    step: int  # the optimizer step (1-based) these gradients are for
    method: object  # the lioncub.methods.Method that exchanged them (dense: they are averaged in place)
    overlapped: bool  # exchanged during backward (True), or by `average` before step()
    codes: list = field(default_factory=list)  # per bucket: the agreed code (compressed methods)
    finite: list = field(default_factory=list)  # per bucket: the pre-pass's 0-dim "all finite" flags
    collectives: list = field(default_factory=list)
    quantize_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0  # what the loop waited for: backward's end, or the whole average
    nonfinite_ranks: int = 0  # ranks that saw a non-finite gradient (from the control message)
    bad: int = 0  # nonfinite_ranks if the step is to be skipped for them, else 0
    scale: LossScale | None = None
    scale_confirmed: bool = False  # the scaler then unscaled .grad by exactly this scale
    sumsq: torch.Tensor | None = None  # this rank's running sum of squared gradients (clipping wants it)
    sumsq_total: float | None = None  # the sum over ranks, from the control message
    versions: list | None = None  # the gradient buffers' versions when the pass ended
    stale: bool = False  # the gradients were rescaled after the pass (clipping, the scaler)
    untouched: frozenset = frozenset()  # (bucket, index) of the parameters no rank gave a gradient

    def current(self, step: int, buckets, allow_unconfirmed_scale: bool = False) -> bool:
        """Whether step `step` may apply this pass as it stands: its step, not rescaled since, a loss scale
        that the scaler confirmed, and (where the pass read them: a vote, or an average taken before step())
        the gradients unchanged. Averaged gradients of an overlapped dense pass may be clipped or read after
        backward, as with DDP."""
        if self.step != step or self.stale:
            return False
        if self.scale is not None and not (self.scale_confirmed or allow_unconfirmed_scale):
            return False
        if self.method.dense and self.overlapped:
            return True
        return buckets.as_exchanged(self.versions)


def sum_squares(g: torch.Tensor) -> torch.Tensor:
    """A bucket's sum of squares as a 0-dim float64 tensor (its fp32 norm, squared in fp64)."""
    return torch.linalg.vector_norm(g, dtype=torch.float32).double().square()


def total_sum_squares(buckets) -> torch.Tensor:
    """The sum over buckets, in bucket order: the same arithmetic as a pass's running sum."""
    total = torch.zeros((), dtype=torch.float64, device=buckets.device)
    for b in buckets:
        total = total + sum_squares(b.g).to(total.device)
    return total


def nonfinite_flag(flags: list):
    """1 if any of the pre-pass's finite flags (0-dim bool tensors) is false, else 0, as a 0-dim tensor:
    nothing waits for the device until the control message is read; summed over ranks it counts ranks."""
    return torch.stack(flags).logical_not().any().long() if flags else 0


@torch.no_grad()
def exchange(engine, k: int, p: ExchangePass, captured: bool = False) -> None:
    """Bucket k of pass p (buckets come in order): collect its gradients (unless `captured` already copied
    them), then for a dense method average them in place; for a compressed one encode them (divided by the
    loss scale; the momentum update deferred until the ranks agree to take the step) and exchange."""
    buckets, layout = engine.buckets, engine.layout
    b = buckets[k]
    t0 = time.perf_counter()
    if not captured:
        buckets.collect(k)
    x = engine.exchange_of(k, p.method)
    if not p.method.dense:
        inv = None if p.scale is None else p.scale.inv_scale.to(b.g.device)
        local = b.g
        if inv is not None and (layout.codec_reads_local or p.sumsq is not None):
            local = torch.mul(b.g, inv, out=engine.scratch(b))
        if p.sumsq is not None:
            p.sumsq = p.sumsq + sum_squares(local)
        g, offsets, comm_s = layout.codec_input(b, x, local, inv)
        p.comm_s, t0 = p.comm_s + comm_s, t0 + comm_s
        h = buckets.hyper(b)
        p.finite.append(x.encode(g, b.m, beta1=h.beta1, beta2=h.beta2, offsets=offsets,
                                 zero_parity=engine.zero_parity(p.step), update_momentum=False))
    t1 = time.perf_counter()
    p.codes.append(x())
    p.quantize_s += t1 - t0
    p.comm_s += time.perf_counter() - t1
    p.collectives += x.collectives


def agree(engine, p: ExchangePass) -> None:
    """The end of a pass: agree on the non-finite count (compressed methods: a dense one checks the mean),
    the sum of squared gradients and which parameters no rank gave a gradient, in one message, and note the
    gradients' versions, so step() can tell whether they changed since."""
    t0 = time.perf_counter()
    flag = 0 if p.method.dense else nonfinite_flag(p.finite)
    count, total, unused = agree_control(flag, p.sumsq, engine.layout.group, engine.buckets.device,
                                         len(engine.buckets.unused))
    p.collectives.append(wire.CONTROL)
    p.untouched = engine.untouched(unused, p.collectives)
    if not p.method.dense:
        p.nonfinite_ranks = count
        p.bad = count if engine.skip_nonfinite else 0
        p.sumsq_total = None if p.sumsq is None else total
    p.comm_s += time.perf_counter() - t0
    p.versions = engine.buckets.versions()
