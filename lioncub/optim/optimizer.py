"""LionCub: Lion whose data-parallel ranks agree on a compressed update.

Do not wrap the model in DDP: the optimizer does all communication itself, for every method including
the `allreduce` baseline, so switching methods changes one argument. Call `broadcast_parameters(model)`
once so every rank starts from the same weights. By default each bucket's exchange runs during backward,
as soon as its gradients are final (lioncub.optim.overlap); `step()` applies the agreed update.

This class is the torch.optim face of the engine (lioncub.optim.engine): arguments, param groups and
state, step(), zero_grad(), no_sync(), clipping, momentum sync and checkpoints. Use `opt.zero_grad()`: it
zeroes the flat gradient buffers and keeps each .grad a view into them (lioncub.optim.buckets).
"""

from __future__ import annotations

import contextlib
import logging
import numbers

import torch
from torch.distributed.tensor import DTensor

from lioncub import kernels, methods
from lioncub.comm import stagger
from lioncub.comm.transport import record_call_times
from lioncub.optim import clip, local, resume, steps
from lioncub.optim.buckets import DTYPES
from lioncub.optim.engine import Engine
from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")
WIRE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _wire_dtype(value) -> torch.dtype:
    """torch.float32 / torch.bfloat16, or their names (so JSON configs can carry it)."""
    return WIRE_DTYPES.get(value.removeprefix("torch."), value) if isinstance(value, str) else value


def _validate_hyper(lr, betas, weight_decay):
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}; Lion's defaults are (0.9, 0.99)")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _validate(lr, betas, weight_decay, bucket_mb, grad_wire_dtype, dense_warmup):
    _validate_hyper(lr, betas, weight_decay)
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0 (or None for lioncub.comm.wire.auto_bucket_mb), got {bucket_mb}")
    if grad_wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_wire_dtype must be torch.float32 or torch.bfloat16, got {grad_wire_dtype}")
    if isinstance(dense_warmup, bool) or not isinstance(dense_warmup, numbers.Integral) or dense_warmup < 0:
        raise ValueError(f"dense_warmup must be an int >= 0 (steps), got {dense_warmup!r}")


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
        bucket_mb: parameters are flattened into buckets of about this many MiB; one set of collectives
            per bucket. None (default): about 8 buckets of 1-25 MiB (lioncub.comm.wire.auto_bucket_mb) for the
            overlap; a step that communicates in step() (overlap=False, or gradients set without a backward)
            exchanges adjacent ones as one, up to 64 MiB (lioncub.optim.runs: the same result; the dense
            method's sums to rounding).
        grad_wire_dtype: the baseline's all-reduce dtype (torch.float32 or torch.bfloat16, or "bfloat16").
        skip_nonfinite: if any rank sees a non-finite gradient, all ranks skip the step (counted in
            stats.skipped_steps). Where no overlapped exchange reads the gradients, backward's hooks take the
            check (lioncub.optim.finite) and step() does not read them again unless they changed since.
        overlap: run each bucket's exchange during backward, as soon as its gradients are final (default);
            False communicates inside step(). The results are bit-identical either way.
        timing: synchronise CUDA around each phase so stats times are exact (costs a little speed), and time
            every collective by name (lioncub.comm.transport.call_times()).
        dense_warmup: run the first K steps with the `allreduce` method (averaged gradients, one momentum
            on every rank), then `method`; the step count is in state_dict, so a resume switches on time.
        hierarchical, node_size: the node layout (lioncub.optim.nodes): average inside nodes of node_size
            ranks (default: torchrun's LOCAL_WORLD_SIZE), vote across nodes, momenta sharded in the node.
        local_steps: H: every rank takes H local Lion steps, then the ranks agree on an outer update of their
            pseudo-gradients through `method`'s codec ("allreduce": DiLoCo's fp32 average), with error
            feedback (lioncub.optim.local). None (default): agree at every step.
        outer: the outer optimizer with local_steps, "kind[:LR[:MU]]": "avg" (default, 1:0: the agreed
            update as it is), "nesterov" (DiLoCo's, 0.7:0.9) or "sign" (0.5:0.9) (lioncub.optim.outer).
        error_feedback: with local_steps and a compressed method, keep what compression dropped (default True).
        fragments, outer_delay: with local_steps, stream the outer steps (lioncub.optim.streaming): the buckets in
            F fragments whose outer exchanges are staggered over the H steps and run on a communication thread
            during the next D inner steps (default D: 1; 0 with F = 1, the unstreamed outer step, or F = H).

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
                 dense_warmup: int = 0, hierarchical: bool = False, node_size: int | None = None,
                 local_steps: int | None = None, outer=None, error_feedback: bool = True, fragments: int | None = None,
                 outer_delay: int | None = None):
        grad_wire_dtype = _wire_dtype(grad_wire_dtype)
        spec = methods.get(method)
        _validate(lr, betas, weight_decay, bucket_mb, grad_wire_dtype, dense_warmup)
        self._engine = self._local = None  # (built once torch.optim has the param groups)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        self._local_args = local.check_options(local_steps, outer, dense_warmup=dense_warmup,
                                               momentum_sync=momentum_sync, sharded=sharded) + (bool(error_feedback),)
        self._streamed = stagger.check_options(fragments, outer_delay, local_steps)
        overlap = overlap and local_steps is None  # local steps communicate in step() only
        if spec.dense and momentum_sync is not None:
            log.warning("LionCub: momentum_sync has no effect with method=%r (momenta are global)", spec.name)
        self.grad_wire_dtype, self.timing, self.hierarchical = grad_wire_dtype, timing, bool(hierarchical)
        self._engine_args = dict(method=spec, levels=levels, momentum_sync=momentum_sync,
                                 process_group=process_group, bucket_mb=bucket_mb, grad_wire_dtype=grad_wire_dtype,
                                 skip_nonfinite=skip_nonfinite, overlap=overlap, dense_warmup=int(dense_warmup),
                                 hierarchical=hierarchical, node_size=node_size)
        if sharded:
            if hierarchical:
                raise ValueError("hierarchical=True is the layout of an unsharded model; a model sharded by FSDP2 gets "
                                 "the same arithmetic from lioncub.attach_fsdp(model, opt, mesh)")
            return  # sharded parameters: the engine comes with lioncub.attach_fsdp
        self._build()

    def _build(self, sharding=None) -> None:
        self._engine = Engine(self.param_groups, self.state, sharding=sharding, **self._engine_args)
        H, outer, error_feedback = self._local_args
        if H is not None:
            self._local = local.LocalSteps(self._engine, H, outer, error_feedback, self._streamed)
        if self.timing:  # (from the first step on: the set-up's collectives are not the step's)
            record_call_times(True)

    @property
    def engine(self) -> Engine:
        """The engine (lioncub.optim.engine): what amp, ddp, the overlap and the integrations drive."""
        if self._engine is None:
            raise RuntimeError("LionCub: these parameters are sharded by FSDP2 (DTensors): call "
                               "lioncub.attach_fsdp(model, opt, mesh) before training (README: Sharded models)")
        return self._engine

    def use_sharding(self, sharding) -> None:
        """Train FSDP2's shards (lioncub.attach_fsdp calls it): one bucket per unit, momenta sharded as the
        parameters are (lioncub.optim.sharded). Once, before the first step."""
        if self._engine is not None:
            raise ValueError("lioncub.attach_fsdp: this LionCub is built already (attach it once, before training; "
                             "build it on the FSDP model's parameters)")
        self._build(sharding)

    # --- what it is (read-only; the engine holds them) ---------------------------------------------------

    spec = property(lambda self: self._engine_args["method"], doc="the method (lioncub.methods.Method)")
    method = property(lambda self: self._engine_args["method"].name)
    levels = property(lambda self: self.engine.levels)
    schedule = property(lambda self: self.engine.schedule)
    dense_warmup = property(lambda self: self.engine.phase.dense_warmup)
    process_group = property(lambda self: self.engine.group)
    rank = property(lambda self: self.engine.rank)
    world_size = property(lambda self: self.engine.world_size)
    node_size = property(lambda self: self.engine.layout.node_size)
    bucket_mb = property(lambda self: self.engine.bucket_mb)
    skip_nonfinite = property(lambda self: self.engine.skip_nonfinite)
    local_steps = property(lambda self: self._local_args[0], doc="H with local steps, else None")
    local = property(lambda self: self._local, doc="the local-step driver (lioncub.optim.local), or None")

    @property
    def stats(self) -> CommStats:
        """Alone on a GPU a skipped step counts once its device flag is back (lioncub.optim.skips): at the next
        step, or here after the device was synchronised."""
        steps.settle(self.engine)
        return self.engine.stats

    @stats.setter
    def stats(self, value: CommStats) -> None:
        self.engine.stats = value

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group. After construction it is a collective in effect: every rank must add
        the same group at the same step (as it built the optimizer), with parameters that are identical on
        every rank (broadcast_parameters); they get buckets of their own and train from the next step."""
        if isinstance(param_group, dict):
            group = {**self.defaults, **param_group}
            _validate_hyper(group["lr"], group["betas"], group["weight_decay"])
            params = group.get("params")
            param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params or ())
            for p in params:
                if isinstance(p, torch.Tensor) and p.requires_grad and p.dtype not in DTYPES:
                    raise ValueError(f"LionCub supports fp32, bf16 and fp16 parameters, not {p.dtype}")
        if getattr(self, "_local", None) is not None:
            raise ValueError("LionCub with local_steps cannot add param groups after construction yet")
        super().add_param_group(param_group)
        if self._engine is not None:
            self._engine.add_group(len(self.param_groups) - 1, self.state)

    # --- the loop ---------------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers, keeping each .grad a view into them (no copy on the next step).
        With set_to_none (torch's default) a parameter whose gradient backward then leaves unwritten counts as
        one whose .grad is None: if no rank gave it a gradient, step() leaves it and its momentum untouched, as
        torch optimizers do (a parameter used on some ranks gets a zero gradient on the others, as under DDP).
        Under DDP (lioncub.attach_ddp) .grad belongs to DDP and is zeroed or set to None as torch does."""
        if self.engine.buckets.private:
            super().zero_grad(set_to_none)
        self.engine.buckets.zero(set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating, as DDP's `no_sync()`: a backward inside the block
        starts no exchange; the first backward after it does (with the accumulated gradients)."""
        overlap = self.engine.overlap
        if overlap is None:
            yield
            return
        enabled, overlap.enabled = overlap.enabled, False
        try:
            yield
        finally:
            overlap.enabled = enabled

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
        if self._local is not None:
            self._local.step(self.timing)
        else:
            steps.take(self.engine, self.timing)
        return loss

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> float:
        """Clip the gradients by one coefficient that is the same on every rank; returns the norm it used
        (a float, the same on every rank). Call it between backward and step(), after scaler.unscale_(opt)
        under AMP.

        The norm: with the dense method (allreduce, or a dense warm-up step) that of the averaged gradient,
        ||mean_i g_i||, as DDP + torch.nn.utils.clip_grad_norm_ give (without overlap the gradients are
        averaged here instead of in step()). With a compressed method each rank keeps its own gradient, and
        the norm is the root mean square of the ranks' norms, sqrt(mean_i ||g_i||^2) (>= ||mean_i g_i||; one
        rank: torch's norm). Over an FSDP model (lioncub.attach_fsdp) each rank holds a shard of its node's
        mean gradient, and the norm is the root mean square over nodes of the node means' norms (dense: the
        norm of the mean). Every rank's gradient is multiplied by min(1, max_norm / (norm + eps)); a
        non-finite norm leaves them as they are (the step will be skipped).

        Cost: with overlap the sums of squares travel in the backward pass's control message (from the
        second call on), so there is no extra collective, and the overlapped exchange stands when the
        coefficient is 1; when it is below 1, step() exchanges the clipped gradients again. Without overlap:
        one 16-byte all-reduce (compressed methods)."""
        return clip.clip_grad_norm_(self.engine, max_norm, eps)

    def sync_momentum(self) -> None:
        """Average the momenta of all ranks now (a collective: every rank must call it). Do this before
        saving a checkpoint that will be resumed with a different world size."""
        self.engine.sync_momentum()

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["lioncub"] = resume.extras(self.engine)
        if self._local is not None:
            sd["lioncub"]["local"] = self._local.state_dict()
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("lioncub", None) or {}
        resume.check(self.engine, extra)
        views = {p: self.state[p]["exp_avg"] for b in self.engine.buckets for p in b.params
                 if "exp_avg" in self.state[p]}
        super().load_state_dict(state_dict)
        self.engine.buckets.param_groups = self.param_groups  # (torch replaced the list)
        for p, view in views.items():  # the momenta stay views of the buckets
            loaded = self.state[p].get("exp_avg")
            if loaded is not None and loaded is not view:
                view.copy_(loaded.reshape(view.shape))
            self.state[p]["exp_avg"] = view
        resume.restore(self.engine, extra)
        if self._local is not None:
            if "local" not in extra:
                raise ValueError("this checkpoint was saved without local_steps; this optimizer has local_steps="
                                 f"{self.local_steps}: resume with the same options")
            self._local.load_state_dict(extra["local"])

    def __repr__(self) -> str:
        e = self.engine
        return (f"LionCub(method={self.method!r}, world_size={self.world_size}{e.layout.describe()}, "
                f"params={sum(b.n for b in e.buckets)}, buckets={len(e.buckets)}, levels={self.levels or None}, "
                f"schedule={self.schedule})")


def lion_step(p, g, m, *, lr: float, wd: float = 0.0, beta1: float = 0.9, beta2: float = 0.99) -> None:
    """Functional single-process Lion on flat tensors (dispatches to the Triton or torch kernel)."""
    kernels.lion_step(p, g, m, lr=lr, wd=wd, beta1=beta1, beta2=beta2)
