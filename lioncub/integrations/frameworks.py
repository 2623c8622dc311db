"""LionCub in the frameworks that wrap the model in DDP themselves (the `lioncub[integrations]` extra).

    # Hugging Face transformers
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(LionCub(model.parameters()), None))
    lioncub.integrations.attach_to_trainer(trainer)
    trainer.train()

    # accelerate
    lioncub.integrations.replace_grad_scaler(accelerator)   # fp16: before prepare (a no-op otherwise)
    model, opt, dl = accelerator.prepare(model, LionCub(model.parameters()), dl)
    lioncub.attach_ddp(model, opt)            # when the model is DDP-wrapped (more than one process)

    # Lightning: configure_optimizers returns a LionCub; the strategy wraps the model in DDP
    trainer = L.Trainer(strategy="ddp", callbacks=[lioncub.integrations.lightning_callback()])

Each attaches LionCub to the DDP wrapper (lioncub.attach_ddp) once the framework has built it, before the
first backward. For fp16 the frameworks make a torch.amp.GradScaler (accelerate's `accelerator.scaler`, which
the Hugging Face Trainer uses through its accelerator; Lightning's MixedPrecision plugin's `.scaler`), which
LionCub refuses (its inf check is per rank): `replace_grad_scaler` puts a lioncub.GradScaler with the same
settings in its place, and attach_to_trainer and lightning_callback do so themselves. Nothing here is
imported with lioncub itself.
"""

from __future__ import annotations

import torch

from lioncub.integrations.amp import GradScaler
from lioncub.integrations.ddp import attach_ddp


def _ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _scaler_holder(obj):
    """The object whose `.scaler` the framework's training loop reads, or None (it uses no scaler)."""
    if hasattr(obj, "precision_plugin"):  # a Lightning Trainer
        return obj.precision_plugin if hasattr(obj.precision_plugin, "scaler") else None
    if hasattr(obj, "scaler"):  # accelerate's Accelerator, a Lightning precision plugin
        return obj
    if hasattr(getattr(obj, "accelerator", None), "scaler"):  # the Hugging Face Trainer's Accelerator
        return obj.accelerator
    raise ValueError(f"replace_grad_scaler: expected an accelerate Accelerator, a Hugging Face or Lightning Trainer "
                     f"or a Lightning precision plugin, got {type(obj).__name__}")


def replace_grad_scaler(obj, *optimizers):
    """Put a lioncub.GradScaler in place of the torch.amp.GradScaler that `obj` (an accelerate Accelerator, a
    Hugging Face Trainer, a Lightning Trainer or MixedPrecision plugin) made for fp16, with the same scale,
    growth and back-off settings: then an overflow on one rank skips the step on every rank and the scale
    backs off identically. Call it before accelerate's `prepare`, or pass the optimizers it already prepared
    (each holds the scaler too). Returns the scaler now in place; None (nothing to do) without fp16."""
    holder = _scaler_holder(obj)
    old = None if holder is None else holder.scaler
    if old is None or isinstance(old, GradScaler):
        return old
    if not isinstance(old, torch.amp.GradScaler):
        raise ValueError(f"replace_grad_scaler: cannot take over a {type(old).__name__} (not a torch.amp.GradScaler)")
    new = GradScaler.from_torch(old, torch.device(getattr(holder, "device", "cuda")).type)
    holder.scaler = new
    for opt in optimizers:
        if getattr(opt, "scaler", None) is old:
            opt.scaler = new
    return new


def attach_to_trainer(trainer) -> None:
    """Hugging Face `Trainer` built with `optimizers=(LionCub(...), scheduler_or_None)`: attach LionCub to the
    DDP model the Trainer wraps at the start of training (a TrainerCallback; single-process runs need nothing),
    and, for fp16, put a lioncub.GradScaler in place of its accelerator's torch one (call it before train())."""
    from transformers import TrainerCallback

    class _AttachLionCub(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if _ddp(trainer.model_wrapped):  # (a no-op once attached)
                attach_ddp(trainer.model_wrapped, trainer.optimizer)

    if trainer.optimizer is None:
        raise ValueError("attach_to_trainer: build the Trainer with optimizers=(LionCub(...), None)")
    replace_grad_scaler(trainer)
    trainer.add_callback(_AttachLionCub())


def lightning_callback():
    """A Lightning Callback that puts a lioncub.GradScaler in place of the fp16 precision plugin's torch one at
    setup (before a checkpoint's scaler state is restored into it) and attaches the LightningModule's LionCub
    optimizer(s) to the strategy's DDP model when training starts."""
    from lightning.pytorch.callbacks import Callback

    from lioncub.optim import LionCub

    class LionCubDDP(Callback):
        def setup(self, trainer, pl_module, stage):
            replace_grad_scaler(trainer)

        def on_train_start(self, trainer, pl_module):
            if _ddp(trainer.strategy.model):
                for opt in trainer.optimizers:
                    if isinstance(opt, LionCub):
                        attach_ddp(trainer.strategy.model, opt)

    return LionCubDDP()
