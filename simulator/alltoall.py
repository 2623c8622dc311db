"""All-to-all: pairwise exchange (p-1 steps) and all-at-once (every send and receive posted together)."""

from __future__ import annotations


def alltoall_pairwise(ctx, n):
    """p-1 steps; at step k send n/p to r+k and receive from r-k."""
    p, r = ctx.p, ctx.r
    for k in range(1, p):
        yield from ctx.sendrecv((r + k) % p, (r - k) % p, n / p, ("a2a", k))


def alltoall_all_at_once(ctx, n):
    """Post all p-1 sends and receives at once (NCCL's grouped send/recv, Gloo's alltoall: for k = 1..p-1,
    send to r+k, then receive from r-k)."""
    p, r = ctx.p, ctx.r
    arrivals = []
    for k in range(1, p):
        ctx.send((r + k) % p, n / p, ("a2a", k))
        arrivals.append(ctx.recv((r - k) % p, ("a2a", k), n / p))
    yield ctx.env.all_of(arrivals)
