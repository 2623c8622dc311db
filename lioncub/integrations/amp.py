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

import torch
from torch.amp.grad_scaler import OptState

from lioncub.comm.transport import any_rank


class GradScaler(torch.amp.GradScaler):
    """fp16 loss scaling whose inf/NaN check every rank agrees on: every rank skips the same steps.

    `torch.amp.GradScaler` checks its own rank's gradients, and LionCub keeps each rank's gradient local, so
    one overflowing rank would skip a step the others take (a hang); LionCub refuses it. This subclass takes
    torch's arguments and agrees the check across ranks, at no extra collective where the overlapped exchange
    carries it (see the module docstring).

    Args:
        device: the device type of the scaled tensors ("cuda").
        init_scale: the first scale.
        growth_factor: the scale's factor after `growth_interval` steps without an overflow.
        backoff_factor: the scale's factor after an overflow.
        growth_interval: steps without an overflow before the scale grows.
        enabled: False makes every method a pass-through (as torch's).
        process_group: the group to agree over for optimizers other than LionCub (LionCub uses its own).

    Example:
        With fp16 autocast (bf16 needs no scaler):

            scaler = lioncub.GradScaler("cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)          # only to clip
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)              # every rank steps, or every rank skips
            scaler.update()
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self.generation = 0  # bumped whenever the scale may change: a LionCub pass notes which one it divided out

    @classmethod
    def from_torch(cls, scaler: torch.amp.GradScaler, device: str) -> GradScaler:
        """The lioncub.GradScaler that takes over from a torch one (a framework's): the same scale, growth and
        back-off settings, and its growth tracker if it has run or been loaded. `device`: the scaler's."""
        if not scaler.is_enabled():
            return cls(device, enabled=False)
        new = cls(device, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                  backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval())
        new.load_state_dict(scaler.state_dict())
        return new

    def inverse_scale(self) -> torch.Tensor | None:
        """1/scale, exactly as torch's unscale_ computes it (so the values are bit for bit the same); None
        before the first scale()."""
        return None if self._scale is None else self._scale.double().reciprocal().float()

    def unscale_(self, optimizer) -> None:
        """Divide the scale out of the optimizer's gradients and agree with every rank whether any was inf/NaN.

        Args:
            optimizer: a `lioncub.LionCub` (agreed in its control message where it can) or any optimizer
                (one 4-byte MAX all-reduce over `process_group`).
        """
        if not self._enabled:
            return
        engine = _engine(optimizer)
        before = engine.before_unscale(self) if engine is not None else None
        super().unscale_(optimizer)
        found_inf = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = any(bool(t.item()) for t in found_inf.values())
        if engine is not None:
            agreed = engine.after_unscale(self, before, local)
        else:
            device = next(iter(found_inf.values())).device if found_inf else self._scale.device
            agreed = any_rank(local, self.process_group, device, "GradScaler found_inf")
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
        self.generation += 1

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self.generation += 1


def _engine(optimizer):
    """The engine of the LionCub inside a framework's optimizer wrapper, or None."""
    from lioncub.optim.optimizer import LionCub

    for _ in range(4):
        if isinstance(optimizer, LionCub):
            return optimizer.engine
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None
