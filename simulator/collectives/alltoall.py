"""All-to-all: pairwise exchange (p-1 steps) and all-at-once (every send and receive posted together); their
lower bounds and records."""

from __future__ import annotations

from .algorithm import Algorithm
from .bounds import Hops


def alltoall_pairwise(ctx, n):
    """p-1 steps; at step k send n/p to r+k and receive from r-k. Steps whose peers are the same kinds of
    hop are alike (and may be fast-forwarded)."""
    p, r = ctx.p, ctx.r
    hop = ctx.cluster.hop
    kind = lambda k: (hop(r, (r + k) % p), hop((r - k) % p, r))
    k = 1
    while k < p:
        yield from ctx.sendrecv((r + k) % p, (r - k) % p, n / p, ("a2a", k))
        if ctx.sim.fast:
            this = ("a2a", *kind(k))

            def ahead(k=k, this=this):
                if ctx.cluster.gpus_per_node == 1 and ctx.cluster.leaves in (1, ctx.cluster.nodes):
                    return p - 1 - k  # every path is of one kind
                m = 0
                while k + m + 1 < p and ("a2a", *kind(k + m + 1)) == this:
                    m += 1
                return m

            k += ctx.fast_forward(this, ahead)
        k += 1


def alltoall_all_at_once(ctx, n):
    """Post all p-1 sends and receives at once (NCCL's grouped send/recv, Gloo's alltoall: for k = 1..p-1,
    send to r+k, then receive from r-k)."""
    p, r = ctx.p, ctx.r
    piece = n / p
    yield ctx.exchange([((r + k) % p, piece, ("a2a", k)) for k in range(1, p)],
                       [((r - k) % p, ("a2a", k), piece) for k in range(1, p)])


# ---- lower bounds (bounds.py) ---------------------------------------------------------------------------
def _bytes_bound(h: Hops, piece: float) -> float:
    """Every rank sends p-1 pieces; every NIC carries the node's G * (p - G) pieces out (and as many in)."""
    c = h.cluster
    p, g = c.ranks, c.gpus_per_node
    t = h.link_time("host", (p - 1) * piece)
    if c.nodes > 1:
        t = max(t, h.link_time("nic", g * (p - g) * piece))
    return t


def _pairwise_bound(h: Hops, n: float) -> tuple[float, float]:
    piece = n / h.p
    return (h.p - 1) * h.cheapest(piece), _bytes_bound(h, piece)


def _all_at_once_bound(h: Hops, n: float) -> tuple[float, float]:
    """p-1 sends through one communication thread, then the last one travels."""
    piece = n / h.p
    return (h.p - 1) * h.o + h.cheapest(piece) - h.o, _bytes_bound(h, piece)


# ---- the algorithms -------------------------------------------------------------------------------------
ALLTOALL_PAIRWISE = Algorithm("alltoall", "pairwise", alltoall_pairwise, symmetry="cyclic", bound=_pairwise_bound)
# its rendezvous form is itself (Gloo posts every send and receive at once too); a pair exchanges data both
# ways on one connection, so ranks entering one after another serialize it
ALLTOALL_ALL_AT_ONCE = Algorithm("alltoall", "all-at-once", alltoall_all_at_once, symmetry="cyclic",
                                 bound=_all_at_once_bound, libraries=("nccl", "gloo"),
                                 rendezvous=alltoall_all_at_once, entry_order_matters=lambda p: True)
