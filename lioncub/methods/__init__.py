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
REGISTRY: dict[str, Method] = {m.METHOD.name: m.METHOD for m in _MODULES}
NAMES: tuple[str, ...] = tuple(REGISTRY)
DEFAULT = "l1-pbit"
# the baseline: averaged gradients, plain Lion, one momentum (the only dense method). Code that means the
# baseline says BASELINE; code that means "a method without a codec" asks `get(name).dense`
BASELINE = allreduce.METHOD.name
COMPRESSED: tuple[str, ...] = tuple(name for name, m in REGISTRY.items() if not m.dense)


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


__all__ = ["BASELINE", "COMPRESSED", "DEFAULT", "NAMES", "REGISTRY", "FieldMethod", "Method", "check", "get"]
