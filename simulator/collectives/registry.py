"""The collective algorithms the simulator knows, by op: one `Algorithm` record each (algorithm.py), defined in
the module of its program. Their order here is the order profiles list them in and `auto` breaks ties by. The
registry keeps the names the profiles read (profiles.ALL_ALGORITHMS, profiles.LIBRARY_ALGORITHMS).

Adding an algorithm is its record in its module and one line in BUILTIN (docs/simulator.md: Adding a
collective algorithm); `register` adds a record at run time (a test, a user's own algorithm).
"""

from __future__ import annotations

from ..net.cluster import Cluster
from ..profiles import ALL_ALGORITHMS, LIBRARY_ALGORITHMS, PRIMITIVES
from . import alltoall, doubling, rings, trees
from .algorithm import Algorithm
from .symmetry import pow2

ALGORITHMS: dict[str, dict[str, Algorithm]] = {op: {} for op in PRIMITIVES}


def register(alg: Algorithm) -> Algorithm:
    """Make `alg` known: by name (`algorithm=`), to the profiles of its libraries and to every profile that
    does not list its own algorithms (so to `auto`)."""
    if not isinstance(alg, Algorithm):
        raise ValueError(f"register takes an Algorithm record, got {type(alg).__name__}")
    if alg.name in ALGORITHMS[alg.op]:
        raise ValueError(f"{alg.op} algorithm {alg.name!r} is already registered")
    ALGORITHMS[alg.op][alg.name] = alg
    ALL_ALGORITHMS[alg.op].append(alg.name)
    for library in set(alg.libraries):
        LIBRARY_ALGORITHMS[library][alg.op].append(alg.name)
    return alg


def unregister(alg: Algorithm) -> None:
    """Forget a record `register` added (a test's, once it is done)."""
    if ALGORITHMS[alg.op].get(alg.name) is not alg:
        raise ValueError(f"{alg.op} algorithm {alg.name!r} is not this record")
    del ALGORITHMS[alg.op][alg.name]
    ALL_ALGORITHMS[alg.op].remove(alg.name)
    for library in set(alg.libraries):
        LIBRARY_ALGORITHMS[library][alg.op].remove(alg.name)


BUILTIN = (
    rings.ALLREDUCE_RING,
    doubling.ALLREDUCE_RECURSIVE_DOUBLING,
    doubling.ALLREDUCE_RABENSEIFNER,
    trees.ALLREDUCE_BINOMIAL_TREE,
    rings.ALLREDUCE_HIERARCHICAL,
    rings.ALLGATHER_RING,
    doubling.ALLGATHER_RECURSIVE_DOUBLING,
    doubling.ALLGATHER_BRUCK,
    rings.REDUCESCATTER_RING,
    doubling.REDUCESCATTER_HALVING,
    alltoall.ALLTOALL_PAIRWISE,
    alltoall.ALLTOALL_ALL_AT_ONCE,
    trees.BROADCAST_BINOMIAL_TREE,
    trees.REDUCE_BINOMIAL_TREE,
)
for _alg in BUILTIN:
    register(_alg)


def get(op: str, alg: str) -> Algorithm:
    """The record of `alg` for `op`; ValueError naming the choices if there is none."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown op {op!r}; choose one of: {', '.join(ALGORITHMS)}")
    if alg not in ALGORITHMS[op]:
        raise ValueError(f"unknown {op} algorithm {alg!r}; choose one of: {', '.join(ALGORITHMS[op])}, auto")
    return ALGORITHMS[op][alg]


def check_algorithm(op: str, alg: str, cluster: Cluster) -> None:
    """Raise ValueError if `alg` cannot run `op` on this cluster."""
    p = cluster.ranks
    if get(op, alg).pow2 and not pow2(p):
        raise ValueError(f"{op} {alg} needs a power-of-two number of ranks, got {p}")


def valid(op, alg, cluster) -> bool:
    """Whether `auto` may choose `alg` on this cluster: it can run there and is not another algorithm there."""
    try:
        check_algorithm(op, alg, cluster)
    except ValueError:
        return False
    redundant = ALGORITHMS[op][alg].redundant_on
    return redundant is None or not redundant(cluster)
