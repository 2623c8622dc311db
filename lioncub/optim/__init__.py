"""The LionCub optimizer engine. The names are imported lazily, so that the torch-free parts
(`lioncub.optim.schedules`) can be used without torch."""

_LAZY = {"LionCub": "lioncub.optim.optimizer", "CommStats": "lioncub.optim.stats", "LocalSteps": "lioncub.optim.local",
         "lion_step": "lioncub.optim.optimizer", "Lion": "lioncub.optim.lion"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lioncub.optim' has no attribute {name!r}")
