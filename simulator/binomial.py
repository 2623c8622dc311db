"""The binomial tree rooted at rank 0, and its two phases as rank programs: reduce to the root and broadcast
from it, pipelined in slices when the profile sets slice_bytes. trees.py makes the algorithms of them,
tree_classes.py runs them by classes of ranks."""

from __future__ import annotations


def binomial(r: int, p: int) -> tuple[int | None, list[int]]:
    """Parent and children (smallest subtree first) of rank r in a binomial tree rooted at 0."""
    children, d = [], 1
    while d < p:
        if r & d:
            return r - d, children
        if r + d < p:
            children.append(r + d)
        d *= 2
    return None, children


def tree_reduce(ctx, n, label):
    parent, children = binomial(ctx.r, ctx.p)
    for j, s in enumerate(ctx.slices(n)):
        for c in children:
            yield ctx.recv(c, (label, j), s)
            yield from ctx.reduce(s)
        if parent is not None:
            ctx.send(parent, s, (label, j))


def tree_broadcast(ctx, n, label):
    parent, children = binomial(ctx.r, ctx.p)
    for j, s in enumerate(ctx.slices(n)):
        if parent is not None:
            yield ctx.recv(parent, (label, j), s)
        # largest subtree first, one after the other
        yield from ctx.send_each([(c, s, (label, j)) for c in reversed(children)])
