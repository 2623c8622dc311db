"""Binomial trees rooted at rank 0: reduce, broadcast, and allreduce as reduce + broadcast (the phases are
binomial.py's), pipelined in slices when the profile sets slice_bytes; their lower bounds and records. Where
it applies they are simulated by classes of ranks (tree_classes.py)."""

from __future__ import annotations

from . import tree_classes
from .algorithm import Algorithm
from .binomial import tree_broadcast, tree_reduce
from .hops import Hops


def allreduce_binomial_tree(ctx, n):
    yield from tree_reduce(ctx, n, "reduce")
    yield from tree_broadcast(ctx, n, "bcast")


def reduce_binomial_tree(ctx, n):
    yield from tree_reduce(ctx, n, "reduce")


def broadcast_binomial_tree(ctx, n):
    yield from tree_broadcast(ctx, n, "bcast")


# ---- lower bounds (bounds.py) ---------------------------------------------------------------------------
def _reduce_bound(h: Hops, n: float) -> tuple[float, float]:
    """Reduce to rank 0: its down links carry every child's n bytes, it reduces them one after another,
    and a slice climbs the tree's deepest path."""
    c = h.cluster
    p = c.ranks
    children = [1 << i for i in range((p - 1).bit_length()) if (1 << i) < p]
    kinds = [h.kind(0, ch) for ch in children]
    inter = sum(k != "intra" for k in kinds)
    intra = len(kinds) - inter
    t = h.link_time("host", n * len(children))
    if inter:
        t = max(t, h.link_time("nic", n * inter))
    if intra:
        t = max(t, h.link_time("gpu", n * intra))
    t = max(t, h.gamma * n * len(children))
    # the last slice from the deepest leaf on the path 0 <- 2^(k-1) <- 2^(k-1) + 2^(k-2) <- ...
    s = h.slices(n)[-1]
    chain, r = 0.0, 0
    for ch in reversed(children):
        if r + ch < p:
            chain += h.hop(h.kind(r, r + ch), s, reduce=True)
            r += ch
    return chain, t


def _broadcast_time(h: Hops, n: float) -> float:
    """Rank 0 sends every slice to each child, waiting for each send to leave; the last then arrives."""
    c = h.cluster
    p = c.ranks
    children = [1 << i for i in range((p - 1).bit_length()) if (1 << i) < p]
    parts = h.slices(n)  # equal slices
    per_slice = sum(h.o + parts[0] / h.rates[h.kind(0, ch)] for ch in children)
    return len(parts) * per_slice + h.latencies[h.kind(0, children[0])]


def _allreduce_bound(h: Hops, n: float) -> tuple[float, float]:
    """The root reduces (bounded by its chain or its down links), then broadcasts."""
    red, bc = _reduce_bound(h, n), _broadcast_time(h, n)
    return red[0] + bc, red[1] + bc


def _broadcast_bound(h: Hops, n: float) -> tuple[float, float]:
    bc = _broadcast_time(h, n)
    return bc, bc


# ---- the algorithms -------------------------------------------------------------------------------------
# a root: no symmetry, but classes of ranks that behave alike
ALLREDUCE_BINOMIAL_TREE = Algorithm("allreduce", "binomial-tree", allreduce_binomial_tree, bound=_allreduce_bound,
                                    libraries=("nccl",), by_classes=tree_classes.by_classes)
BROADCAST_BINOMIAL_TREE = Algorithm("broadcast", "binomial-tree", broadcast_binomial_tree, bound=_broadcast_bound,
                                    libraries=("nccl", "gloo"), by_classes=tree_classes.by_classes)
REDUCE_BINOMIAL_TREE = Algorithm("reduce", "binomial-tree", reduce_binomial_tree, bound=_reduce_bound,
                                 libraries=("nccl", "gloo"), by_classes=tree_classes.by_classes)
