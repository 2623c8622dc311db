"""lioncub.amp: the spelling of `lioncub.GradScaler` that the docs used until 0.1 (`from lioncub.amp import
GradScaler`). It keeps working, with a DeprecationWarning naming `lioncub.GradScaler`; the class lives in
lioncub.integrations.amp."""

import warnings

__all__ = ["GradScaler"]  # noqa: F822 (resolved by __getattr__, with its warning)


def __getattr__(name):
    if name == "GradScaler":
        warnings.warn("lioncub.amp.GradScaler is deprecated: use lioncub.GradScaler (`from lioncub import "
                      "GradScaler`), the same class", DeprecationWarning, stacklevel=2)
        from lioncub.integrations.amp import GradScaler

        return GradScaler
    raise AttributeError(f"module 'lioncub.amp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"GradScaler"})
