"""The communication methods, one module each, looked up by name.

Everything else reads this registry: the optimizer (codec kernels and exchange), the simulator and
autotune (collectives and bytes per bucket), the benches and every CLI's choices. Adding a method is
one new module here (a `Method` subclass and `METHOD = ...`), its line in `_MODULES`, and its tests;
a method that needs a new kind of codec also adds that variant to lioncub.kernels.
"""

from __future__ import annotations

from lioncub.methods import allreduce, avg_pbit, l1_pbit, vote_1bit, vote_allgather, vote_pbit
from lioncub.methods.base import FieldMethod, Method

_MODULES = (allreduce, vote_allgather, vote_1bit, vote_pbit, avg_pbit, l1_pbit)
REGISTRY: dict[str, Method] = {}
NAMES: tuple[str, ...] = ()
COMPRESSED: tuple[str, ...] = ()  # the methods with a codec: every one but the baseline
DEFAULT = "vote-1bit"  # what autotune picks in 9 of 12 cells of README's table, l1-pbit in none (docs/methods.md)
# the baseline: averaged gradients, plain Lion, one momentum (the only dense method). Code that means the
# baseline says BASELINE; code that means "a method without a codec" asks `get(name).dense`
BASELINE = allreduce.METHOD.name


def register(method: Method) -> None:
    """Add `method` to the registry (what a module's line in `_MODULES` does). Modules that read NAMES when
    they are imported see a method registered before they are."""
    global NAMES, COMPRESSED
    if not isinstance(method, Method) or not method.name:
        raise ValueError(f"register() takes a lioncub.methods.Method with a name, got {method!r}")
    if method.name in REGISTRY:
        raise ValueError(f"a method named {method.name!r} is registered already")
    REGISTRY[method.name] = method
    NAMES = tuple(REGISTRY)
    COMPRESSED = tuple(name for name, m in REGISTRY.items() if not m.dense)


for _module in _MODULES:
    register(_module.METHOD)


def get(method: str | Method) -> Method:
    """The method named `method` (a Method passes through); a clear ValueError for an unknown name."""
    if isinstance(method, Method):
        return method
    try:
        return REGISTRY[method]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(NAMES)}") from None


def check(method: str) -> str:
    """`method` if it names a registered method, else a ValueError listing them."""
    return get(method).name


__all__ = ["BASELINE", "COMPRESSED", "DEFAULT", "NAMES", "REGISTRY", "FieldMethod", "Method", "check", "get",
           "register"]
