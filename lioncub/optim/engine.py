"""The engine behind LionCub: the objects one optimizer's exchanges need, and the small public API that
everything driving it uses (the optimizer's step(), the overlap hooks, torch DDP, the loss scaler, clipping).

    buckets   BucketSet: parameters, gradients and momenta in flat buffers (lioncub.optim.buckets)
    layout    FlatLayout / NodeLayout: the process group and how ranks vote (lioncub.optim.layout)
    phase     Phase: which method runs at each step (lioncub.optim.phase)
    schedule  when momenta are averaged (lioncub.optim.schedules)
    pending   the ExchangePass of the coming step, if one ran before step() (lioncub.optim.passes)
    overlap   the backward hooks and communication thread (lioncub.optim.overlap), or None
    backward_check   the non-finite check taken during backward where no overlap pass reads the gradients
              (lioncub.optim.finite), or None
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from lioncub import methods
from lioncub.comm import wire
from lioncub.comm.transport import any_rank, own_group, used_anywhere
from lioncub.optim import passes, runs, schedules
from lioncub.optim.buckets import BucketSet
from lioncub.optim.finite import BackwardCheck
from lioncub.optim.layout import make_layout
from lioncub.optim.overlap import Overlap
from lioncub.optim.passes import ExchangePass, LossScale
from lioncub.optim.phase import Phase
from lioncub.optim.sharded import ShardedBucketSet, ShardedLayout
from lioncub.optim.skips import DeviceSkips
from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")


class Engine:
    def __init__(self, param_groups: list, state, *, method, levels, momentum_sync, process_group, bucket_mb,
                 grad_wire_dtype, skip_nonfinite: bool, overlap: bool, dense_warmup: int, hierarchical: bool,
                 node_size, sharding=None):
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
            self.layout = make_layout(process_group, hierarchical, node_size, spec, device)
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
        self.attached_to = None  # the torch DDP model (lioncub.attach_ddp) that drives backward, if any
        self._exchanges: dict = {}  # (method name, bucket index) -> its exchange
        self._scaler = None  # weakref to the lioncub.GradScaler whose scale passes divide out
        self._scratch: dict = {}
        self.warned_regrad = False
        self.ddp_alongside = False  # a torch DDP model LionCub is not attached to wraps the parameters (overlap.py)
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
        adjacent automatic buckets (lioncub.optim.runs, flat layout only), else the BucketSet itself."""
        n = len(self.buckets)
        if self._runs is None or self._runs[0] != n:
            plan = runs.plan(self.buckets.buckets, self._run_bytes) if self._run_bytes else None
            self._runs = (n, None if plan is None or len(plan) == n else
                          [self.buckets[m[0]] if len(m) == 1 else runs.Run(self.buckets, m) for m in plan])
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
            p.sumsq = torch.zeros((), dtype=torch.float64, device=self.buckets.device) if self.wants_sumsq else None
        return p

    def exchange_bucket(self, k: int, p: ExchangePass, captured: bool = False) -> None:
        passes.exchange(self, k, p, captured)

    def end_pass(self, p: ExchangePass) -> None:
        passes.agree(self, p)

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
        if p is None or p.current(self.steps, self.buckets):
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

    def rescaled(self, p: ExchangePass | None) -> None:
        """The gradients were multiplied by a factor after pass p (clipping, the scaler): a vote p took on
        them is stale (step() takes it again, without the warning); gradients averaged for a dense step stay
        averaged."""
        if p is None:
            return
        if p.method.dense:
            p.versions = self.buckets.versions()
        else:
            p.stale = True

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
