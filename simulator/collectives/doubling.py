"""Recursive doubling and halving: allreduce by recursive doubling and by Rabenseifner's halving-doubling
(MPICH's folding for other p), reduce-scatter by halving, all-gather by recursive doubling and Bruck; their
lower bounds and records."""

from __future__ import annotations

from .algorithm import Algorithm
from .bounds import Hops, rounds


def _recursive_doubling(ctx, members, n, label):
    q, i = len(members), members.index(ctx.r)
    d = 1
    while d < q:
        peer = members[i ^ d]
        yield from ctx.sendrecv(peer, peer, n, (label, d))
        yield from ctx.reduce(n)
        d *= 2


def _halving_doubling(ctx, members, n, label, gather=True):
    """Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling."""
    q, i = len(members), members.index(ctx.r)
    size, d = n, q // 2
    while d >= 1:
        peer = members[i ^ d]
        size /= 2
        yield from ctx.sendrecv(peer, peer, size, (label, "rs", d))
        yield from ctx.reduce(size)
        d //= 2
    if gather:
        d = 1
        while d < q:
            peer = members[i ^ d]
            yield from ctx.sendrecv(peer, peer, size, (label, "ag", d))
            size *= 2
            d *= 2


def _folded(ctx, n, core):
    """MPICH's handling of a non-power-of-two p: the first 2*rem ranks pair up (even sends its buffer to
    odd, which reduces it), the power of two that is left runs `core`, and odd ranks send the result
    back."""
    p, r = ctx.p, ctx.r
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    if rem == 0:
        yield from core(ctx, list(range(p)), n, "core")
        return
    if r < 2 * rem and r % 2 == 0:
        ctx.send(r + 1, n, ("fold-in",))
        yield ctx.recv(r + 1, ("fold-out",), n)
        return
    if r < 2 * rem:
        yield ctx.recv(r - 1, ("fold-in",), n)
        yield from ctx.reduce(n)
    members = [x for x in range(1, 2 * rem, 2)] + list(range(2 * rem, p))
    yield from core(ctx, members, n, "core")
    if r < 2 * rem:
        ctx.send(r - 1, n, ("fold-out",))


def allreduce_recursive_doubling(ctx, n):
    yield from _folded(ctx, n, _recursive_doubling)


def allreduce_rabenseifner(ctx, n):
    yield from _folded(ctx, n, _halving_doubling)


def reducescatter_halving(ctx, n):
    yield from _halving_doubling(ctx, list(range(ctx.p)), n, "rs", gather=False)


def allgather_recursive_doubling(ctx, n):
    p, r = ctx.p, ctx.r
    size, d = n / p, 1
    while d < p:
        yield from ctx.sendrecv(r ^ d, r ^ d, size, ("ag", d))
        size *= 2
        d *= 2


def allgather_bruck(ctx, n):
    """Bruck: at step k send the 2^k blocks gathered so far to r - 2^k, receive from r + 2^k."""
    p, r = ctx.p, ctx.r
    block, d = n / p, 1
    while d < p:
        size = min(d, p - d) * block
        yield from ctx.sendrecv((r - d) % p, (r + d) % p, size, ("bruck", d))
        d *= 2


# ---- lower bounds (bounds.py) ---------------------------------------------------------------------------
# Every rank of the power of two q starts round i no earlier than the earliest rank ended round i-1, so
# rounds add up (no bytes bound: the chain is the bound).
def _lg(p: int) -> int:
    """lg q, q the largest power of two <= p."""
    q = 1 << (p.bit_length() - 1)
    return q.bit_length() - 1


def _folded_bound(h: Hops, n: float, phases: list[tuple[list[float], bool]]) -> tuple[float, float]:
    """The core's exchange rounds (phases of (sizes, reduced)). For other p (MPICH's folding) a folded rank's
    result comes back after the core: fold-in, its reduction and the core's rounds on the odd rank (whose
    peers may have sent early: its own sends only), then fold-out."""
    p = h.p
    q = 1 << (p.bit_length() - 1)
    core = sum(rounds(h, sz, red) for sz, red in phases)
    if q == p:
        return core, 0.0
    odd = h.cheapest(n) + h.gamma * n + sum(rounds(h, sz, red, latency=False) for sz, red in phases)
    return max(core, odd) + h.cheapest(n), 0.0


def _recursive_doubling_bound(h: Hops, n: float) -> tuple[float, float]:
    return _folded_bound(h, n, [([n] * _lg(h.p), True)])


def _rabenseifner_bound(h: Hops, n: float) -> tuple[float, float]:
    rs = [n / 2 ** (i + 1) for i in range(_lg(h.p))]
    return _folded_bound(h, n, [(rs, True), (list(reversed(rs)), False)])


def _halving_bound(h: Hops, n: float) -> tuple[float, float]:
    return rounds(h, [n / 2 ** (i + 1) for i in range(_lg(h.p))], True), 0.0


def _allgather_doubling_bound(h: Hops, n: float) -> tuple[float, float]:
    block = n / h.p
    return rounds(h, [block * 2**i for i in range(_lg(h.p))], False), 0.0


def _bruck_bound(h: Hops, n: float) -> tuple[float, float]:
    p = h.p
    block = n / p
    sizes, d = [], 1
    while d < p:
        sizes.append(min(d, p - d) * block)
        d *= 2
    return rounds(h, sizes, False), 0.0


# ---- the algorithms -------------------------------------------------------------------------------------
ALLREDUCE_RECURSIVE_DOUBLING = Algorithm("allreduce", "recursive-doubling", allreduce_recursive_doubling,
                                         symmetry="xor", bound=_recursive_doubling_bound)
ALLREDUCE_RABENSEIFNER = Algorithm("allreduce", "rabenseifner", allreduce_rabenseifner, symmetry="xor",
                                   bound=_rabenseifner_bound, libraries=("gloo",))
REDUCESCATTER_HALVING = Algorithm("reducescatter", "halving", reducescatter_halving, symmetry="xor", pow2=True,
                                  bound=_halving_bound)
ALLGATHER_RECURSIVE_DOUBLING = Algorithm("allgather", "recursive-doubling", allgather_recursive_doubling,
                                         symmetry="xor", pow2=True, bound=_allgather_doubling_bound)
ALLGATHER_BRUCK = Algorithm("allgather", "bruck", allgather_bruck, symmetry="cyclic", bound=_bruck_bound)
