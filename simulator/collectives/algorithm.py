"""What a collective algorithm is to the simulator: one `Algorithm` record with everything needed to run it,
choose it (`auto`) and bound it. Each record lives in the module of its program (rings.py, doubling.py,
trees.py, alltoall.py); registry.py registers them (docs/simulator.md: Adding a collective algorithm)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..profiles import LIBRARIES, PRIMITIVES

if TYPE_CHECKING:
    from ..net.cluster import Cluster
    from .bounds import Hops

SYMMETRIES = ("cyclic", "xor")

# (hops, n) -> (seconds of the latency chain, seconds of the bytes over the bottleneck link): bounds.py
Bound = Callable[["Hops", float], tuple[float, float]]


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm.

    op, name: the primitive it implements (PRIMITIVES) and what `algorithm=` and profiles call it.
    program: fn(ctx, n), a generator every (representative) rank runs against the rank API (ranks.Rank);
        n follows simulate_collective's SIZE convention.
    symmetry: the rank translations it is invariant under, so that representative ranks stand for all
        (symmetry.py): "cyclic" (shifts by a node), "xor" (XOR by a node; used on a power of two of ranks
        only), None (every rank simulated).
    pow2: runs on a power-of-two number of ranks only (check_algorithm refuses others).
    bound: lower bounds on its time (bounds.py: auto skips a candidate whose bound exceeds the best time so
        far); None: no bound (always simulated).
    libraries: the built-in profiles (LIBRARIES) whose `auto` chooses from it; their order is the
        registry's.
    rendezvous: its program in Gloo's form, with the receiver's ready notice before each send, which runs
        when the profile sets `rendezvous` (None: the eager program runs then too); rendezvous_bound its
        bound, entry_order_matters(p) whether ranks entering one after another can serialize it
        (`rendezvous_stagger` then simulates that case too, and there is no bound).
    by_classes: fn(cluster, profile, op, n) -> CollectiveResult, or None where it does not apply: an exact
        way to simulate it with fewer processes (trees.py, by classes of ranks),
        used unless every rank must be simulated.
    redundant_on: fn(cluster) -> whether it is another algorithm on this cluster (auto skips it there).
    """

    op: str
    name: str
    program: Callable
    symmetry: str | None = None
    pow2: bool = False
    bound: Bound | None = None
    libraries: tuple[str, ...] = ()
    rendezvous: Callable | None = None
    rendezvous_bound: Bound | None = None
    entry_order_matters: Callable[[int], bool] | None = None
    by_classes: Callable | None = None
    redundant_on: Callable[[Cluster], bool] | None = None

    def __post_init__(self):
        what = f"algorithm {self.op}/{self.name}"
        if self.op not in PRIMITIVES:
            raise ValueError(f"{what}: op must be one of {', '.join(PRIMITIVES)}")
        if not isinstance(self.name, str) or not self.name or self.name == "auto" or "," in self.name:
            raise ValueError(f"{what}: the name must be a non-empty string other than 'auto', without commas")
        if not callable(self.program):
            raise ValueError(f"{what}: program must be a generator function fn(ctx, n)")
        if self.symmetry not in (None, *SYMMETRIES):
            raise ValueError(f"{what}: symmetry must be one of {', '.join(SYMMETRIES)} or None")
        unknown = sorted(set(self.libraries) - set(LIBRARIES))
        if unknown or isinstance(self.libraries, str):
            raise ValueError(f"{what}: libraries must be a tuple of {', '.join(LIBRARIES)}, got {self.libraries!r}")
        if self.rendezvous is None and (self.rendezvous_bound or self.entry_order_matters):
            raise ValueError(f"{what}: rendezvous_bound and entry_order_matters describe its rendezvous form")

    def matters_in_order(self, p: int) -> bool:
        """Whether p ranks entering its rendezvous form one after another can serialize it."""
        return self.entry_order_matters is not None and self.entry_order_matters(p)
