"""lioncub.GradScaler: fp16 loss scaling whose inf/NaN check every rank agrees on.

torch.amp.GradScaler checks the gradients of its own rank. Under DDP that is enough (the gradients are
averaged before the check, so an overflow anywhere is an overflow everywhere), but LionCub's compressed
methods keep each rank's gradient local: one rank whose gradients overflow would skip `opt.step()` while
the others enter its collectives (a hang), and its scale would back off alone. This subclass takes the
same arguments (plus `process_group`) and agrees the check across ranks, so every rank skips the same
steps and updates its scale identically:

    scaler = lioncub.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                # optional: only to clip
    opt.clip_grad_norm_(1.0)
    scaler.step(opt)
    scaler.update()

How the check is agreed, for a LionCub optimizer:
  * dense steps (method="allreduce", a dense warm-up): the gradients are averaged before they are checked
    (during backward with overlap, or right here without), so the check is the same on every rank;
  * compressed steps with overlap: from the second step on, the backward pass divides the scale out of
    each bucket before the codec reads it, and its control message already carries the non-finite count
    of every rank: no extra collective, and the overlapped exchange stands;
  * otherwise: one 4-byte MAX all-reduce in unscale_ (for any other optimizer: over `process_group`).
LionCub refuses a plain torch.amp.GradScaler with a clear error (it declares `_step_supports_amp_scaling`,
so torch's scaler calls its step() on every rank, never only on some).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from lioncub import kernels
from lioncub.comm.transport import call


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler for data-parallel ranks that do not average their gradients (see the module
    docstring). `process_group`: the group to agree over for optimizers other than LionCub (LionCub uses
    its own)."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self._lioncub_generation = 0  # bumped whenever the scale may change: a backward pass notes it

    def unscale_(self, optimizer) -> None:
        if not self._enabled:
            return
        opt = _lioncub(optimizer)
        before = _before_unscale(opt, self) if opt is not None else None
        super().unscale_(optimizer)
        found_inf = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = any(bool(t.item()) for t in found_inf.values())
        if opt is not None:
            agreed = _after_unscale(opt, self, before, local)
        else:
            device = next(iter(found_inf.values())).device if found_inf else self._scale.device
            agreed = _any_rank(local, self.process_group, device)
        for t in found_inf.values():
            t.fill_(1.0 if agreed else 0.0)

    def step(self, optimizer, *args, **kwargs):
        """unscale_ (if not done yet), then optimizer.step() on every rank or on none."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        self._lioncub_generation += 1

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._lioncub_generation += 1


def _lioncub(optimizer):
    """The LionCub inside a framework's optimizer wrapper, or None."""
    from lioncub.optim import LionCub

    for _ in range(4):
        if isinstance(optimizer, LionCub):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def _before_unscale(opt, scaler) -> tuple:
    """Look at the optimizer's coming step before the gradients change; link it to the scaler so its next
    backward passes divide the scale out themselves."""
    opt._grad_scaler = weakref.ref(scaler)
    dense = opt._spec_at(opt._step + 1).dense
    done = opt._pending_pass(amp_unconfirmed_ok=True)
    if done is None and dense and opt.world_size > 1:
        opt._average_now()  # check the mean: the same on every rank (all ranks scale by the same factor)
    return done, dense


def _after_unscale(opt, scaler, before, local: bool) -> bool:
    """The agreed inf/NaN flag for LionCub `opt`, its gradients now unscaled in .grad."""
    done, dense = before
    if opt._private_grads:  # under DDP the buckets hold copies of .grad: unscale them alike
        inv = scaler._scale.double().reciprocal().float()
        for b in opt._buckets:
            b.g.mul_(inv.to(b.g.device))
    if opt.world_size == 1:
        return local
    if dense:
        if opt._private_grads:
            local = not kernels.all_finite([b.g for b in opt._buckets])
        if done is None:
            opt._averaged["versions"] = opt._versions()  # still the mean, unscaled
        return local  # a check of the averaged gradients: the same on every rank
    amp = None if done is None else done.get("amp")
    if amp is not None and amp["generation"] == scaler._lioncub_generation:
        # backward voted on exactly these values and agreed their non-finite count
        done["versions"], done["amp_confirmed"] = opt._versions(), True
        return done["nonfinite_ranks"] > 0
    if done is not None:
        done["stale"] = True  # the vote was taken on the scaled gradients: step() takes it again
    return _any_rank(local, opt.process_group, opt._buckets[0].g.device if opt._buckets else "cpu")


def _any_rank(local: bool, group, device) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return local
    flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float32, device=device)
    call("all_reduce (GradScaler found_inf)", dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
