"""LionCub: Lion whose data-parallel ranks agree on a compressed update.

Do not wrap the model in DDP: the optimizer does all communication itself, for every method including
the `allreduce` baseline, so switching methods changes one argument. Call `broadcast_parameters(model)`
once so every rank starts from the same weights. By default each bucket's exchange runs during backward,
as soon as its gradients are final (lioncub.optim.overlap); `step()` applies the agreed update.

Parameters, gradients and momenta live in flat per-dtype buffers; each parameter's `.data` and `.grad`
are views into them (as DDP does with gradient_as_bucket_view), so the codec kernels run once per bucket
over contiguous memory and nothing is copied per step. Use `opt.zero_grad()`: it zeroes the buffers and
keeps the views (a `.grad` that was set to None or replaced still works, at the cost of a copy).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from lioncub import kernels, methods
from lioncub.comm import wire
from lioncub.comm.transport import agree_control, allreduce_mean_, group_rank_size, record_call_times
from lioncub.optim import agreement, hierarchy, schedules
from lioncub.optim.overlap import Overlap

log = logging.getLogger("lioncub")
BUCKET_ALIGN_BYTES = 64  # every bucket starts on a cache line: aligned vector access in the kernels


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


class Bucket:
    """A contiguous run of whole parameters of one param group, dtype and device. `order` is where its
    gradients come in backward (0: first), relative to its group."""

    def __init__(self, group_index, params, p, g, m, offsets, order=0.0, padded=None):
        self.group_index, self.params, self.order = group_index, params, order
        self.p, self.g, self.m = p, g, m  # flat views (m: this rank's shard in the hierarchical layout)
        self.offsets = offsets  # segment boundaries, one segment per parameter tensor
        self.n = p.numel()
        # hierarchical layout: p and g padded with zeros to G shards of `shard` elements
        self.p_full, self.g_full = padded or (p, g)
        self.shard = m.numel()
        self.exchange = None  # built on first use by the method
        size = p.element_size()  # where each parameter's .data and .grad views start (checked every step)
        self.data_ptrs = [p.data_ptr() + size * s for s in offsets[:-1]]
        self.grad_ptrs = [g.data_ptr() + size * s for s in offsets[:-1]]

    def grad_in_place(self, i: int, param) -> bool:
        """Whether parameter i's .grad is still its view of the bucket."""
        grad = param.grad
        return grad is not None and grad.data_ptr() == self.grad_ptrs[i] and grad.numel() == param.numel()


class _Timer:
    def __init__(self, sync_cuda: bool):
        self.sync_cuda = sync_cuda

    def __call__(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _wire_dtype(value) -> torch.dtype:
    """torch.float32 / torch.bfloat16, or their names (so JSON configs can carry it)."""
    if isinstance(value, str):
        value = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16}.get(value.removeprefix("torch."), value)
    return value


def _validate(lr, betas, weight_decay, bucket_mb, grad_wire_dtype):
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}; Lion's defaults are (0.9, 0.99)")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0 (or None for lioncub.comm.wire.auto_bucket_mb), got {bucket_mb}")
    if grad_wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_wire_dtype must be torch.float32 or torch.bfloat16, got {grad_wire_dtype}")


class LionCub(torch.optim.Optimizer):
    """Lion with compressed data-parallel agreement.

    Args:
        params: parameters or param groups (lr, betas, weight_decay may differ per group).
        lr, betas, weight_decay: as in Lion; the update is p <- p*(1 - lr*wd) - lr*U.
        method: a name from lioncub.methods.NAMES: "allreduce" (average gradients, plain Lion: the
            baseline), "vote-allgather", "vote-1bit", "vote-pbit", "avg-pbit" or "l1-pbit" (see README).
        levels: L1 levels s for "l1-pbit" (default max(1, 127 // world_size)).
        momentum_sync: None, an int K (average momenta every K steps), a schedule (lioncub.EveryK,
            FirstSteps, Geometric, Adaptive) or its text ("every:K", "adaptive", ...: schedules.parse).
            "adaptive" is the guard: a dense start until the momentum leads (12 steps for Lion's betas),
            then momentum syncs where the ranks agree little, within the method's bytes again.
        process_group: the data-parallel group (default: the world, or none if not initialised).
        bucket_mb: parameters are flattened into buckets of about this many MiB; one set of
            collectives per bucket. None (default): about 8 buckets of 1-25 MiB (lioncub.comm.wire.auto_bucket_mb).
        grad_wire_dtype: the baseline's all-reduce dtype (torch.float32 or torch.bfloat16, or "bfloat16").
        skip_nonfinite: if any rank sees a non-finite gradient, all ranks skip the step (counted in
            stats.skipped_steps).
        overlap: run each bucket's exchange during backward, as soon as its gradients are final (default);
            False communicates inside step(). The results are bit-identical either way.
        timing: synchronise CUDA around each phase so stats times are exact (costs a little speed), and time
            every collective by name (lioncub.comm.transport.call_times()).
        dense_warmup: run the first K steps with the `allreduce` method (averaged gradients, one momentum
            on every rank), then `method`; the step count is in state_dict, so a resume switches on time.

    Call `opt.clip_grad_norm_(max_norm)` (not torch.nn.utils.clip_grad_norm_) between backward and step
    to clip, and use `lioncub.GradScaler` for fp16 loss scaling: both agree across ranks.
    """

    # torch.amp.GradScaler then calls step() on every rank, which refuses it (see step): its per-rank
    # inf/NaN check would make ranks disagree; lioncub.GradScaler agrees it
    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 method: str = methods.DEFAULT, levels: int | None = None, momentum_sync=None,
                 process_group=None, bucket_mb: float | None = None, grad_wire_dtype=torch.float32,
                 skip_nonfinite: bool = True, overlap: bool = True, timing: bool = False,
                 dense_warmup: int = 0, hierarchical: bool = False, node_size: int | None = None):
        grad_wire_dtype = _wire_dtype(grad_wire_dtype)
        self.spec = methods.get(method)
        _validate(lr, betas, weight_decay, bucket_mb, grad_wire_dtype)
        if isinstance(dense_warmup, bool) or not isinstance(dense_warmup, numbers.Integral) or dense_warmup < 0:
            raise ValueError(f"dense_warmup must be an int >= 0 (steps), got {dense_warmup!r}")
        self.dense_warmup = int(dense_warmup)
        self._dense_spec = methods.get("allreduce")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.method, self.process_group = self.spec.name, process_group
        self.rank, self.world_size = group_rank_size(process_group)
        self.hierarchical = bool(hierarchical)
        self.node_size, self._nodes = self._hierarchy(node_size)
        self._levels_arg = levels
        self.levels = self.spec.resolve_levels(self.world_size // self.node_size, levels)
        self.schedule = schedules.resolve(momentum_sync)
        if self.spec.dense and momentum_sync is not None:
            log.warning("LionCub: momentum_sync has no effect with method=%r (momenta are global)", self.method)
        # the adaptive guard's dense start (schedules.Adaptive); its bytes are charged to the guard's budget
        self._guard_start = (self.schedule.start_steps([g["betas"] for g in self.param_groups])
                             if hasattr(self.schedule, "start_steps") and not self.spec.dense else 0)
        if bucket_mb is None:
            bucket_mb = wire.auto_bucket_mb(sum(p.numel() * p.element_size() for g in self.param_groups
                                                for p in g["params"] if p.requires_grad))
        self.bucket_mb, self.bucket_bytes = bucket_mb, int(bucket_mb * 2**20)
        self.grad_wire_dtype, self.skip_nonfinite, self.timing = grad_wire_dtype, skip_nonfinite, timing
        if timing:
            record_call_times(True)
        self.stats = CommStats()
        self._step = 0
        self._momenta_identical = True
        self._warned_regrad = False
        self._private_grads = False  # set by lioncub.attach_ddp: DDP owns .grad, the buckets hold copies
        self._ddp = None  # the DistributedDataParallel model attach_ddp attached this optimizer to
        self._averaged = None  # dense: gradients averaged before step() (by clip_grad_norm_ or the scaler)
        self._wants_sumsq = False  # clip_grad_norm_ was called: backward passes sum the squared gradients
        self._grad_scaler = None  # weakref to the lioncub.GradScaler whose scale backward divides out
        self._amp_scratch: dict = {}
        self._warned_amp = False
        self._buckets = self._build_buckets()
        self._overlap_wanted = overlap
        self._overlap = Overlap(self) if overlap and self.world_size > 1 and self._buckets else None

    # --- construction ---------------------------------------------------------------------------------

    def _hierarchy(self, node_size):
        """(G, the node process groups) of the hierarchical layout; (1, None) for the flat one."""
        if not self.hierarchical:
            if node_size is not None:
                raise ValueError("node_size applies only with hierarchical=True")
            return 1, None
        if self.spec.dense:
            raise ValueError("hierarchical=True is for the compressed methods (allreduce leaves its hierarchy to "
                             "NCCL/Gloo)")
        G = hierarchy.resolve_node_size(node_size)
        if self.world_size == 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("hierarchical=True needs torch.distributed initialised before LionCub is built")
            return 1, None
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        hierarchy.agree_node_size(self.process_group, G, device)
        return (G, hierarchy.Nodes(self.process_group, G)) if G > 1 else (1, None)

    @torch.no_grad()
    def _build_buckets(self) -> list[Bucket]:
        buckets, seen = [], set()
        for gi, group in enumerate(self.param_groups):
            by_kind: dict[tuple, list] = {}
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen and p.numel() > 0:
                    seen.add(id(p))
                    by_kind.setdefault((p.device, p.dtype), []).append(p)
            for (device, dtype), params in by_kind.items():
                if dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise ValueError(f"LionCub supports fp32, bf16 and fp16 parameters, not {dtype}")
                buckets += self._flatten(gi, params[::-1], dtype, device)  # backward's order, as DDP
        buckets.sort(key=lambda b: b.order)  # stable: groups interleave by where their gradients come
        return buckets

    def _flatten(self, group_index, params, dtype, device) -> list[Bucket]:
        """Copy `params` into flat buffers (each bucket starting on a 64-byte boundary), make each
        parameter's .data, .grad and momentum views into them, and cut them into buckets."""
        align = BUCKET_ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size()
        groups, current, size = [], [], 0
        for p in params:
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        starts, total, first, shards = [], 0, [0], []
        nodes = self.node_size
        for members in groups:
            first.append(first[-1] + len(members))
            starts.append(total)
            count = sum(p.numel() for p in members)
            shards.append(wire.shard_elements(count, nodes) if nodes > 1 else count)
            total += nodes * shards[-1] if nodes > 1 else -(-count // align) * align
        P = torch.zeros(total, dtype=dtype, device=device)
        G = torch.zeros(total, dtype=dtype, device=device)
        M = torch.zeros(total if nodes == 1 else sum(shards), dtype=dtype, device=device)
        buckets = []
        m_start = 0
        for start, members, before, shard in zip(starts, groups, first, shards):
            bounds = [0]
            for p in members:
                lo, n = start + bounds[-1], p.numel()
                P[lo : lo + n].copy_(p.data.reshape(-1))
                if p.grad is not None:
                    G[lo : lo + n].copy_(p.grad.reshape(-1))
                p.data = P[lo : lo + n].view_as(p)
                p.grad = G[lo : lo + n].view_as(p)
                if nodes == 1:  # (hierarchical: each rank holds a shard of the bucket's momenta, not whole ones)
                    self.state[p]["exp_avg"] = M[lo : lo + n].view_as(p)
                bounds.append(bounds[-1] + n)
            end = start + bounds[-1]
            if nodes == 1:
                m, padded = M[start:end], None
            else:
                end_full = start + nodes * shard
                m, padded = M[m_start : m_start + shard], (P[start:end_full], G[start:end_full])
                m_start += shard
            buckets.append(Bucket(group_index, members, P[start:end], G[start:end], m, bounds,
                                  before / len(params), padded))
        return buckets

    # --- gradients ------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers, keeping each .grad a view into them (set_to_none is ignored:
        a None gradient would cost a copy on the next step and counts as zero anyway). Under DDP
        (lioncub.attach_ddp) .grad belongs to DDP and is zeroed or set to None as torch does."""
        if self._private_grads:
            super().zero_grad(set_to_none)
            for b in self._buckets:
                b.g.zero_()
            return
        for b in self._buckets:
            b.g.zero_()
            for i, (p, start, end) in enumerate(zip(b.params, b.offsets[:-1], b.offsets[1:])):
                if not b.grad_in_place(i, p):
                    p.grad = b.g[start:end].view_as(p)

    @torch.no_grad()
    def _adopt_moved_params(self) -> None:
        """Frameworks sometimes replace a parameter's .data after the optimizer was built (accelerate's
        model.to("cpu:0") copies): bring the values back into the bucket and make .data its view again, so
        the update lands in the model."""
        for b in self._buckets:
            for p, ptr, start, end in zip(b.params, b.data_ptrs, b.offsets[:-1], b.offsets[1:]):
                if p.data_ptr() == ptr:
                    continue
                view = b.p[start:end]
                if p.device != view.device or p.dtype != view.dtype:
                    raise ValueError(f"a parameter moved to {p.device}/{p.dtype} after LionCub was built on "
                                     f"{view.device}/{view.dtype}: build the optimizer after model.to(...)")
                view.copy_(p.data.reshape(-1))
                p.data = view.view_as(p)

    def _collect_grads(self) -> None:
        for b in self._buckets:
            self._collect_bucket(b)

    @torch.no_grad()
    def _collect_bucket(self, b: Bucket) -> None:
        """Bring every gradient of b into its bucket view: None counts as zero, a replaced tensor is copied."""
        if self._private_grads:
            for p, start, end in zip(b.params, b.offsets[:-1], b.offsets[1:]):
                self._copy_grad(p, b.g[start:end])
            return
        for i, (p, start, end) in enumerate(zip(b.params, b.offsets[:-1], b.offsets[1:])):
            if b.grad_in_place(i, p):
                continue
            view, grad = b.g[start:end], p.grad
            if grad is None:
                view.zero_()
            else:
                if grad.is_sparse:
                    raise ValueError("LionCub does not support sparse gradients")
                view.copy_(grad.reshape(-1))
            p.grad = view.view_as(p)

    # --- the step -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating, as DDP's `no_sync()`: a backward inside the block
        starts no exchange; the first backward after it does (with the accumulated gradients)."""
        if self._overlap is None:
            yield
            return
        enabled, self._overlap.enabled = self._overlap.enabled, False
        try:
            yield
        finally:
            self._overlap.enabled = enabled

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                "LionCub: torch.amp.GradScaler checks each rank's gradients for inf/NaN alone, so one rank would "
                "skip a step that the others take. Use lioncub.GradScaler (the same arguments): every rank "
                "agrees whether to skip, and the scales stay identical.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step += 1
        self.stats.steps += 1
        self._adopt_moved_params()
        dense = self._spec_at(self._step).dense
        done = self._overlapped_pass()
        self.stats.overlapped_steps += done is not None
        self.stats.last_backward_wait_s = 0.0 if done is None else done["exposed_s"]
        if done is None and dense:
            done = self._take_averaged()
        if done is None or (dense and not self._private_grads):
            self._collect_grads()
        clock = _Timer(self.timing and any(b.p.is_cuda for b in self._buckets))
        if dense:
            self._step_dense(clock, done)
        elif self.world_size == 1:
            self._step_local(clock)
        elif done is not None:
            self._step_overlapped(clock, done)
        else:
            self._step_compressed(clock)
        return loss

    def _overlapped_pass(self) -> dict | None:
        """What this step's backward exchanged, if it is still what step() must apply."""
        if self._overlap is None or self._overlap.results is None:
            return None
        done, self._overlap.results = self._overlap.results, None
        if done["step"] != self._step or done.get("stale"):  # stale: clip_grad_norm_ or the scaler changed them
            return None
        if done.get("amp") is not None and not done.get("amp_confirmed"):
            self._grad_scaler = None  # the scaler did not unscale this step's gradients: it is no longer in use
            return None
        # averaged gradients (the dense method) may be clipped or read after backward, as with DDP; a vote
        # taken on gradients that changed since is stale and is taken again
        if not self._spec_at(self._step).dense and not self._grads_as_exchanged(done["versions"]):
            if not self._warned_regrad and self.rank == 0:
                log.warning("LionCub: gradients changed after backward (clipping, unscaling, a new .grad); "
                            "step() exchanges them again, without overlap. Use opt.clip_grad_norm_ and "
                            "lioncub.GradScaler, which keep the overlap where they can.")
            self._warned_regrad = True
            return None
        return done

    def _pending_pass(self, amp_unconfirmed_ok: bool = False) -> dict | None:
        """The backward pass of the coming step, if step() would apply it as it stands (read-only; a pass
        that divided out a loss scale counts once the scaler has unscaled .grad alike)."""
        done = None if self._overlap is None else self._overlap.results
        if done is None or done["step"] != self._step + 1 or done.get("stale"):
            return None
        if done.get("amp") is not None and not (done.get("amp_confirmed") or amp_unconfirmed_ok):
            return None
        if not self._spec_at(done["step"]).dense and not self._grads_as_exchanged(done["versions"]):
            return None
        return done

    def _spec_at(self, step: int):
        """The method of step `step` (1-based): the dense baseline during the warm-up (and the adaptive
        guard's start), then the chosen one."""
        return self._dense_spec if step <= max(self.dense_warmup, self._guard_start) else self.spec

    def _versions(self) -> list[int]:
        return [b.g._version for b in self._buckets]

    @torch.no_grad()
    def _average_now(self) -> None:
        """A dense step without overlap: average the gradients before step() (clip_grad_norm_ and the scaler
        need the mean); step() then applies them as they are. A no-op if they already are."""
        if self._averaged_ok(self._step + 1):
            return
        self._collect_grads()
        t0 = time.perf_counter()
        collectives = []
        for b in self._buckets:
            x = self._exchange(b, self._dense_spec)
            x()
            collectives += x.collectives
        dt = time.perf_counter() - t0
        self._averaged = dict(step=self._step + 1, versions=self._versions(), collectives=collectives,
                              comm_s=dt, exposed_s=dt)

    def _averaged_ok(self, step: int) -> bool:
        """Whether the gradients are still those _average_now averaged for `step`."""
        a = self._averaged
        return a is not None and a["step"] == step and a["versions"] == self._versions()

    def _take_averaged(self) -> dict | None:
        done = self._averaged if self._averaged_ok(self._step) else None
        self._averaged = None
        return done

    def _use_process_group(self, group) -> None:
        """Communicate on `group` from now on: lioncub.integrations.ddp gives LionCub a group of its own, and a LionCub
        built before the framework initialised torch.distributed learns its world size here (before its
        first step)."""
        rank, world = group_rank_size(group)
        if world != self.world_size:
            if self._step:
                raise ValueError(f"the optimizer has taken {self._step} steps on {self.world_size} rank(s) and "
                                 f"cannot move to a process group of {world}")
            self.levels = self.spec.resolve_levels(world // self.node_size, self._levels_arg)
            self.world_size = world
            if self._overlap is None and self._overlap_wanted and world > 1 and self._buckets:
                self._overlap = Overlap(self)
        self.process_group, self.rank = group, rank
        if self._nodes is not None:
            self._nodes = hierarchy.Nodes(group, self.node_size)
        for b in self._buckets:
            b.exchange = None

    @staticmethod
    def _copy_grad(p, view) -> None:
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.reshape(-1))

    @torch.no_grad()
    def _capture_grad(self, p, k: int, i: int) -> None:
        """Under DDP: copy the final gradient of parameter i of bucket k into the bucket (called by the
        overlap hook, before DDP's own hook can touch .grad)."""
        if self._private_grads:
            b = self._buckets[k]
            self._copy_grad(p, b.g[b.offsets[i] : b.offsets[i + 1]])

    def _grads_as_exchanged(self, versions) -> bool:
        if self._private_grads:  # the buckets hold copies that only the overlap hooks write
            return True
        for b, version in zip(self._buckets, versions):
            if b.g._version != version:
                return False
            if not all(b.grad_in_place(i, p) for i, p in enumerate(b.params)):
                return False
        return True

    def _hyper(self, b: Bucket) -> dict:
        group = self.param_groups[b.group_index]
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], wd=group["weight_decay"], beta1=beta1, beta2=beta2)

    def _exchange(self, b: Bucket, spec=None):
        """Bucket b's exchange for `spec` (default: the chosen method; the warm-up's dense one is kept apart)."""
        spec = spec or self.spec
        attr = "exchange" if spec is self.spec else "warmup_exchange"
        x = getattr(b, attr, None)
        if x is None or x.group is not self.process_group:
            wire_dtype = str(self.grad_wire_dtype).removeprefix("torch.")
            if self._nodes is not None and not spec.dense:
                x = hierarchy.ShardExchange(spec, b, self._nodes, self.levels, wire_dtype, self.process_group)
            else:
                x = spec.exchange(b.n, b.g.device, self.process_group, levels=self.levels if spec is self.spec else 0,
                                  grad_wire_dtype=wire_dtype, grads=b.g)
            setattr(b, attr, x)
        return x

    def _skip(self, why: str, collectives=(), comm_s: float = 0.0, exposed: float | None = None) -> None:
        self.stats.skipped_steps += 1
        sent, recv = self._traffic(collectives)
        self.stats.record(sent, recv, len(collectives), 0.0, comm_s, 0.0, 0.0, exposed, self._node_bytes(collectives))
        if self.rank == 0:
            log.warning("LionCub: step %d skipped on all ranks (%s); %d skipped so far",
                        self._step, why, self.stats.skipped_steps)

    def _step_local(self, clock) -> None:
        t0 = clock()
        if self.skip_nonfinite and not kernels.all_finite([b.g for b in self._buckets]):
            return self._skip("non-finite gradient")
        for b in self._buckets:
            kernels.lion_step(b.p, b.g, b.m, **self._hyper(b))
        self.stats.record(0, 0, 0, 0.0, 0.0, clock() - t0, 0.0)

    def _step_dense(self, clock, done=None) -> None:
        t0 = clock()
        if done is not None:  # backward averaged the gradients
            collectives, comm, exposed = done["collectives"], done["comm_s"], done["exposed_s"]
        else:
            collectives = []
            for b in self._buckets:
                if self.world_size > 1:
                    x = self._exchange(b, self._dense_spec)
                    x()
                    collectives += x.collectives
            comm = exposed = clock() - t0
        t1 = clock()
        # the reduced gradients are identical on all ranks, so this check agrees without a message
        if self.skip_nonfinite and not kernels.all_finite([b.g for b in self._buckets]):
            return self._skip("non-finite gradient", collectives, comm, exposed)
        if self._nodes is not None:
            collectives = list(collectives) + self._lion_step_sharded()
        else:
            for b in self._buckets:
                kernels.lion_step(b.p, b.g, b.m, **self._hyper(b))
        self._momenta_identical = True  # (a dense warm-up step) every rank applied the same mean gradient
        t2 = clock()
        sent, recv = self._traffic(collectives)
        if self.dense_warmup < self._step <= self._guard_start:
            self.schedule.spend(self._credit_bytes(collectives))
        self.stats.record(sent, recv, len(collectives), 0.0, comm, t2 - t1, 0.0, exposed, self._node_bytes(collectives))

    def _lion_step_sharded(self) -> list:
        """A dense warm-up step in the hierarchical layout, on gradients averaged over every rank: each rank
        forms sign(c) of its shard with its momentum shard and the node all-gathers the signs
        (hierarchy.SignGather): bit-identical to Lion on the mean gradient."""
        for b in self._buckets:
            if getattr(b, "sign_gather", None) is None:
                b.sign_gather = hierarchy.SignGather(methods.get("vote-pbit"), b, self._nodes)
            b.sign_gather.lion_step(b, self._hyper(b))
        return [b.sign_gather.collective for b in self._buckets]

    def _step_compressed(self, clock) -> None:
        """Communicate inside step(): agree on the non-finite flag first, then per bucket quantize (with
        the momentum update fused), exchange and apply."""
        codec = self.spec.codec
        t_quant = t_comm = t_apply = 0.0
        mults, inputs, finite = [], [], []
        for b in self._buckets:
            h, x = self._hyper(b), self._exchange(b)
            t0 = clock()
            g, offsets = self._codec_input(b, x)
            t1 = clock()
            ok, mult = kernels.prepass(codec, g, b.m, beta1=h["beta1"], offsets=offsets, levels=self.levels)
            finite.append(ok)
            mults.append(mult)
            inputs.append(g)
            t_comm, t_quant = t_comm + t1 - t0, t_quant + clock() - t1
        collectives = [c for b in self._buckets for c in b.exchange.collectives if c.op == "reducescatter"]
        collectives.append(wire.CONTROL)
        t1 = clock()
        bad, _ = agree_control(_count_false(finite), None, self.process_group,
                               self._buckets[0].g.device if self._buckets else "cpu")
        bad = bad if self.skip_nonfinite else 0
        t2 = clock()
        t_comm += t2 - t1
        if bad:
            return self._skip(f"{bad} rank(s) saw a non-finite gradient", collectives, t_comm)
        codes = []
        for b, mult, g in zip(self._buckets, mults, inputs):
            h, x = self._hyper(b), b.exchange
            ta = clock()
            kernels.quantize_pack(codec, g, b.m, x.code, beta1=h["beta1"], beta2=h["beta2"],
                                  zero_parity=self._zero_parity(self._step), layout=x.layout, mult=mult,
                                  offsets=self._offsets(b), levels=self.levels)
            tb = clock()
            code = x()
            codes.append(code)
            tc = clock()
            self._apply(b, code, h)
            td = clock()
            t_quant, t_comm, t_apply = t_quant + tb - ta, t_comm + tc - tb, t_apply + td - tc
            collectives += [c for c in x.collectives if c.op != "reducescatter"]
        self._finish_compressed(clock, collectives, t_quant, t_comm, t_apply, codes=codes)

    def _codec_input(self, b: Bucket, x) -> tuple:
        """(the gradient the codec reads, its segment boundaries): the bucket's own, or in the hierarchical
        layout the node's mean of this rank's shard (a reduce-scatter inside the node)."""
        if self._nodes is None:
            return b.g, b.offsets
        return x.reduce(b.g_full), x.offsets

    def _offsets(self, b: Bucket) -> list[int]:
        return b.offsets if self._nodes is None else b.exchange.offsets

    def _zero_parity(self, step: int) -> int:
        """Which way a voter whose c is exactly 0 votes in the 1-bit codes: alternating over voters and steps
        (a voter: a rank, or in the hierarchical layout a node)."""
        return ((self.rank if self._nodes is None else self._nodes.node) + step) % 2

    def _apply(self, b: Bucket, code, h: dict, deferred: bool = False) -> None:
        """p <- p(1 - lr wd) - lr U from the agreed code (every shard's, in the hierarchical layout); with
        `deferred`, the momentum update that quantize left out (of this rank's shard)."""
        x = b.exchange
        if self._nodes is not None:
            return x.apply(self.spec.codec, b, code, h, self.levels, deferred)
        kernels.unpack_apply(self.spec.codec, b.p, code, lr=h["lr"], wd=h["wd"], world_size=self.world_size,
                             levels=self.levels, layout=x.layout, momentum=(b.g, b.m, h["beta2"]) if deferred else None)

    def _step_overlapped(self, clock, done: dict) -> None:
        """Apply what backward agreed on, with the deferred momentum update."""
        if done["bad"]:
            return self._skip(f"{done['bad']} rank(s) saw a non-finite gradient", done["collectives"],
                              done["comm_s"], done["exposed_s"])
        t0 = clock()
        for b, code in zip(self._buckets, done["codes"]):
            self._apply(b, code, self._hyper(b), deferred=True)
        self._finish_compressed(clock, list(done["collectives"]), done["quantize_s"], done["comm_s"],
                                clock() - t0, exposed=done["exposed_s"], codes=done["codes"])

    def _finish_compressed(self, clock, collectives, t_quant, t_comm, t_apply, exposed=None, codes=()) -> None:
        self._momenta_identical = False
        t_sync = 0.0
        self.stats.last_agreement = self._agreement(codes)
        if hasattr(self.schedule, "decide"):  # adaptive: a function of the agreed codes, the same on every rank
            due = self.schedule.decide(self._step, self.stats.last_agreement, self._credit_bytes(collectives),
                                       self._credit_bytes(self._sync_collectives()))
        else:
            due = self.schedule.should_sync(self._step)
        if due:
            ts = clock()
            collectives += self._sync_momentum()
            t_sync = clock() - ts
        sent, recv = self._traffic(collectives)
        self.stats.record(sent, recv, len(collectives), t_quant, t_comm, t_apply, t_sync,
                          None if exposed is None else exposed + t_sync, self._node_bytes(collectives))

    def _traffic(self, collectives) -> tuple[int, int]:
        return wire.traffic(list(collectives), self.world_size, self.node_size)

    def _node_bytes(self, collectives) -> int:
        return self._traffic([c for c in collectives if c.scope == "node"])[0]

    def _credit_bytes(self, collectives) -> int:
        """The bytes the adaptive guard's credit counts: those that leave the node (all of them in the flat
        layout). In the hierarchical layout the node's fp32 reduce-scatter would otherwise earn credit for
        momentum syncs, which cross the slow links."""
        return self._traffic(collectives)[0] - self._node_bytes(collectives)

    def _agreement(self, codes) -> float | None:
        """lioncub.optim.agreement over the agreed codes (in the hierarchical layout, of every shard: the vote of
        the N/G nodes, the padding left out)."""
        if self._nodes is None:
            return agreement.agreement(self.spec.codec, codes, [b.n for b in self._buckets], self.world_size,
                                       self.levels, [b.exchange.layout for b in self._buckets])
        pieces, sizes, layouts = zip(*[(piece, n, b.exchange.layout) for b, shards in zip(self._buckets, codes)
                                       for piece, n in b.exchange.pieces(b, shards)])
        return agreement.agreement(self.spec.codec, list(pieces), list(sizes), self._nodes.count, self.levels,
                                   list(layouts))

    # --- overlap: the communication thread's side (lioncub.optim.overlap) -------------------------------------

    @torch.no_grad()
    def _encode_and_exchange(self, k: int, state: dict) -> None:
        """Bucket k during backward: prepass, quantize without touching the momentum, exchange. Under
        lioncub.GradScaler the codec reads the unscaled gradients (a scratch copy; the scaler's unscale_
        writes the same values into .grad); after opt.clip_grad_norm_ was used, each bucket's sum of squares
        goes into the pass's control message."""
        b = self._buckets[k]
        spec = self._spec_at(state["step"])
        t0 = time.perf_counter()
        if not (self._private_grads and state["complete"][k]):  # (under DDP the hooks copied them already)
            self._collect_bucket(b)
        x = self._exchange(b, spec)
        if not spec.dense:
            if "amp" not in state:  # the pass's first bucket
                state["amp"] = self._amp_pass_scale()
                state["sumsq"] = torch.zeros((), dtype=torch.float64, device=b.g.device) if self._wants_sumsq else None
            amp = state["amp"]
            g = b.g
            if amp is not None and (self._nodes is None or state["sumsq"] is not None):
                g = torch.mul(b.g, amp["inv_scale"].to(b.g.device), out=self._scratch(b))
            if state["sumsq"] is not None:
                state["sumsq"] = state["sumsq"] + _sum_squares(g)
            if self._nodes is not None:  # the node's mean of this rank's shard, unscaled after the reduction
                tr = time.perf_counter()
                g = x.reduce(b.g_full)
                if amp is not None:
                    g.mul_(amp["inv_scale"].to(g.device))
                state["comm_s"] += time.perf_counter() - tr
                t0 += time.perf_counter() - tr
            h = self._hyper(b)
            ok, mult = kernels.prepass(spec.codec, g, b.m, beta1=h["beta1"], offsets=self._offsets(b),
                                       levels=self.levels)
            state["finite"].append(ok)
            kernels.quantize_pack(spec.codec, g, b.m, x.code, beta1=h["beta1"], beta2=h["beta2"],
                                  zero_parity=self._zero_parity(state["step"]), layout=x.layout, mult=mult,
                                  offsets=self._offsets(b), levels=self.levels, update_momentum=False)
        t1 = time.perf_counter()
        state["codes"][k] = x()
        state["quantize_s"] += t1 - t0
        state["comm_s"] += time.perf_counter() - t1
        state["collectives"] += x.collectives

    def _agree_pass(self, state: dict) -> None:
        """The end of a backward pass: agree on the non-finite count and the sum of squared gradients
        (compressed methods; one message) and note the gradients' versions, so step() can tell whether they
        changed since."""
        if not self._spec_at(state["step"]).dense:
            t0 = time.perf_counter()
            sumsq = state.get("sumsq")
            count, total = agree_control(_count_false(state["finite"]), sumsq, self.process_group,
                                         self._buckets[0].g.device)
            state["nonfinite_ranks"] = count
            state["bad"] = count if self.skip_nonfinite else 0
            state["sumsq_total"] = None if sumsq is None else total
            state["comm_s"] += time.perf_counter() - t0
            state["collectives"].append(wire.CONTROL)
        state["versions"] = [b.g._version for b in self._buckets]

    def _amp_pass_scale(self) -> dict | None:
        """The loss scale of the lioncub.GradScaler this optimizer steps with (None without one)."""
        scaler = self._grad_scaler() if self._grad_scaler is not None else None
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return None
        # the reciprocal exactly as torch's unscale_ computes it, so the values are bit for bit the same
        return dict(generation=scaler._lioncub_generation, inv_scale=scaler._scale.double().reciprocal().float())

    def _scratch(self, b: Bucket) -> torch.Tensor:
        key = (b.g.dtype, b.g.device)
        buf = self._amp_scratch.get(key)
        if buf is None or buf.numel() < b.n:
            n = max(x.n for x in self._buckets if (x.g.dtype, x.g.device) == key)
            buf = self._amp_scratch[key] = torch.empty(n, dtype=b.g.dtype, device=b.g.device)
        return buf[: b.n]

    # --- clipping -------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> float:
        """Clip the gradients by one coefficient that is the same on every rank; returns the norm it used
        (a float, the same on every rank). Call it between backward and step(), after scaler.unscale_(opt)
        under AMP.

        The norm: with the dense method (allreduce, or a dense warm-up step) that of the averaged gradient,
        ||mean_i g_i||, as DDP + torch.nn.utils.clip_grad_norm_ give (without overlap the gradients are
        averaged here instead of in step()). With a compressed method each rank keeps its own gradient, and
        the norm is the root mean square of the ranks' norms, sqrt(mean_i ||g_i||^2) (>= ||mean_i g_i||; one
        rank: torch's norm). Every rank's gradient is multiplied by min(1, max_norm / (norm + eps)); a
        non-finite norm leaves them as they are (the step will be skipped).

        Cost: with overlap the sums of squares travel in the backward pass's control message (from the
        second call on), so there is no extra collective, and the overlapped exchange stands when the
        coefficient is 1; when it is below 1, step() exchanges the clipped gradients again. Without overlap:
        one 16-byte all-reduce (compressed methods)."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        if not self._buckets:
            return 0.0
        self._wants_sumsq = True
        step = self._step + 1
        dense = self._spec_at(step).dense
        done = self._pending_pass()
        if done is None:
            if dense and self.world_size > 1:
                self._average_now()
            else:
                self._collect_grads()
        if dense or self.world_size == 1:
            norm = math.sqrt(float(_total_sum_squares(self._buckets)))
        else:
            total = None if done is None else done.get("sumsq_total")
            if total is None:
                _, total = agree_control(0, _total_sum_squares(self._buckets), self.process_group,
                                         self._buckets[0].g.device)
            norm = math.sqrt(total / self.world_size)
        coef = max_norm / (norm + eps)
        if math.isfinite(norm) and coef < 1.0:
            self._scale_grads(coef, done, dense)
        return norm

    def _scale_grads(self, factor, done: dict | None, dense: bool) -> None:
        """Multiply every gradient by `factor` (a float or a 0-dim tensor) after backward, on behalf of
        clip_grad_norm_ or the scaler: a vote the pass took on them is stale (step() takes it again, without
        the warning); gradients averaged for a dense step stay averaged."""
        averaged = dense and self._averaged_ok(self._step + 1)
        for b in self._buckets:
            b.g.mul_(factor)
        if self._private_grads:  # under DDP .grad holds the local gradient: keep it consistent
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None:
                        p.grad.mul_(factor)
        if done is not None and not dense:
            done["stale"] = True
        if averaged:
            self._averaged["versions"] = self._versions()

    # --- momentum -------------------------------------------------------------------------------------

    def _sync_collectives(self) -> list:
        """Averaging the momenta: the whole buckets', or in the hierarchical layout each rank's shard across
        the nodes."""
        scope = "world" if self._nodes is None else "cross"
        return [wire.Collective(c.op, c.nbytes, c.dtype, scope) for b in self._buckets
                for c in wire.momentum_sync_collectives(b.shard if self._nodes is not None else b.n)]

    @torch.no_grad()
    def _sync_momentum(self) -> list:
        collectives = []
        if self.world_size > 1:
            group = self.process_group if self._nodes is None else self._nodes.cross
            for b in self._buckets:
                allreduce_mean_(b.m, group, torch.float32)
            collectives = self._sync_collectives()
        self.stats.momentum_syncs += 1
        self._momenta_identical = True
        return collectives

    def sync_momentum(self) -> None:
        """Average the momenta of all ranks now (a collective: every rank must call it). Do this before
        saving a checkpoint that will be resumed with a different world size."""
        self._sync_momentum()

    # --- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["lioncub"] = dict(step=self._step, world_size=self.world_size, rank=self.rank,
                             method=self.method, levels=self.levels, dense_warmup=self.dense_warmup,
                             momenta_identical=self._momenta_identical or self.spec.dense,
                             stats=self.stats.as_dict(), node_size=self.node_size)
        if self._nodes is not None:  # this rank's momentum shard of each bucket (in no parameter's state)
            sd["lioncub"]["momentum_shards"] = [b.m for b in self._buckets]
        if hasattr(self.schedule, "state_dict"):  # an adaptive schedule's running average and byte credit
            sd["lioncub"]["schedule"] = self.schedule.state_dict()
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("lioncub", None) or {}
        saved_n = extra.get("world_size", self.world_size)
        shards = extra.get("momentum_shards")
        if (shards is not None or self._nodes is not None) and (
                extra.get("node_size", 1) != self.node_size or saved_n != self.world_size
                or (shards is not None and [s.numel() for s in shards] != [b.shard for b in self._buckets])):
            raise ValueError(
                f"this checkpoint was saved with {saved_n} ranks in nodes of {extra.get('node_size', 1)}; this "
                f"optimizer has {self.world_size} in nodes of {self.node_size}: a hierarchical optimizer keeps "
                f"momentum shards, so resume it on the same layout (same world size, node size and buckets)")
        if shards is not None and extra.get("rank", self.rank) != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {extra['rank']}'s hierarchical checkpoint: each rank "
                             f"holds its own momentum shards and must load its own state_dict")
        if saved_n != self.world_size and not extra.get("momenta_identical", False):
            raise ValueError(
                f"this checkpoint was saved by {saved_n} ranks, each with its own momentum, and cannot be "
                f"resumed on {self.world_size} ranks. Call opt.sync_momentum() (on every rank) right before "
                f"saving, or save after a step that synced momenta, so the momenta are identical.")
        if extra.get("method", self.method) != self.method:
            log.warning("LionCub: resuming a %s checkpoint with method=%s", extra["method"], self.method)
        if extra.get("dense_warmup", self.dense_warmup) != self.dense_warmup:
            log.warning("LionCub: the checkpoint was saved with dense_warmup=%d, this optimizer has %d (it applies: "
                        "steps up to %d run dense)", extra["dense_warmup"], self.dense_warmup, self.dense_warmup)
        views = {p: self.state[p]["exp_avg"] for b in self._buckets for p in b.params if "exp_avg" in self.state[p]}
        super().load_state_dict(state_dict)
        for p, view in views.items():
            loaded = self.state[p].get("exp_avg")
            if loaded is not None and loaded is not view:
                view.copy_(loaded.reshape(view.shape))
            self.state[p]["exp_avg"] = view
        for b, shard in zip(self._buckets, shards or ()):
            b.m.copy_(shard)
        self._step = extra.get("step", 0)
        self._momenta_identical = bool(extra.get("momenta_identical", True))
        if "stats" in extra:
            self.stats = CommStats(**extra["stats"])
        if "schedule" in extra and hasattr(self.schedule, "load_state_dict"):
            self.schedule.load_state_dict(extra["schedule"])

    def __repr__(self) -> str:
        n = sum(b.n for b in self._buckets)
        layout = f", nodes={self._nodes.count}x{self.node_size}" if self._nodes is not None else ""
        return (f"LionCub(method={self.method!r}, world_size={self.world_size}{layout}, params={n}, "
                f"buckets={len(self._buckets)}, levels={self.levels or None}, schedule={self.schedule})")


def _count_false(flags: list):
    """How many of the prepass's finite flags (0-dim bool tensors) are false, as a 0-dim tensor: nothing
    waits for the device until the control message is read."""
    return torch.stack(flags).logical_not().sum() if flags else 0


def _sum_squares(g: torch.Tensor) -> torch.Tensor:
    """A bucket's sum of squares as a 0-dim float64 tensor (its fp32 norm, squared in fp64)."""
    return torch.linalg.vector_norm(g, dtype=torch.float32).double().square()


def _total_sum_squares(buckets) -> torch.Tensor:
    """The sum over buckets, in bucket order: the same arithmetic as a backward pass's running sum."""
    total = torch.zeros((), dtype=torch.float64, device=buckets[0].g.device if buckets else "cpu")
    for b in buckets:
        total = total + _sum_squares(b.g).to(total.device)
    return total


def lion_step(p, g, m, *, lr: float, wd: float = 0.0, beta1: float = 0.9, beta2: float = 0.99) -> None:
    """Functional single-process Lion on flat tensors (dispatches to the Triton or torch kernel)."""
    kernels.lion_step(p, g, m, lr=lr, wd=wd, beta1=beta1, beta2=beta2)
