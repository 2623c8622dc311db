"""LionCub in the frameworks that wrap the model in DDP themselves (the `lioncub[integrations]` extra).

    # Hugging Face transformers
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(LionCub(model.parameters()), None))
    lioncub.integrations.attach_to_trainer(trainer)
    trainer.train()

    # accelerate
    model, opt, dl = accelerator.prepare(model, LionCub(model.parameters()), dl)
    lioncub.attach_ddp(model, opt)            # when the model is DDP-wrapped (more than one process)

    # Lightning: configure_optimizers returns a LionCub; the strategy wraps the model in DDP
    trainer = L.Trainer(strategy="ddp", callbacks=[lioncub.integrations.lightning_callback()])

Each attaches LionCub to the DDP wrapper (lioncub.attach_ddp) once the framework has built it, before the
first backward. Nothing here is imported with lioncub itself.
"""

from __future__ import annotations

import torch

from lioncub.integrations.ddp import attach_ddp


def _ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def attach_to_trainer(trainer) -> None:
    """Hugging Face `Trainer` built with `optimizers=(LionCub(...), scheduler_or_None)`: attach LionCub to the
    DDP model the Trainer wraps at the start of training (a TrainerCallback; single-process runs need nothing)."""
    from transformers import TrainerCallback

    class _AttachLionCub(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if _ddp(trainer.model_wrapped):  # (a no-op once attached)
                attach_ddp(trainer.model_wrapped, trainer.optimizer)

    if trainer.optimizer is None:
        raise ValueError("attach_to_trainer: build the Trainer with optimizers=(LionCub(...), None)")
    trainer.add_callback(_AttachLionCub())


def lightning_callback():
    """A Lightning Callback that attaches the LightningModule's LionCub optimizer(s) to the strategy's DDP model
    when training starts."""
    from lightning.pytorch.callbacks import Callback

    from lioncub.optim import LionCub

    class LionCubDDP(Callback):
        def on_train_start(self, trainer, pl_module):
            if _ddp(trainer.strategy.model):
                for opt in trainer.optimizers:
                    if isinstance(opt, LionCub):
                        attach_ddp(trainer.strategy.model, opt)

    return LionCubDDP()
