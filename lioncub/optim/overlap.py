"""Overlap: each bucket's exchange runs while backward is still computing the gradients of earlier layers.

Per-parameter hooks (`register_post_accumulate_grad_hook`) count the gradients of each bucket; when a
bucket's last gradient is final, the bucket is ready. One communication thread per optimizer takes ready
buckets strictly in bucket order (buckets are laid out in the order backward produces them), so every
rank issues the same collectives in the same order whatever order its own gradients arrive in. They go on a
process group of the optimizer's own (same ranks; lioncub.optim.engine): a model may send during backward
too (DDP, SyncBatchNorm, tensor-parallel layers), from the autograd thread, and on one group the two
streams would interleave in a different order on each rank. At the end
of backward (an autograd callback) the buckets that got no gradient this pass are flushed, the step's
control message (the non-finite count) is sent, and backward returns once everything has arrived: as
with DDP, a collective the script issues after backward cannot interleave with the optimizer's.

Nothing is committed before `step()`: compressed methods quantize without touching the momentum and
update it in unpack_apply, after every rank has agreed to take the step (so a non-finite gradient on any
rank still skips the step with momenta unchanged). If gradients are modified after backward (clipping,
unscaling, a replaced `.grad`), `step()` sees it (version counters, views) and runs the exchange again.

On CUDA the thread runs the codec kernels and collectives on a side stream that waits for an event
recorded when each bucket became ready; the default stream waits for the side stream at the end of
backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from lioncub.comm import settle
from lioncub.optim import replicas
from lioncub.optim.passes import ExchangePass
from lioncub.optim.worker import Worker

log = logging.getLogger("lioncub")
_FLUSH = "flush"
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Overlap with a thread, for shutdown()


def at_end_of_backward(fn) -> None:
    """Call `fn` once the running backward has finished (from a hook during it), as torch DDP does."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def shutdown(timeout: float = 5.0) -> None:
    """End every communication thread and wait for it (the process's settling calls this, at exit and in
    lioncub.finish()): a thread still inside a collective while Python finalises would abort the process."""
    for ov in list(_LIVE):
        ov.close(join_timeout=timeout)


settle.at_exit(shutdown)


@dataclass(eq=False)
class _Backward:
    """One backward pass as the hooks see it: which buckets are complete, which are queued, and the
    ExchangePass the communication thread fills."""

    result: ExchangePass
    pending: list  # per bucket: gradients still to come
    complete: list
    events: list  # per bucket: the CUDA event recorded when it became ready (CUDA only)
    cursor: int = 0  # buckets [0, cursor) are queued
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Overlap:
    """The hooks and the communication thread of one optimizer engine (lioncub.optim.engine.Engine)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.enabled = True
        self.sync_wanted = lambda: True  # under DDP: DDP's require_backward_grad_sync (its no_sync())
        buckets = engine.buckets
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook()) for b in buckets for p in b.params]
        self._cuda = buckets.is_cuda
        self._stream = torch.cuda.Stream(device=buckets.device) if self._cuda else None
        self._worker = Worker(functools.partial(_run, engine_ref=self._engine, stream=self._stream), "lioncub-comm")
        self._pass: _Backward | None = None
        self._looked_for_ddp = False

    # --- hooks (the autograd thread) --------------------------------------------------------------------

    def _make_hook(self):
        ref = weakref.ref(self)

        def hook(param):
            self = ref()
            if self is not None and self.enabled and self.sync_wanted():
                self._on_grad(param)
        return hook

    def _on_grad(self, param) -> None:
        engine = self._engine()
        if engine is None:
            return
        if self._pass is None:
            if not self._looked_for_ddp and self._ddp_alongside(engine):
                return
            self._begin_pass(engine)
        k, i = engine.buckets.where[id(param)]
        engine.buckets.capture(param, k, i)
        state = self._pass
        state.pending[k] -= 1
        if state.pending[k] == 0:
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record()
                state.events[k] = ev
            state.complete[k] = True
            while state.cursor < len(state.complete) and state.complete[state.cursor]:
                self._worker.put((state.cursor, state))
                state.cursor += 1

    def _ddp_alongside(self, engine) -> bool:
        """Once, at the first backward: whether a DDP model LionCub is not attached to wraps its parameters
        (lioncub.optim.replicas); if so the hooks stop for good and step() exchanges DDP's mean."""
        self._looked_for_ddp = True
        if engine.attached_to is not None or replicas.wrapping_ddp(p for b in engine.buckets for p in b.params) is None:
            return False
        self.enabled = False
        engine.ddp_alongside = True  # (lioncub.optim.replicas's warning would only say the same)
        if engine.rank == 0:
            log.warning(replicas.DDP_WARNING)
        return True

    def _begin_pass(self, engine) -> None:
        if not self._worker.started:
            _LIVE.add(self)
        engine.offer(None)
        n = len(engine.buckets)
        self._pass = _Backward(engine.begin_pass(), pending=[len(b.params) for b in engine.buckets],
                               complete=[False] * n, events=[None] * n)
        at_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Flush the buckets that got no gradient, then wait for the thread (the exposed communication)."""
        state, self._pass = self._pass, None
        if state is None:
            return
        t0 = time.perf_counter()
        for k in range(state.cursor, len(state.complete)):
            if self._cuda and state.events[k] is None:
                ev = torch.cuda.Event()
                ev.record()
                state.events[k] = ev
            self._worker.put((k, state))
        self._worker.put((_FLUSH, state))
        state.done.wait()
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._stream)
        state.result.exposed_s = time.perf_counter() - t0
        if state.error is not None:
            raise state.error
        engine = self._engine()
        if engine is not None:
            engine.offer(state.result)

    def close(self, join_timeout: float | None = None) -> None:
        """Remove the hooks and end the thread (also when the optimizer is garbage-collected); with
        join_timeout, wait that long for it to end."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._worker.close(join_timeout)

    def __del__(self):
        self.close()


def _run(job, engine_ref, stream) -> None:
    """The communication thread's job: a bucket's exchange, or the pass's control message. It holds no strong
    reference to the engine, so an optimizer that is dropped is collected."""
    k, state = job
    engine = engine_ref()
    if engine is not None and state.error is None:
        try:  # an error is re-raised by the autograd thread at the end of backward
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if k == _FLUSH:
                    engine.end_pass(state.result)
                else:
                    if state.events[k] is not None:
                        stream.wait_event(state.events[k])
                    engine.exchange_bucket(k, state.result, captured=engine.buckets.private and state.complete[k])
        except BaseException as exc:
            state.error = exc
    del engine
    if k == _FLUSH:
        state.done.set()
