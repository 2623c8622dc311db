"""The engine behind LionCub: the state of one optimizer's exchanges and one step end to end. The optimizer's
step(), the overlap hooks, torch DDP, the loss scaler and clipping all drive it through its public methods.

    buckets   BucketSet: parameters, gradients and momenta in flat buffers (lioncub.optim.buckets)
    layout    FlatLayout / NodeLayout: the process group and how ranks vote (lioncub.optim.layout)
    phase     Phase: which method runs at each step (below)
    schedule  when momenta are averaged (lioncub.optim.schedules)
    pending   the ExchangePass of the coming step, if one ran before step() (below)
    overlap   the backward hooks and communication thread (lioncub.optim.backward.Overlap), or None
    backward_check   the non-finite check taken during backward where no overlap pass reads the gradients
              (lioncub.optim.backward.BackwardCheck), or None

What step() does, by kind of step (`Engine.step`):

    local        one rank: plain Lion on its gradients
    dense        the dense method: average the gradients (unless a pass did), then Lion on the mean
    compressed   communicate inside step(): agree on the non-finite flag first, then per bucket encode
                 (the momentum update fused in), exchange and apply
    apply_pass   apply what a pass agreed during backward, with the deferred momentum update
Every kind ends in `record` (statistics); the compressed ones first in `_finish` (agreement, momentum sync).
A non-finite gradient on any rank makes every rank skip the step (`_skip`), momenta unchanged.

Exchange passes (`ExchangePass`): the gradients of one step, encoded and exchanged by every rank before step()
applies them, during backward (lioncub.optim.backward) or right before step() (`average_now`, for a dense step
whose mean clipping or the loss scaler must read first). A pass says whether step() may still apply it
(`current`). `exchange_bucket` runs one bucket of a pass through the method's encode pipeline; `end_pass` ends a
pass with the step's control message (the ranks' non-finite count and sum of squared gradients, in one message).

The phase (`Phase`): which method runs at each step. A dense start is just the baseline method for a while, as
PowerSGD's warm-up is the default all-reduce hook: LionCub(dense_warmup=K) and the adaptive guard's start
(schedules.Adaptive) run the dense method first, then the chosen one.

Steps skipped on the device (`DeviceSkips`): alone on a GPU (world size 1), step() decides whether the gradients
are finite on the device (kernels.nonfinite_flag, read by the update kernel) instead of reading the answer back:
a read-back waits for everything queued before it, which leaves every later kernel launch exposed. The flag
comes back behind an event, and the step is counted as skipped once it has arrived.

The ranks' replicas (`check_replicas`): whether every rank brought the same gradients to a step. They should
differ: each rank reads its own data. The same gradients everywhere mean a model wrapped in
DistributedDataParallel, whose all-reduce already averaged them (LionCub then exchanges the mean again, and the
step costs DDP's fp32 all-reduce and LionCub's exchange), or every rank reading the same data (N ranks doing one
rank's work). Neither corrupts anything, and nothing else shows it, so the run's first compressed step (after any
dense start; a run resumed before it checks there too) sends one 32-byte MAX all-reduce and warns once; the
result is identical on every rank and changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from lioncub import kernels, methods
from lioncub.comm import wire
from lioncub.comm.transport import agree_control, any_rank, own_group, used_anywhere
from lioncub.optim import schedules
from lioncub.optim.backward import BackwardCheck, Overlap
from lioncub.optim.buckets import BucketSet, Run
from lioncub.optim.buckets import plan as plan_runs
from lioncub.optim.clipping import CarriedClip, clipped_beta1
from lioncub.optim.layout import make_layout
from lioncub.optim.sharded import ShardedBucketSet, ShardedLayout
from lioncub.optim.stats import Clock, CommStats

log = logging.getLogger("lioncub")


class Phase:
    """Which method runs at each step: `method` after a dense start of max(dense_warmup, guard_start) steps."""

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

    def arrived(self, wait: bool = False) -> list[int]:
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
    clip_coef: float = 1.0  # the clip coefficient its codec applied to the gradients (Engine.carried_clip)
    clip_taken: bool = False  # clip_grad_norm_ took the pass for this step's clip (Engine.clipped)
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


SAME_GRADIENTS_WARNING = (
    "LionCub: every rank brought the same gradients to step %d: a model wrapped in DistributedDataParallel "
    "(its all-reduce already averaged them: build LionCub on the unwrapped model, or call "
    "lioncub.attach_ddp(model, opt)) or every rank reading the same data (shard it, e.g. DistributedSampler)")


DIFFERENT_PARAMETERS_WARNING = (
    "LionCub: the ranks' parameters differed at the first step; every rank now has rank 0's, as DDP broadcasts "
    "at construction (call lioncub.broadcast_parameters(model) after building the model: it covers buffers too)")


def fingerprint(grads) -> torch.Tensor:
    """[sum, sum of magnitudes] of the gradients in float64: bit-equal gradients give bit-equal figures."""
    out = torch.zeros(2, dtype=torch.float64)
    for g in grads:
        out += torch.stack([g.sum(dtype=torch.float64), g.abs().sum(dtype=torch.float64)]).cpu()
    return out


class Engine:
    """One optimizer's exchanges: its state (the module's docstring lists it) and `step`, one step end to end."""

    def __init__(self, param_groups: list, state, *, method, levels, momentum_sync, process_group, bucket_mb,
                 grad_wire_dtype, skip_nonfinite: bool, overlap: bool, dense_warmup: int, node_size,
                 sharding=None):
        spec = methods.get(method)
        self.spec, self._levels_arg = spec, levels
        self.wire_dtype = str(grad_wire_dtype).removeprefix("torch.")
        self.skip_nonfinite = skip_nonfinite
        if overlap:  # the thread sends during backward, as may the model (DDP, FSDP, SyncBatchNorm, tensor parallel)
            process_group = own_group(process_group)
        if sharding is not None:  # a model sharded by FSDP2 (lioncub.attach_fsdp)
            self.layout = ShardedLayout(process_group, sharding)
        else:
            device = next((p.device for g in param_groups for p in g["params"]), torch.device("cpu"))
            self.layout = make_layout(process_group, node_size, spec, device)
        self.levels = spec.resolve_levels(self.layout.voters, levels)
        self.schedule = schedules.resolve(momentum_sync)
        guard = 0 if spec.dense else self.schedule.start_steps([g["betas"] for g in param_groups])
        self.phase = Phase(spec, dense_warmup, guard)
        self._run_bytes = int(wire.STEP_RUN_MB * 2**20) if bucket_mb is None else 0  # chosen buckets stay
        self._runs: tuple[int, list | None] | None = None  # (buckets planned, the step's units or None)
        if bucket_mb is None:
            bucket_mb = wire.auto_bucket_mb(sum(p.numel() * p.element_size() for g in param_groups
                                                for p in g["params"] if p.requires_grad))
        self.bucket_mb = bucket_mb
        self.buckets = (ShardedBucketSet(param_groups, state, sharding) if sharding is not None else
                        BucketSet(param_groups, state, int(bucket_mb * 2**20), self.layout.node_size))
        self.stats = CommStats()
        self.skips = DeviceSkips()  # steps whose skip was decided on the device (world size 1)
        self.steps = 0  # steps taken (skipped ones included)
        self.momenta_identical = True
        self.pending: ExchangePass | None = None
        self.wants_sumsq = False  # clip_grad_norm_ was called: passes sum the squared gradients
        self.carried_clip = CarriedClip()  # the last clip_grad_norm_'s coefficient, for the next pass
        self.attached_to = None  # the torch DDP model (lioncub.attach_ddp) that drives backward, if any
        self._exchanges: dict = {}  # (method name, bucket index) -> its exchange
        self._scaler = None  # weakref to the lioncub.GradScaler whose scale passes divide out
        self._scratch: dict = {}
        self.warned_regrad = False
        self.ddp_alongside = False  # a torch DDP model LionCub is not attached to wraps the parameters (backward.py)
        self.side_collectives: list = []  # sent this step outside its kind's exchange (the statistics add them)
        self.local_checks = False  # local steps (lioncub.optim.local) check this rank's own gradients each step
        self._overlap_wanted = overlap
        self.overlap = Overlap(self) if overlap and self.world_size > 1 and self.buckets else None
        self.backward_check = BackwardCheck(self) if skip_nonfinite and self.buckets and sharding is None else None

    # --- who and what -----------------------------------------------------------------------------------

    @property
    def group(self):
        return self.layout.group

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def method_at(self, step: int):
        return self.phase.method_at(step)

    def next_method(self):
        """The method of the coming step."""
        return self.phase.method_at(self.steps + 1)

    def zero_parity(self, step: int) -> int:
        """Which way a voter whose c is exactly 0 votes in the 1-bit codes: alternating over voters (ranks, or
        nodes) and steps."""
        return (self.layout.voter + step) % 2

    def exchange_of(self, k: int, method):
        """Bucket k's exchange for `method` (built on first use, for the current process group)."""
        key = (method.name, k)
        x = self._exchanges.get(key)
        if x is None:
            levels = self.levels if method is self.spec else 0
            x = self._exchanges[key] = self.layout.exchange(method, self.buckets[k], levels, self.wire_dtype)
        return x

    def step_units(self, method) -> tuple[list, list]:
        """(units, their exchanges) for a step that communicates in step(), where nothing overlaps: runs of
        adjacent automatic buckets (lioncub.optim.buckets.Run, flat layout only), else the BucketSet itself."""
        n = len(self.buckets)
        if self._runs is None or self._runs[0] != n:
            plan = plan_runs(self.buckets.buckets, self._run_bytes) if self._run_bytes else None
            self._runs = (n, None if plan is None or len(plan) == n else
                          [self.buckets[m[0]] if len(m) == 1 else Run(self.buckets, m) for m in plan])
        units = self._runs[1]
        if units is None:
            return self.buckets, [self.exchange_of(k, method) for k in range(n)]
        xs = []
        for k, unit in enumerate(units):
            key = (method.name, "run", k)
            if key not in self._exchanges:
                levels = self.levels if method is self.spec else 0
                self._exchanges[key] = self.layout.exchange(method, unit, levels, self.wire_dtype)
            xs.append(self._exchanges[key])
        return units, xs

    def scratch(self, b) -> torch.Tensor:
        """A buffer as large as bucket b's gradient (the largest of its dtype and device), for the unscaled copy."""
        key = (b.g.dtype, b.g.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < b.n:
            # (a bucket over an FSDP unit has no gradient buffer until its reduce-scatter is collected)
            n = max(x.n for x in self.buckets if x.g is None or (x.g.dtype, x.g.device) == key)
            buf = self._scratch[key] = torch.empty(n, dtype=b.g.dtype, device=b.g.device)
        return buf[: b.n]

    # --- passes -----------------------------------------------------------------------------------------

    def begin_pass(self) -> ExchangePass:
        """A pass for the coming step's gradients, run during backward (the overlap hooks)."""
        p = ExchangePass(step=self.steps + 1, method=self.next_method(), overlapped=True)
        if not p.method.dense:
            p.scale = self.loss_scale()
            p.clip_coef = self.carried_clip.for_pass(p.step)
            p.sumsq = torch.zeros((), dtype=torch.float64, device=self.buckets.device) if self.wants_sumsq else None
        return p

    @torch.no_grad()
    def exchange_bucket(self, k: int, p: ExchangePass, captured: bool = False) -> None:
        """Bucket k of pass p (buckets come in order): collect its gradients (unless `captured` already copied
        them), then for a dense method average them in place; for a compressed one encode them (divided by the
        loss scale; the momentum update deferred until the ranks agree to take the step) and exchange."""
        buckets, layout = self.buckets, self.layout
        b = buckets[k]
        t0 = time.perf_counter()
        if not captured:
            buckets.collect(k)
        x = self.exchange_of(k, p.method)
        if not p.method.dense:
            inv = None if p.scale is None else p.scale.inv_scale.to(b.g.device)
            local = b.g
            if inv is not None and (layout.codec_reads_local or p.sumsq is not None):
                local = torch.mul(b.g, inv, out=self.scratch(b))
            if p.sumsq is not None:
                p.sumsq = p.sumsq + sum_squares(local)
            g, offsets, comm_s = layout.codec_input(b, x, local, inv)
            p.comm_s, t0 = p.comm_s + comm_s, t0 + comm_s
            h = buckets.hyper(b)
            p.finite.append(x.encode(g, b.m, beta1=clipped_beta1(h.beta1, p.clip_coef), beta2=h.beta2,
                                     offsets=offsets, zero_parity=self.zero_parity(p.step), update_momentum=False))
        t1 = time.perf_counter()
        p.codes.append(x())
        p.quantize_s += t1 - t0
        p.comm_s += time.perf_counter() - t1
        p.collectives += x.collectives

    def end_pass(self, p: ExchangePass) -> None:
        """The end of a pass: agree on the non-finite count (compressed methods: a dense one checks the mean),
        the sum of squared gradients and which parameters no rank gave a gradient, in one message, and note the
        gradients' versions, so step() can tell whether they changed since."""
        t0 = time.perf_counter()
        flag = 0 if p.method.dense else nonfinite_flag(p.finite)
        count, total, unused = agree_control(flag, p.sumsq, self.layout.group, self.buckets.device,
                                             len(self.buckets.unused))
        p.collectives.append(wire.CONTROL)
        p.untouched = self.untouched(unused, p.collectives)
        if not p.method.dense:
            p.nonfinite_ranks = count
            p.bad = count if self.skip_nonfinite else 0
            p.sumsq_total = None if p.sumsq is None else total
        p.comm_s += time.perf_counter() - t0
        p.versions = self.buckets.versions()

    def untouched(self, unused_total: int, collectives: list) -> frozenset:
        """The parameters no rank gave a gradient this step, as (bucket, index), given the control message's
        total of the ranks' counts: one more all-reduce (appended to `collectives`), of a flag per parameter,
        only on a step where some rank had some."""
        if not unused_total:
            return frozenset()
        if self.world_size == 1:
            return frozenset(self.buckets.unused)
        flags = self.buckets.used_flags()
        used = used_anywhere(flags, self.group, self.buckets.device)
        collectives.append(wire.usage_collective(len(flags)))
        pairs = [(k, i) for k, b in enumerate(self.buckets) for i in range(len(b.params))]
        return frozenset(pair for pair, u in zip(pairs, used) if not u)

    def offer(self, p: ExchangePass | None) -> None:
        """The pass step() should apply (the overlap's, at the end of backward; None drops it)."""
        self.pending = p

    def pending_pass(self, allow_unconfirmed_scale: bool = False) -> ExchangePass | None:
        """The coming step's pass, if step() would apply it as it stands (read-only)."""
        p = self.pending
        if p is None or not p.current(self.steps + 1, self.buckets, allow_unconfirmed_scale):
            return None
        return p

    def take_pass(self) -> ExchangePass | None:
        """step(): the pass to apply to this step, if any (the slot is emptied either way)."""
        p, self.pending = self.pending, None
        if p is not None and p.clip_coef != 1.0 and not p.clip_taken:
            p.stale = True  # its codec clipped, and this step did not: exchange the gradients as they are
        if p is None or p.current(self.steps, self.buckets):
            if p is not None and p.overlapped and self.attached_to is not None:
                self.buckets.warn_if_copies_changed(self.steps)
            return p
        if p.step == self.steps and p.scale is not None and not p.scale_confirmed and not p.stale:
            self._scaler = None  # the scaler did not unscale this step's gradients: it is no longer in use
        elif p.step == self.steps and not p.stale and p.overlapped and not self.warned_regrad:
            if self.rank == 0:
                log.warning("LionCub: gradients changed after backward (clipping, unscaling, a new .grad); "
                            "step() exchanges them again, without overlap. Use opt.clip_grad_norm_ and "
                            "lioncub.GradScaler, which keep the overlap where they can.")
            self.warned_regrad = True
        return None

    @torch.no_grad()
    def average_now(self) -> None:
        """A dense step without overlap: average the gradients before step() (clipping and the scaler need
        the mean); step() then applies them as they are. A no-op if they already are."""
        if self.pending_pass() is not None:
            return
        self.buckets.collect()
        t0 = time.perf_counter()
        p = ExchangePass(step=self.steps + 1, method=self.phase.dense_method, overlapped=False)
        for k in range(len(self.buckets)):
            self.exchange_bucket(k, p, captured=True)
        self.end_pass(p)
        p.comm_s = p.exposed_s = time.perf_counter() - t0
        self.pending = p

    def clipped(self, p: ExchangePass | None, coef: float, exact: bool) -> None:
        """clip_grad_norm_ multiplied the gradients by `coef` (1: it did not bite) after pass p. Gradients
        averaged for a dense step stay averaged. A vote p took stands if its codec applied `coef`, or, unless
        `exact`, any coefficient (the approximation: its codec read the previous step's coefficient, and the
        deferred momentum update reads the clipped gradients); else it is stale (step() takes it again, without
        the warning). The next pass carries `coef` (lioncub.optim.clipping)."""
        self.carried_clip.record(self.steps + 1, coef, exact)
        if p is None:
            return
        if not p.method.dense and exact and (coef != 1.0 or p.clip_coef != 1.0):
            p.stale = True
            return
        if coef != 1.0:
            if not p.method.dense:
                self.layout.clipped_pass([self.exchange_of(k, p.method) for k in range(len(self.buckets))], coef)
            p.versions = self.buckets.versions()
        p.clip_taken = True

    # --- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, timing: bool) -> None:
        """Step self.steps + 1 on the gradients in the buckets (or a pass that already exchanged them)."""
        began = time.perf_counter()
        self.count_device_skips()
        self.steps += 1
        self.stats.steps += 1
        self.buckets.adopt_moved_params()
        self.start_equal()
        method = self.method_at(self.steps)
        done = self.take_pass()
        overlapped = done is not None and done.overlapped
        self.stats.overlapped_steps += overlapped
        self.stats.last_backward_wait_s = done.exposed_s if overlapped else 0.0
        if done is None or (method.dense and not self.buckets.private):
            self.buckets.collect()
        if self.steps == self.phase.first_compressed_step and not self.ddp_alongside:
            self.check_replicas()  # (the buckets hold this rank's own gradients)
        clock = Clock(timing and self.buckets.is_cuda)
        if method.dense:
            self._dense_step(clock, done)
        elif self.world_size == 1:
            self._local_step(clock)
        elif done is not None:
            self._apply_pass(clock, done)
        else:
            self._compressed_step(clock)
        self.buckets.end_step()
        if timing:
            self.stats.tick(began)

    @contextlib.contextmanager
    def keep(self, untouched: frozenset):
        """Leave the parameters no rank gave a gradient (and their momenta) as they are, as torch optimizers skip
        a .grad of None: their values are put back after the update, which ran on whole buckets."""
        if not untouched:
            yield
            return
        views = []
        for k, i in sorted(untouched):
            b = self.buckets[k]
            views += [b.param_view(i), self.layout.momentum_piece(b, i)]
        saved = [v.clone() for v in views]
        yield
        for v, copy in zip(views, saved):
            v.copy_(copy)

    def _local_step(self, clock) -> None:
        """Plain Lion; a non-finite gradient makes the update kernels write nothing, decided on the device
        (DeviceSkips: on a GPU the count comes back later, without draining the queue)."""
        t0 = clock()
        buckets = self.buckets
        flag = kernels.nonfinite_flag(self.finite_flags()) if self.skip_nonfinite and len(buckets) else None
        with self.keep(self.untouched(len(buckets.unused), [])):
            self.layout.dense_step(buckets, skip=flag)
        self.record((), apply_s=clock() - t0)
        if flag is not None:
            self.skips.add(self.steps, flag)
            self.count_device_skips(wait=not buckets.is_cuda)

    def count_device_skips(self, wait: bool = False) -> None:
        """Count (and report) the steps skipped on the device whose flags have come back."""
        for step in self.skips.arrived(wait):
            self.stats.skipped_steps += 1
            if self.rank == 0:
                log.warning("LionCub: step %d skipped (non-finite gradient); %d skipped so far", step,
                            self.stats.skipped_steps)

    def _dense_step(self, clock, done=None) -> None:
        t0 = clock()
        if done is not None:  # a pass averaged the gradients
            collectives, comm, exposed, untouched = done.collectives, done.comm_s, done.exposed_s, done.untouched
        else:
            collectives, unused = [], len(self.buckets.unused)
            if self.world_size > 1:
                for x in self.step_units(self.phase.dense_method)[1]:  # (runs: a larger sum, in another order)
                    x()
                    collectives += x.collectives
                _, _, unused = agree_control(0, None, self.group, self.buckets.device, unused)
                collectives.append(wire.CONTROL)
            untouched = self.untouched(unused, collectives)
            comm = exposed = clock() - t0
        t1 = clock()
        # the reduced gradients are identical on all ranks, so this check agrees without a message
        if self.skip_nonfinite and not self._all_finite():
            return self._skip("non-finite gradient", collectives, comm, exposed)
        with self.keep(untouched):
            collectives = list(collectives) + self.layout.dense_step(self.buckets)
        self.momenta_identical = True  # (a dense warm-up step) every rank applied the same mean gradient
        t2 = clock()
        if self.phase.charges_guard(self.steps):
            self.schedule.spend(self.credit_bytes(collectives))
        self.record(collectives, comm_s=comm, apply_s=t2 - t1, exposed_s=exposed)

    def _compressed_step(self, clock) -> None:
        """Per unit (a bucket, or a run of adjacent buckets: lioncub.optim.buckets.Run): 1. the pre-pass (the node
        layout first reduces inside the node); 2. the control message (non-finite count, parameters without a
        gradient); 3. encode with the momentum update fused in, exchange, apply."""
        buckets, layout = self.buckets, self.layout
        units, xs = self.step_units(self.spec)
        seconds = dict(quantize=0.0, comm=0.0, apply=0.0)
        prepared, early = [], self._pre_pass_from_backward(units, xs)
        flags = [] if early is None else [early[0]]
        for j, (b, x) in enumerate(zip(units, xs)):
            t0 = clock()
            g, offsets, _ = layout.codec_input(b, x, b.g)
            t1 = clock()
            if early is None:
                ok, mult = x.prepare(g, b.m, beta1=buckets.hyper(b).beta1, offsets=offsets)
                flags.append(ok)
            else:
                mult = early[1][j]
            prepared.append((g, offsets, mult))
            seconds["comm"] += t1 - t0
            seconds["quantize"] += clock() - t1
        collectives = [c for x in xs for c in x.collectives if c.op == "reducescatter"] + [wire.CONTROL]
        t1 = clock()
        bad, _, unused = agree_control(nonfinite_flag(flags), None, layout.group, buckets.device, len(buckets.unused))
        bad = bad if self.skip_nonfinite else 0
        untouched = self.untouched(unused, collectives)
        seconds["comm"] += clock() - t1
        if bad:
            return self._skip(f"{bad} rank(s) saw a non-finite gradient", collectives, seconds["comm"])
        codes = []
        with self.keep(untouched):
            for b, x, (g, offsets, mult) in zip(units, xs, prepared):
                h = buckets.hyper(b)
                ta = clock()
                x.pack(g, b.m, mult, beta1=h.beta1, beta2=h.beta2, offsets=offsets,
                       zero_parity=self.zero_parity(self.steps))
                tb = clock()
                codes.append(x())
                tc = clock()
                layout.apply(b, x, codes[-1], h)
                seconds["quantize"] += tb - ta
                seconds["comm"] += tc - tb
                seconds["apply"] += clock() - tc
                collectives += [c for c in x.collectives if c.op != "reducescatter"]
        self._finish(clock, xs, codes, collectives, quantize_s=seconds["quantize"], comm_s=seconds["comm"],
                     apply_s=seconds["apply"], units=units)

    def _all_finite(self) -> bool:
        """Every gradient finite (one host sync): at world size 1 from the flags backward took where they hold; else
        the buckets as they are now (after an average: the mean)."""
        return self.grads_finite() if self.world_size == 1 else self.buckets.all_finite()

    def _pre_pass_from_backward(self, units, xs):
        """The pre-pass backward took, if the codec reads this rank's own gradients and it holds: (the check, per
        unit the L1 multipliers or None); else None."""
        if self.backward_check is None or not self.layout.codec_reads_local or not xs:
            return None
        return self.backward_check.taken(self.buckets, units, xs[0])

    def _apply_pass(self, clock, done) -> None:
        """Apply what backward agreed on, with the deferred momentum update."""
        if done.bad:
            return self._skip(f"{done.bad} rank(s) saw a non-finite gradient", done.collectives, done.comm_s,
                              done.exposed_s)
        t0 = clock()
        xs = [self.exchange_of(k, self.spec) for k in range(len(self.buckets))]
        with self.keep(done.untouched):
            for b, x, code in zip(self.buckets, xs, done.codes):
                self.layout.apply(b, x, code, self.buckets.hyper(b), deferred=True)
        self._finish(clock, xs, done.codes, list(done.collectives), quantize_s=done.quantize_s, comm_s=done.comm_s,
                     apply_s=clock() - t0, exposed_s=done.exposed_s)

    def _finish(self, clock, xs, codes, collectives, *, quantize_s, comm_s, apply_s, exposed_s=None,
                units=None) -> None:
        """After a compressed step (over `units`, default the buckets): its agreement, the momentum sync if one is
        due, the statistics."""
        self.momenta_identical = False
        stats, layout = self.stats, self.layout
        units = self.buckets if units is None else units
        stats.last_agreement = layout.agreement(self.spec.codec, units, xs, codes, self.levels)
        due = self.schedule.decide(self.steps, stats.last_agreement,
                                   self.credit_bytes(self.side_collectives + collectives),
                                   self.credit_bytes(layout.sync_collectives(self.buckets)))
        sync_s = 0.0
        if due:
            ts = clock()
            collectives += self.sync_momentum()
            sync_s = clock() - ts
        self.record(collectives, quantize_s=quantize_s, comm_s=comm_s, apply_s=apply_s, sync_s=sync_s,
                    exposed_s=None if exposed_s is None else exposed_s + sync_s)

    def _skip(self, why: str, collectives=(), comm_s: float = 0.0, exposed_s: float | None = None) -> None:
        self.stats.skipped_steps += 1
        self.record(collectives, comm_s=comm_s, exposed_s=exposed_s)
        if self.rank == 0:
            log.warning("LionCub: step %d skipped on all ranks (%s); %d skipped so far",
                        self.steps, why, self.stats.skipped_steps)

    def record(self, collectives, *, quantize_s=0.0, comm_s=0.0, apply_s=0.0, sync_s=0.0, exposed_s=None) -> None:
        collectives, self.side_collectives = self.side_collectives + list(collectives), []
        sent, recv = self.layout.traffic(collectives)
        self.stats.record(sent, recv, len(collectives), quantize_s, comm_s, apply_s, sync_s, exposed_s,
                          self.layout.node_bytes(collectives))

    def credit_bytes(self, collectives) -> int:
        """The bytes the adaptive guard's credit counts: those that leave the node (all of them in the flat
        layout). In the node layout the node's fp32 reduce-scatter would otherwise earn credit for momentum
        syncs, which cross the slow links."""
        return self.layout.traffic(collectives)[0] - self.layout.node_bytes(collectives)

    def finite_flags(self) -> list:
        """Per bucket, whether all its gradients are finite (0-dim bool tensors, no host sync): the flag backward
        took where it still holds, else a read of the bucket now."""
        buckets = self.buckets
        early = self.backward_check.flags(buckets) if self.backward_check else [None] * len(buckets)
        return [kernels.finite_flag(b.g) if f is None else f for f, b in zip(early, buckets)]

    def grads_finite(self) -> bool:
        """Whether every gradient of this rank is finite (one host sync), from finite_flags."""
        return not bool(kernels.nonfinite_flag(self.finite_flags())) if len(self.buckets) else True

    def start_equal(self) -> None:
        """At a run's first step, before its first update: every rank must hold the same parameters, as DDP
        guarantees. One 16-byte all-reduce of their fingerprint (layout.same_parameters); if they differ, every
        rank takes rank 0's (a broadcast per bucket) and rank 0 warns once. Not on a resumed run's steps (a
        checkpoint's step count): with local steps the replicas differ between outer steps."""
        if self.steps == 1 and self.buckets:
            if self.layout.same_parameters(self.buckets) is False:
                self.layout.broadcast_parameters(self.buckets)
                if self.rank == 0:
                    log.warning(DIFFERENT_PARAMETERS_WARNING)

    def check_replicas(self) -> None:
        """On a run's first compressed step: warn (rank 0) if every rank's gradients are the same (the layout
        decides where that can be told: not with one rank, nor where the buckets hold shards)."""
        same, collectives = self.layout.same_gradients(fingerprint(b.g for b in self.buckets), self.buckets.device)
        self.side_collectives += collectives
        if same and self.rank == 0:
            log.warning(SAME_GRADIENTS_WARNING, self.steps)

    # --- the loss scaler (lioncub.GradScaler) -----------------------------------------------------------

    def use_loss_scale(self, scaler) -> None:
        """Divide `scaler`'s scale out of the gradients in the passes from now on (it calls this in unscale_)."""
        self._scaler = weakref.ref(scaler)

    @property
    def loss_scaled(self) -> bool:
        """Whether a lioncub.GradScaler unscales the gradients (its unscale_ checks them for inf/NaN)."""
        return self._scaler is not None

    def loss_scale(self) -> LossScale | None:
        scaler = self._scaler() if self._scaler is not None else None
        inv = None if scaler is None or not scaler.is_enabled() else scaler.inverse_scale()
        return None if inv is None else LossScale(scaler.generation, inv)

    def before_unscale(self, scaler):
        """lioncub.GradScaler.unscale_ is about to divide .grad by its scale: link the scaler (later passes
        divide its scale out themselves) and, for a dense step no pass averaged, average now, so that every
        rank checks the same mean. Returns what after_unscale needs."""
        self.use_loss_scale(scaler)
        dense = self.next_method().dense
        p = self.pending_pass(allow_unconfirmed_scale=True)
        if p is None and dense and self.world_size > 1:
            self.average_now()
            p = self.pending_pass(allow_unconfirmed_scale=True)
        return p, dense

    def after_unscale(self, scaler, before, local_inf: bool) -> bool:
        """.grad is unscaled now (and `local_inf` says whether this rank saw an inf/NaN): the flag every rank
        agrees on. A pass that divided out exactly this scale already counted every rank's non-finite
        gradients; a pass taken on the scaled gradients is stale."""
        p, dense = before
        buckets = self.buckets
        if buckets.copies:  # under DDP the buckets hold copies of .grad: unscale them alike
            buckets.scale_(scaler.inverse_scale(), buffers_only=True)
        if self.backward_check is not None:  # (torch's unscale_ leaves the version counters as they were)
            # it read every gradient: all finite, and still so after a multiplication by 1/scale <= 1
            self.backward_check.vouch(buckets, not local_inf and scaler.get_scale() >= 1.0)
        if self.world_size == 1:
            return local_inf
        if dense:  # a check of the averaged gradients: the same on every rank
            if buckets.private:
                local_inf = not buckets.all_finite()
            if p is not None:
                p.versions = buckets.versions()  # still the mean, unscaled
            return local_inf
        if p is not None and p.scale is not None and p.scale.generation == scaler.generation:
            p.versions, p.scale_confirmed = buckets.versions(), True
            return p.nonfinite_ranks > 0
        if p is not None:
            p.stale = True
        return any_rank(local_inf, self.group, buckets.device, "GradScaler found_inf")

    # --- who drives it ----------------------------------------------------------------------------------

    def use_process_group(self, group) -> None:
        """Communicate on `group` from now on: lioncub.attach_ddp gives LionCub a group of its own, and a
        LionCub built before the framework initialised torch.distributed learns its world size here (before
        its first step)."""
        layout = self.layout.with_group(group)
        if layout.world_size != self.world_size:
            if self.steps:
                raise ValueError(f"the optimizer has taken {self.steps} steps on {self.world_size} rank(s) and "
                                 f"cannot move to a process group of {layout.world_size}")
            self.levels = self.spec.resolve_levels(layout.voters, self._levels_arg)
        self.layout = layout
        if self.overlap is None and self._overlap_wanted and self.world_size > 1 and self.buckets:
            self.overlap = Overlap(self)
        self._exchanges.clear()

    def attach(self, owner, group, sync_wanted) -> None:
        """Another object (a torch DDP model) drives backward and owns .grad: communicate on `group`, keep
        private copies of the gradients, and exchange during backward only when `sync_wanted()` (DDP's
        no_sync()). Idempotent for the same owner."""
        if self.attached_to is owner:
            return
        self.use_process_group(group)
        self.buckets.keep_private()
        self.attached_to = owner
        if self.overlap is not None:
            self.overlap.sync_wanted = sync_wanted

    def add_group(self, gi: int, state) -> None:
        """Param group `gi` was added after construction (every rank must add the same groups at the same
        step, as it built the optimizer): its parameters get buckets after the others and hooks; a pass taken
        before is dropped (step() exchanges again)."""
        added = self.buckets.add_group(gi, state)
        self.pending = None
        if added and self.overlap is not None:
            enabled, sync_wanted = self.overlap.enabled, self.overlap.sync_wanted
            self.overlap.close()
            self.overlap = Overlap(self)
            self.overlap.enabled, self.overlap.sync_wanted = enabled, sync_wanted
        elif added and self._overlap_wanted and self.world_size > 1:
            self.overlap = Overlap(self)
        if added and self.backward_check is not None:
            self.backward_check.close()
            self.backward_check = BackwardCheck(self)

    # --- momenta ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def sync_momentum(self) -> list:
        """Average the momenta over the ranks (a collective); returns what it put on the wire."""
        collectives = self.layout.sync_momentum(self.buckets) if self.world_size > 1 else []
        self.stats.momentum_syncs += 1
        self.momenta_identical = True
        return collectives
