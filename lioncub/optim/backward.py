"""What runs during backward: each bucket's exchange overlapping it (`Overlap`, on a communication thread,
`Worker`), or, where nothing exchanges during backward, the non-finite check of the gradients (`BackwardCheck`).

The overlap. Each bucket's exchange runs while backward is still computing the gradients of earlier layers.

Per-parameter hooks (`register_post_accumulate_grad_hook`) count the gradients of each bucket; when a
bucket's last gradient is final, the bucket is ready. One communication thread per optimizer takes ready
buckets strictly in bucket order (buckets are laid out in the order backward produces them), so every
rank issues the same collectives in the same order whatever order its own gradients arrive in. They go on a
process group of the optimizer's own (same ranks; lioncub.optim.engine): a model may send during backward
too (DDP, SyncBatchNorm, tensor-parallel layers), from the autograd thread, and on one group the two
streams would interleave in a different order on each rank. At the end of backward (an autograd callback)
the buckets that got no gradient this pass are flushed, the step's control message (the non-finite count) is
sent, and backward returns once everything has arrived: as with DDP, a collective the script issues after
backward cannot interleave with the optimizer's.

Nothing is committed before `step()`: compressed methods quantize without touching the momentum and
update it in unpack_apply, after every rank has agreed to take the step (so a non-finite gradient on any
rank still skips the step with momenta unchanged). If gradients are modified after backward (clipping,
unscaling, a replaced `.grad`), `step()` sees it (version counters, views) and runs the exchange again.

On CUDA the thread runs the codec kernels and collectives on a side stream that waits for an event
recorded when each bucket became ready; the default stream waits for the side stream at the end of
backward.

The communication thread (`Worker`) runs the jobs queued to it one at a time, in the order they were queued, so
every rank issues its collectives in the same order (the overlap's buckets; the streamed outer steps' fragments,
lioncub.optim.local). It starts on the first job and ends, after the jobs already queued, at close().

A DDP model that LionCub was not attached to (lioncub.attach_ddp) averages the gradients at the end of backward,
after LionCub's overlap has exchanged the local ones, which step() would then see changed and exchange again. So
the first backward looks for one (`wrapping_ddp`) and, if there is one, LionCub exchanges only in step(), on
DDP's mean, with a warning.

The non-finite check taken during backward (`BackwardCheck`): step() takes a step only if every gradient is
finite, and learning that reads every gradient once more: at world size 1 plain Lion moves 20 bytes per fp32
parameter, and the check adds 4. So where nothing else reads
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

import contextlib
import functools
import gc
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from lioncub import kernels
from lioncub.comm import clean_exit
from lioncub.optim.buckets import Run

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


clean_exit.at_exit(shutdown)


@dataclass(eq=False)
class _Backward:
    """One backward pass as the hooks see it: which buckets are complete, which are queued, and the
    ExchangePass the communication thread fills."""

    result: object  # the engine's ExchangePass that the communication thread fills
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
        (`wrapping_ddp`); if so the hooks stop for good and step() exchanges DDP's mean."""
        self._looked_for_ddp = True
        if engine.attached_to is not None or wrapping_ddp(p for b in engine.buckets for p in b.params) is None:
            return False
        self.enabled = False
        engine.ddp_alongside = True  # (the same-gradients warning would only say the same)
        if engine.rank == 0:
            log.warning(DDP_WARNING)
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


DDP_WARNING = ("LionCub: the model is wrapped in DistributedDataParallel, which LionCub was not attached to: DDP "
               "averages the gradients, then LionCub exchanges the mean in step() (both are paid). Call "
               "lioncub.attach_ddp(model, opt) after wrapping (LionCub then replaces DDP's all-reduce), or build "
               "LionCub on the unwrapped model")


def wrapping_ddp(params):
    """The torch DistributedDataParallel model that holds any of `params`, or None (a scan of the objects the
    garbage collector tracks, about 0.1 s per million; types only, so it reads no attribute of theirs)."""
    objects = gc.get_objects()
    ddp = [t for t in set(map(type, objects)) if issubclass(t, torch.nn.parallel.DistributedDataParallel)]
    if not ddp:
        return None
    mine = {id(p) for p in params}
    for obj in objects:
        if type(obj) in ddp and any(id(p) in mine for p in obj.module.parameters()):
            return obj
    return None


# --- the communication thread -------------------------------------------------------------------------------

_STOP = object()


class Worker:
    """`run(job)` for every job put, on a daemon thread named `name`. `run` should hold no strong reference to
    the thread's owner, so that an owner that is dropped is collected (and closes the worker)."""

    def __init__(self, run, name: str):
        self._run, self._name = run, name
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs, self._run), name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def close(self, join_timeout: float | None = None) -> None:
        """End the thread once the jobs queued are done; with join_timeout, wait that long for it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(_STOP)
            if join_timeout is not None and thread is not threading.current_thread():
                thread.join(join_timeout)


def _serve(jobs: queue.Queue, run) -> None:
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        run(job)
        del job


# --- the non-finite check taken during backward ----------------------------------------------------------

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
        self._l1 = None  # (codec, levels) when the hooks also compute the L1 scales (_l1_codec)
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
            checking = self._active(engine)
            pending = self._pending = [len(b.params) for b in self._buckets] if checking else _SKIP
            n, self._l1 = len(self._buckets), self._l1_codec(engine) if checking else None
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

    def taken(self, buckets, units, x) -> tuple | None:
        """The pre-pass of exchange x's codec, if backward took it for every bucket and it still holds: (the
        gradients' "all finite" flag, 0-dim bool; per unit (a bucket, or a run of them: lioncub.optim.buckets.Run)
        the L1 multipliers, or None for a codec without them); else None."""
        flags = self.flags(buckets)
        if not flags or any(f is None for f in flags):
            return None
        if not x.codec.l1:
            return torch.stack(flags).all(), [None] * len(units)
        per_bucket = self.multipliers(buckets, flags, x.codec, x.levels)
        if any(m is None for m in per_bucket):
            return None
        at = {id(b): k for k, b in enumerate(buckets)}
        return torch.stack(flags).all(), [unit.joined(per_bucket) if isinstance(unit, Run) else per_bucket[at[id(unit)]]
                                          for unit in units]

    @staticmethod
    def _active(engine) -> bool:
        """Whether the check during backward is of use: skipping is on, the buckets hold .grad itself (not copies:
        torch DDP, FSDP2), no overlap pass reads the gradients during backward anyway, no loss scaler rewrites
        them after backward (its unscale_ checks them itself), and the coming step() reads the flags: one rank,
        local steps in the flat layout, or a compressed step whose codec reads this rank's own gradients (not a
        dense step at several ranks, which checks their mean)."""
        overlap = engine.overlap
        if (overlap is not None and overlap.enabled) or not engine.skip_nonfinite or engine.buckets.private \
                or engine.ddp_alongside or engine.loss_scaled:
            return False
        if engine.world_size == 1 or engine.local_checks:
            return True
        return not engine.next_method().dense and engine.layout.codec_reads_local

    @staticmethod
    def _l1_codec(engine):
        """(codec, levels) where the coming step() is a compressed step whose pre-pass computes L1 scales of this
        rank's own gradients (l1-pbit in the flat layout); else None."""
        if engine.world_size == 1 or engine.local_checks:
            return None
        method = engine.next_method()
        if method.dense or not method.codec.l1 or not engine.layout.codec_reads_local:
            return None
        return method.codec, engine.levels if method is engine.spec else 0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self):
        self.close()
