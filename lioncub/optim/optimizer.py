"""LionCub: Lion whose data-parallel ranks agree on a compressed update.

Do not wrap the model in DDP: the optimizer does all communication itself, for every method including
the `allreduce` baseline, so switching methods changes one argument. Call `broadcast_parameters(model)`
once so every rank starts from the same weights (the first step checks it: LionCub's docstring). By default
each bucket's exchange runs during backward, as soon as its gradients are final (lioncub.optim.backward);
`step()` applies the agreed update.

This class is the torch.optim face of the engine (lioncub.optim.engine): arguments, param groups and
state, step(), zero_grad(), no_sync(), clipping, momentum sync and checkpoints. Use `opt.zero_grad()`: it
zeroes the flat gradient buffers and keeps each .grad a view into them (lioncub.optim.buckets).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import warnings

import torch
from torch.distributed.tensor import DTensor

from lioncub import kernels, methods
from lioncub.comm.transport import agree_control, record_call_times
from lioncub.optim.buckets import DTYPES
from lioncub.optim.engine import Engine, total_sum_squares
from lioncub.optim.layout import LOCAL
from lioncub.optim.local import LocalStepDriver, LocalSteps
from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")
WIRE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# the keywords LionCub took before its options were grouped (issue 49), and what replaces each
RENAMED = {
    "local_steps": "local=LocalSteps(H)",
    "outer": "local=LocalSteps(H, outer=...)",
    "error_feedback": "local=LocalSteps(H, error_feedback=...)",
    "fragments": "local=LocalSteps(H, fragments=F)",
    "outer_delay": "local=LocalSteps(H, fragments=F, delay=D)",
    "hierarchical": f"node_size=G alone (node_size={LOCAL!r}: torchrun's LOCAL_WORLD_SIZE)",
    "timing": "opt.timing = True after construction",
}


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


def _validate_local(local, *, dense_warmup, momentum_sync, sharded: bool) -> None:
    if local is None:
        return
    if not isinstance(local, LocalSteps):
        raise ValueError(f"local must be a lioncub.LocalSteps (or None), got {local!r}")
    if dense_warmup:
        raise ValueError("local steps do not combine with dense_warmup yet")
    if momentum_sync is not None:
        raise ValueError("local steps do not combine with momentum_sync (the inner momenta stay each rank's own)")
    if sharded:
        raise ValueError("local steps with FSDP2-sharded parameters are not supported yet")


def _old_spellings(old: dict, node_size, local) -> tuple:
    """(node_size, local, timing) from the keywords LionCub took before (RENAMED), each with a DeprecationWarning
    that names its new spelling; a keyword LionCub never took raises TypeError, as Python would."""
    for name in old:
        if name not in RENAMED:
            raise TypeError(f"LionCub.__init__() got an unexpected keyword argument {name!r}")
        warnings.warn(f"LionCub({name}=...) is deprecated: use {RENAMED[name]}", DeprecationWarning, stacklevel=3)
    if "hierarchical" in old:
        if old["hierarchical"] and node_size is None:
            node_size = LOCAL
        elif not old["hierarchical"] and node_size is not None:
            raise ValueError("node_size applies only with hierarchical=True (drop hierarchical=: node_size=G alone "
                             "selects the node layout)")
    given = {k: old[k] for k in ("local_steps", "outer", "fragments", "outer_delay", "error_feedback") if k in old}
    if given and local is not None:
        raise TypeError("LionCub: give local steps as local=LocalSteps(...), not with the deprecated keywords too")
    if given.get("outer_delay") is not None and given.get("fragments") is None:
        raise ValueError("outer_delay applies only with fragments=F (now local=LocalSteps(H, fragments=F, delay=D))")
    if given.get("local_steps") is None:
        for name in ("outer", "fragments"):
            if given.get(name) is not None:
                raise ValueError(f"{name} applies only with local_steps=H (now local=LocalSteps(H, {name}=...))")
    else:
        local = LocalSteps(given["local_steps"], outer="avg" if given.get("outer") is None else given["outer"],
                           fragments=given.get("fragments"), delay=given.get("outer_delay"),
                           error_feedback=bool(given.get("error_feedback", True)))
    return node_size, local, bool(old.get("timing", False))


class LionCub(torch.optim.Optimizer):
    """Lion with compressed data-parallel agreement: p <- p*(1 - lr*wd) - lr*U, where U is what the ranks agree
    on from their sign(b1*m + (1-b1)*g) (a vote, an average of signs, or of L1 levels: `method`).

    Call `opt.clip_grad_norm_(max_norm)` (not torch.nn.utils.clip_grad_norm_) between backward and step to clip,
    and use `lioncub.GradScaler` for fp16 loss scaling: both agree across ranks. Set `opt.timing = True` to time
    every phase exactly (`timing`).

    Replicas start equal, as DDP guarantees: before a run's first update (its first step(), also with local
    steps and under lioncub.attach_ddp) the ranks compare their parameters in one 16-byte all-reduce of a
    fingerprint of their bytes (lioncub.optim.layout.bytes_fingerprint: any one differing word is seen). If
    they differ, every rank takes rank 0's (a broadcast per bucket) and rank 0 warns once: call
    `lioncub.broadcast_parameters(model)` after building the model, which covers buffers too. Not checked:
    buffers, parameters the optimizer does not train, FSDP2's shards (lioncub.attach_fsdp), one process, a
    resumed run (from a checkpoint's step on).

    Args:
        params: parameters or param groups (lr, betas, weight_decay may differ per group).
        lr: the learning rate, as in Lion.
        betas: (b1, b2), as in Lion: the update's interpolation and the momentum's decay.
        weight_decay: decoupled weight decay, as in Lion.
        method: a name from lioncub.methods.NAMES: "allreduce" (average gradients, plain Lion: the
            baseline), "vote-allgather", "vote-1bit", "vote-pbit", "avg-pbit" or "l1-pbit" (docs: methods).
        levels: L1 levels s for "l1-pbit" (default max(1, 127 // world_size)).
        momentum_sync: None, an int K (average momenta every K steps), a schedule (lioncub.EveryK,
            FirstSteps, Geometric, Adaptive) or its text ("every:K", "adaptive", ...: lioncub.optim.schedules.parse).
            "adaptive" is the guard: a dense start until the momentum leads (12 steps for Lion's betas),
            then momentum syncs where the ranks agree little, within the method's bytes again.
        process_group: the data-parallel group (default: the world, or none if not initialised).
        bucket_mb: parameters are flattened into buckets of about this many MiB; one set of collectives
            per bucket. None (default): about 8 buckets of 1-25 MiB (lioncub.comm.wire.auto_bucket_mb) for the
            overlap; a step that communicates in step() (overlap=False, or gradients set without a backward)
            exchanges adjacent ones as one, up to 64 MiB (lioncub.optim.buckets.Run: the same result; the dense
            method's sums to rounding).
        grad_wire_dtype: the baseline's all-reduce dtype (torch.float32 or torch.bfloat16, or "bfloat16").
        skip_nonfinite: if any rank sees a non-finite gradient, all ranks skip the step (counted in
            stats.skipped_steps). Where no overlapped exchange reads the gradients, backward's hooks take the
            check (lioncub.optim.backward.BackwardCheck) and step() does not read them again unless they changed.
        overlap: run each bucket's exchange during backward, as soon as its gradients are final (default);
            False communicates inside step(). The results are bit-identical either way.
        dense_warmup: run the first K steps with the `allreduce` method (averaged gradients, one momentum
            on every rank), then `method`; the step count is in state_dict, so a resume switches on time.
        node_size: None (default): the flat layout, every rank votes. G: the node layout (lioncub.optim.layout):
            average inside nodes of G ranks, vote across nodes, momenta sharded in the node. "local": G is
            torchrun's LOCAL_WORLD_SIZE.
        local: a lioncub.LocalSteps: every rank takes H local Lion steps, then the ranks agree on an outer update
            of their pseudo-gradients through `method`'s codec ("allreduce": DiLoCo's fp32 average), with error
            feedback (lioncub.optim.local). None (default): agree at every step.
        **deprecated: the keywords of earlier versions (local_steps, outer, error_feedback, fragments,
            outer_delay, hierarchical, timing), each with a DeprecationWarning that names its new spelling.

    Example:
        >>> import torch, lioncub
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = lioncub.LionCub(model.parameters(), lr=3e-4, weight_decay=0.1, method="vote-1bit")
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.zero_grad()

        On several ranks (torchrun), with nodes of 8 ranks and local steps:

            opt = lioncub.LionCub(model.parameters(), lr=3e-4, method="vote-1bit", node_size=8,
                                  local=lioncub.LocalSteps(25, outer="nesterov"))
    """

    # torch.amp.GradScaler then calls step() on every rank, which refuses it (see step): its per-rank
    # inf/NaN check would make ranks disagree; lioncub.GradScaler agrees it
    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 method: str = methods.DEFAULT, levels: int | None = None, momentum_sync=None,
                 process_group=None, bucket_mb: float | None = None, grad_wire_dtype=torch.float32,
                 skip_nonfinite: bool = True, overlap: bool = True, dense_warmup: int = 0,
                 node_size: int | str | None = None, local: LocalSteps | None = None, **deprecated):
        node_size, local, timing = _old_spellings(deprecated, node_size, local)
        grad_wire_dtype = _wire_dtype(grad_wire_dtype)
        spec = methods.get(method)
        _validate(lr, betas, weight_decay, bucket_mb, grad_wire_dtype, dense_warmup)
        self._engine = self._local = None  # (built once torch.optim has the param groups)
        self._timing = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        _validate_local(local, dense_warmup=dense_warmup, momentum_sync=momentum_sync, sharded=sharded)
        self._local_options = local
        overlap = overlap and local is None  # local steps communicate in step() only
        if spec.dense and momentum_sync is not None:
            log.warning("LionCub: momentum_sync has no effect with method=%r (momenta are global)", spec.name)
        self.grad_wire_dtype = grad_wire_dtype
        self._engine_args = dict(method=spec, levels=levels, momentum_sync=momentum_sync,
                                 process_group=process_group, bucket_mb=bucket_mb, grad_wire_dtype=grad_wire_dtype,
                                 skip_nonfinite=skip_nonfinite, overlap=overlap, dense_warmup=int(dense_warmup),
                                 node_size=node_size)
        if sharded and node_size is not None:
            raise ValueError("node_size= (the node layout) is the layout of an unsharded model; a model sharded by "
                             "FSDP2 gets the same arithmetic from lioncub.attach_fsdp(model, opt, mesh)")
        if not sharded:  # sharded parameters: the engine comes with lioncub.attach_fsdp
            self._build()
        self.timing = timing

    def _build(self, sharding=None) -> None:
        self._engine = Engine(self.param_groups, self.state, sharding=sharding, **self._engine_args)
        if self._local_options is not None:
            self._local = LocalStepDriver(self._engine, self._local_options)
        if self._timing:  # (from the first step on: the set-up's collectives are not the step's)
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

    @property
    def timing(self) -> bool:
        """Whether each phase is timed exactly: CUDA synchronised around it (costs a little speed), and every
        collective timed by name (lioncub.comm.transport.call_times(), for the whole process from then on).
        `opt.stats.versus` needs it. Set it (`opt.timing = True`) before the steps to time."""
        return self._timing

    @timing.setter
    def timing(self, on: bool) -> None:
        self._timing = bool(on)
        if self._timing and self._engine is not None:
            record_call_times(True)

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
    local_steps = property(lambda self: None if self._local_options is None else int(self._local_options.every),
                           doc="H with local steps, else None")
    local = property(lambda self: self._local, doc="the local-step driver (lioncub.optim.local.LocalStepDriver), "
                                                     "or None")

    @property
    def stats(self) -> CommStats:
        """Alone on a GPU a skipped step counts once its device flag is back (lioncub.optim.engine.DeviceSkips): at
        the next step, or here after the device was synchronised."""
        self.engine.count_device_skips()
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
            raise ValueError("LionCub with local steps cannot add param groups after construction yet")
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
            self.engine.step(self.timing)
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6, exact: bool = False) -> float:
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

        Overlap: the sums of squares travel in the backward pass's control message (from the second call on),
        so there is no extra collective, and the overlapped exchange stands: a dense step clips the mean exactly;
        a compressed step's vote, formed during backward before the norm is known, read the previous step's
        coefficient s' (c = b1*m + (1-b1)*s'*g; s' = 1 after a step that did not clip), while the momentum
        update, the norm and the gradients left in .grad take this step's coefficient s. The vote is exact
        where s = s' (no clipping, or step 1, whose momentum is zero) and otherwise weighs g against m by
        s'/s. `exact=True` keeps the exact clip: where s or s' is below 1 step() exchanges the clipped
        gradients again, outside the overlap (research/notebook/results/clip-overlap measures both).
        Without overlap (overlap=False, local steps) the clip is exact at no extra exchange, for one 16-byte
        all-reduce (compressed methods)."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        engine = self.engine
        buckets = engine.buckets
        if not buckets:
            return 0.0
        engine.wants_sumsq = True
        dense = engine.next_method().dense
        done = engine.pending_pass()
        if done is None:
            if dense and engine.world_size > 1:
                engine.average_now()
                done = engine.pending_pass()
            else:
                buckets.collect()
        copies = engine.layout.norm_copies(dense)
        if copies is None:
            norm = math.sqrt(float(total_sum_squares(buckets)))
        else:
            total = None if done is None or dense else done.sumsq_total  # (a dense pass's sums precede its mean)
            if total is None:
                _, total, _ = agree_control(0, total_sum_squares(buckets), engine.layout.group, buckets.device)
            norm = math.sqrt(total / copies)
        coef = max_norm / (norm + eps)
        coef = coef if math.isfinite(norm) and coef < 1.0 else 1.0
        if coef < 1.0:
            if engine.backward_check is not None:
                engine.backward_check.scale(buckets, coef)
            else:
                buckets.scale_(coef)
        engine.clipped(done, coef, exact)
        return norm

    def sync_momentum(self) -> None:
        """Average the momenta of all ranks now (a collective: every rank must call it). Do this before
        saving a checkpoint that will be resumed with a different world size."""
        self.engine.sync_momentum()

    # --- checkpoints: torch.optim's state, and beside it (state_dict()["lioncub"]) what a resume needs -----

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["lioncub"] = self._extras()
        if self._local is not None:
            sd["lioncub"]["local"] = self._local.state_dict()
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("lioncub", None) or {}
        self._check_resume(extra)
        views = {p: self.state[p]["exp_avg"] for b in self.engine.buckets for p in b.params
                 if "exp_avg" in self.state[p]}
        super().load_state_dict(state_dict)
        self.engine.buckets.param_groups = self.param_groups  # (torch replaced the list)
        for p, view in views.items():  # the momenta stay views of the buckets
            loaded = self.state[p].get("exp_avg")
            if loaded is not None and loaded is not view:
                view.copy_(loaded.reshape(view.shape))
            self.state[p]["exp_avg"] = view
        self._restore(extra)
        if self._local is not None:
            if "local" not in extra:
                raise ValueError("this checkpoint was saved without local_steps; this optimizer has local_steps="
                                 f"{self.local_steps}: resume with the same options")
            self._local.load_state_dict(extra["local"])

    def _extras(self) -> dict:
        engine = self.engine
        extra = dict(step=engine.steps, world_size=engine.world_size, rank=engine.rank, method=engine.spec.name,
                     levels=engine.levels, dense_warmup=engine.phase.dense_warmup,
                     momenta_identical=engine.momenta_identical or engine.spec.dense, stats=engine.stats.as_dict(),
                     node_size=engine.layout.node_size)
        shards = engine.layout.momentum_shards(engine.buckets)
        if shards is not None:
            extra["momentum_shards"] = shards
        schedule = engine.schedule.state_dict()  # an adaptive schedule's running average and byte credit
        if schedule is not None:
            extra["schedule"] = schedule
        return extra

    def _check_resume(self, extra: dict) -> None:
        """Raise if the checkpoint whose extras are `extra` cannot resume here; warn where it resumes otherwise
        than it ran."""
        engine = self.engine
        saved_n = extra.get("world_size", engine.world_size)
        engine.layout.check_resume(extra, extra.get("momentum_shards"), engine.buckets)
        if saved_n != engine.world_size and not extra.get("momenta_identical", False):
            raise ValueError(
                f"this checkpoint was saved by {saved_n} ranks, each with its own momentum, and cannot be "
                f"resumed on {engine.world_size} ranks. Call opt.sync_momentum() (on every rank) right before "
                f"saving, or save after a step that synced momenta, so the momenta are identical.")
        if extra.get("method", engine.spec.name) != engine.spec.name:
            log.warning("LionCub: resuming a %s checkpoint with method=%s", extra["method"], engine.spec.name)
        warmup = engine.phase.dense_warmup
        if extra.get("dense_warmup", warmup) != warmup:
            log.warning("LionCub: the checkpoint was saved with dense_warmup=%d, this optimizer has %d (it applies: "
                        "steps up to %d run dense)", extra["dense_warmup"], warmup, warmup)

    def _restore(self, extra: dict) -> None:
        """After torch.optim's state was loaded (and the momentum views restored): the rest of `extra`."""
        engine = self.engine
        for b, shard in zip(engine.buckets, extra.get("momentum_shards") or ()):
            b.m.copy_(shard)
        engine.steps = extra.get("step", 0)
        engine.momenta_identical = bool(extra.get("momenta_identical", True))
        if "stats" in extra:
            engine.stats = CommStats(**extra["stats"])
        if "schedule" in extra:
            engine.schedule.load_state_dict(extra["schedule"])

    def __repr__(self) -> str:
        e = self.engine
        return (f"LionCub(method={self.method!r}, world_size={self.world_size}{e.layout.describe()}, "
                f"params={sum(b.n for b in e.buckets)}, buckets={len(e.buckets)}, levels={self.levels or None}, "
                f"schedule={self.schedule})")



def lion_step(p, g, m, *, lr: float, wd: float = 0.0, beta1: float = 0.9, beta2: float = 0.99) -> None:
    """Functional single-process Lion on flat tensors (dispatches to the Triton or torch kernel)."""
    kernels.lion_step(p, g, m, lr=lr, wd=wd, beta1=beta1, beta2=beta2)
