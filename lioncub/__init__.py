"""lioncub: communication-efficient distributed training with the Lion optimizer.

The layers, each depending only on those before it:
  core          lioncub.kernels, lioncub.comm (wire format, collectives, process groups), lioncub.methods
                (the registry of communication methods), lioncub.optim (the LionCub engine)
  integrations  lioncub.integrations: torch DDP, fp16 loss scaling, DCP checkpoints, HF / accelerate / Lightning
  applications  lioncub.simulator (imports no torch), lioncub.apps (autotune, benchmarks, calibration, the lab,
                training, the demo) and the `lioncub` command (lioncub.cli)

The torch-dependent names are imported lazily, so that `lioncub.simulator` (which must not import torch) can be
used on machines without it. `lioncub.checkpoint` (and the deprecated `lioncub.amp`) are modules:
`from lioncub.checkpoint import save` works.
"""

__version__ = "0.1.0"

_LAZY = {
    "LionCub": "lioncub.optim.optimizer",
    "LocalSteps": "lioncub.optim.local",
    "Lion": "lioncub.optim.lion",
    "lion_step": "lioncub.optim.optimizer",
    "attach_ddp": "lioncub.integrations.ddp",
    "attach_fsdp": "lioncub.integrations.fsdp",
    "GradScaler": "lioncub.integrations.amp",
    "broadcast_parameters": "lioncub.comm.distributed",
    "init_distributed": "lioncub.comm.distributed",
    "finish": "lioncub.comm.distributed",
    "EveryK": "lioncub.optim.schedules",
    "FirstSteps": "lioncub.optim.schedules",
    "Geometric": "lioncub.optim.schedules",
    "Adaptive": "lioncub.optim.schedules",
}
_MODULES = {"amp": "lioncub.amp", "checkpoint": "lioncub.checkpoint"}  # real modules: lioncub/amp.py, ...

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'lioncub' has no attribute {name!r}")


def __dir__():
    """The lazy exports too, so that dir(lioncub) and tab completion list them."""
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
