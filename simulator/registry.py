"""The algorithms by op, the ops, and which algorithm runs where.

ALGORITHMS[op][name] is a generator fn(ctx, n) run by every (representative) rank; n follows the SIZE
convention of `simulate_collective`. RENDEZVOUS_FORMS are the forms Gloo runs with its handshake.
"""

from __future__ import annotations

from lioncub import methods

from .alltoall import alltoall_all_at_once, alltoall_pairwise
from .cluster import Cluster
from .doubling import (
    allgather_bruck,
    allgather_recursive_doubling,
    allreduce_rabenseifner,
    allreduce_recursive_doubling,
    reducescatter_halving,
)
from .profiles import ALL_ALGORITHMS
from .rings import (
    allgather_ring,
    allgather_ring_halves,
    allreduce_hierarchical,
    allreduce_ring,
    allreduce_ring_segmented,
    reducescatter_ring,
)
from .symmetry import pow2
from .trees import allreduce_binomial_tree, broadcast_binomial_tree, reduce_binomial_tree

PRIMITIVES = tuple(ALL_ALGORITHMS)  # allreduce, allgather, reducescatter, alltoall, broadcast, reduce
# lioncub's composite ops: every method but the fp32 "allreduce" (a primitive), and the momentum sync
COMPOSITES = tuple(op for op in methods.NAMES if op != "allreduce") + ("momentum-sync",)
OPS = PRIMITIVES + COMPOSITES

ALGORITHMS = {
    "allreduce": {
        "ring": allreduce_ring,
        "recursive-doubling": allreduce_recursive_doubling,
        "rabenseifner": allreduce_rabenseifner,
        "binomial-tree": allreduce_binomial_tree,
        "hierarchical": allreduce_hierarchical,
    },
    "allgather": {"ring": allgather_ring, "recursive-doubling": allgather_recursive_doubling,
                  "bruck": allgather_bruck},
    "reducescatter": {"ring": reducescatter_ring, "halving": reducescatter_halving},
    "alltoall": {"pairwise": alltoall_pairwise, "all-at-once": alltoall_all_at_once},
    "broadcast": {"binomial-tree": broadcast_binomial_tree},
    "reduce": {"binomial-tree": reduce_binomial_tree},
}


# profile.rendezvous runs these algorithms in Gloo's form, with the handshake (see BackendProfile).
RENDEZVOUS_FORMS = {
    ("allreduce", "ring"): allreduce_ring_segmented,
    ("allgather", "ring"): allgather_ring_halves,
    ("alltoall", "all-at-once"): alltoall_all_at_once,
}


def entry_order_matters(op: str, alg: str, p: int) -> bool:
    """Whether ranks entering one after another can serialize this rendezvous form: it must post a send
    before the receive from the same peer, on a connection that carries data both ways (the all-to-all;
    the ring all-gather only on 2 ranks, where the next rank is the previous one; the all-reduce posts
    every receive first)."""
    return (op, alg) == ("alltoall", "all-at-once") or ((op, alg) == ("allgather", "ring") and p == 2)


def symmetry_kind(op: str, alg: str, p: int) -> str | None:
    if alg in ("ring", "bruck", "pairwise", "all-at-once", "hierarchical"):
        return "cyclic"
    if alg in ("recursive-doubling", "rabenseifner", "halving"):
        return "xor" if pow2(p) else None
    return None  # trees have a root


def check_algorithm(op: str, alg: str, cluster: Cluster) -> None:
    """Raise ValueError if `alg` cannot run `op` on this cluster."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown op {op!r}; choose one of: {', '.join(OPS)}")
    if alg not in ALGORITHMS[op]:
        raise ValueError(f"unknown {op} algorithm {alg!r}; choose one of: {', '.join(ALGORITHMS[op])}, auto")
    p = cluster.ranks
    if (op, alg) in (("allgather", "recursive-doubling"), ("reducescatter", "halving")) and not pow2(p):
        raise ValueError(f"{op} {alg} needs a power-of-two number of ranks, got {p}")


def valid(op, alg, cluster) -> bool:
    try:
        check_algorithm(op, alg, cluster)
    except ValueError:
        return False
    return not (alg == "hierarchical" and cluster.gpus_per_node == 1)  # identical to ring
