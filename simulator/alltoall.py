"""All-to-all: pairwise exchange (p-1 steps) and all-at-once (every send and receive posted together)."""

from __future__ import annotations


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
