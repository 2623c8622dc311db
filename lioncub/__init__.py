"""lioncub: communication-efficient distributed training with the Lion optimizer.

The torch-dependent names are imported lazily, so that `lioncub.simulator` (which must not import
torch) can be used on machines without it.
"""

__version__ = "0.1.0"

_LAZY = {
    "LionCub": "lioncub.optim",
    "Lion": "lioncub.lion",
    "lion_step": "lioncub.optim",
    "attach_ddp": "lioncub.ddp",
    "broadcast_parameters": "lioncub.distributed",
    "init_distributed": "lioncub.distributed",
    "finish": "lioncub.distributed",
    "EveryK": "lioncub.schedules",
    "FirstSteps": "lioncub.schedules",
    "Geometric": "lioncub.schedules",
    "Adaptive": "lioncub.schedules",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lioncub' has no attribute {name!r}")
