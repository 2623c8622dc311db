"""LionCub where other code drives training: torch DDP (`ddp`), FSDP2 / HSDP (`fsdp`), fp16 loss scaling (`amp`),
sharded checkpoints (`checkpoint`, on torch.distributed.checkpoint) and the frameworks that wrap the model
themselves (`frameworks`: Hugging Face Trainer, accelerate, Lightning)."""

_LAZY = {"attach_to_trainer": "lioncub.integrations.frameworks",
         "lightning_callback": "lioncub.integrations.frameworks",
         "replace_grad_scaler": "lioncub.integrations.frameworks",
         "attach_ddp": "lioncub.integrations.ddp",
         "attach_fsdp": "lioncub.integrations.fsdp"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lioncub.integrations' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
