"""Binomial trees rooted at rank 0: reduce, broadcast, and allreduce as reduce + broadcast, pipelined in slices
when the profile sets slice_bytes; their simulation by classes of ranks, their lower bounds and records.

By classes of ranks: the same SimPy model, simulated once per class of ranks that behave alike instead of once per
rank.

A binomial tree has no symmetry to exploit (no two subtrees of a rank have the same shape), but it
decomposes. Rank r's subtree is fixed by its *shape*: the lowest set bit j of r and its size
min(2^j, p - r). When every link carries the flows of one rank's children only (one GPU per node, or
a power-of-two GPUs per node, where only a node's first rank talks to other nodes; the same for
leaves), then:

* **reduce** (bottom-up): what a rank sends its parent, and when, depends only on its subtree: its
  children's sends compete on its down links, nothing else does. One sub-simulation per shape runs the
  rank's real program (`tree_reduce`) on its real links, with each child replaying the sends its
  own shape's sub-simulation recorded (the child's message overhead and up link simulated here). The
  rank's sends to its parent are recorded, not sent: the parent's sub-simulation sends them.
* **broadcast** (top-down): what a rank does depends only on its subtree and on when the slices reach
  it from its parent. One sub-simulation per class (shape, arrival times of the slices relative to the
  first): the rank's real program (`tree_broadcast`) with its parent's messages delivered at
  those times, its sends to its children on their real links; the arrival times at each child give the
  child's class. Subtrees whose arrivals differ only by a shift in time are one class, shifted.

An allreduce is reduce then broadcast: no broadcast slice reaches a rank before the root has the whole
sum, and by then every reduce message has arrived, so the broadcast starts on an idle network.

Not with burst credit (link_burst > 0, a calibrated lab profile): its state carries over from the reduce to
the broadcast, and its bookkeeping is settled at every network event, so in one shared simulation other
links' events nudge a port's credit (by 1e-5 of a slice's time here and there); trees then run rank by
rank.

The number of sub-simulations grows with the depth of the tree (a few per level), not with the ranks,
and each one moves its rank's own slices only. `exact=True` in simulate_collective simulates every
rank instead; tests check both agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..net.cluster import Cluster
from .algorithm import Algorithm
from .bounds import Hops
from .ranks import Rank, Sim, slices
from .results import CollectiveResult
from .symmetry import Symmetry, pow2

if TYPE_CHECKING:
    from ..profiles import BackendProfile


# ---- the tree and its two phases, as rank programs ----------------------------------------------------
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


def allreduce_binomial_tree(ctx, n):
    yield from tree_reduce(ctx, n, "reduce")
    yield from tree_broadcast(ctx, n, "bcast")


def reduce_binomial_tree(ctx, n):
    yield from tree_reduce(ctx, n, "reduce")


def broadcast_binomial_tree(ctx, n):
    yield from tree_broadcast(ctx, n, "bcast")


# ---- by classes of ranks ------------------------------------------------------------------------------
# Two arrival trains are one class when they agree to this fraction of their span (float round-off in
# times some seconds from the start, shifted differently, differs in the last digits).
_SAME = 1e-10


def applies(cluster: Cluster, profile: BackendProfile, op: str) -> bool:
    """Whether every link carries the tree flows of one rank's children only, and there is no burst
    credit (whose bookkeeping is settled at every network event, so that unrelated links' events nudge a
    port's credit by round-off-sized amounts that pile up over many slices)."""
    if profile.link_burst > 0:
        return False
    g = cluster.gpus_per_node
    if cluster.nodes > 1 and not pow2(g):
        return False
    if cluster.topology == "leaf-spine" and cluster.leaves > 1 and not pow2(g * cluster.nodes_per_leaf):
        return False
    return cluster.ranks > 1


def _shape(r: int, p: int) -> tuple[int, int]:
    if r == 0:
        return (p - 1).bit_length(), p
    j = (r & -r).bit_length() - 1
    return j, min(1 << j, p - r)


class _NotSent:
    """What a send to a rank outside the sub-simulation returns: it is sent in the parent's."""

    __slots__ = ("sent",)

    def __init__(self):
        self.sent = None


class _ClassRank(Rank):
    """The representative of a class: sends to `outside` are recorded (time, bytes, tag), not sent;
    `arrivals` gets the arrival times of its messages to each peer."""

    def __init__(self, sim: Sim, r: int, family: str, outside=()):
        super().__init__(sim, r, family)
        self.outside = set(outside)
        self.offered: list[tuple] = []
        self.arrivals: dict[int, list[float]] = {}

    def send(self, dst, nbytes, tag):
        if dst in self.outside:
            self.offered.append((self.env.now, nbytes, tag))
            self.bytes_sent += nbytes
            return _NotSent()
        msg = super().send(dst, nbytes, tag)
        times = self.arrivals.setdefault(dst, [])
        self.sim.mailbox[(self.r, dst, tag)].callbacks.append(lambda _ev: times.append(self.env.now))
        return msg

    def arrive_at(self, dst, tag, t):
        self.arrivals.setdefault(dst, []).append(t)


@dataclass
class _Reduce:
    offered: list  # (time, bytes, tag) of the rank's sends to its parent
    end: float  # when its program left the reduce loop
    bytes_sent: float
    bytes_received: float
    subtree_finish: float  # latest finish (last send left) of the ranks below it
    sims: int = 1


@dataclass
class _Broadcast:
    finish: float  # relative to the first arrival (the root: absolute)
    subtree_finish: float  # latest finish in its subtree, same origin
    bytes_sent: float
    bytes_received: float
    sims: int = 1


@dataclass
class TreeRun:
    cluster: Cluster
    profile: BackendProfile
    op: str
    nbytes: float
    reduce_memo: dict = field(default_factory=dict)
    bcast_memo: dict = field(default_factory=dict)  # shape -> [(arrival train, _Broadcast)]
    max_sent: float = 0.0
    max_received: float = 0.0

    def _sim(self) -> Sim:
        return Sim(self.cluster, self.profile, Symmetry.full(self.cluster), timeline=False)

    # ---- reduce: one sub-simulation per shape, bottom-up ------------------------------------------------
    def reduce(self, r: int) -> _Reduce:
        p = self.cluster.ranks
        key = _shape(r, p)
        got = self.reduce_memo.get(key)
        if got is not None:
            return got
        parent, children = binomial(r, p)
        kids = [(c, self.reduce(c)) for c in children]
        sim = self._sim()
        env, co = sim.env, self.profile.call_overhead
        ctx = _ClassRank(sim, r, self.op, outside=() if parent is None else (parent,))
        last_sent: dict[int, float] = {}
        for c, info in kids:  # each child's sends, handed to its communication thread when it made them
            for t, nb, tag in info.offered:
                msg = sim.net.submit(c, r, nb, self.op, sim.box((c, r, tag)), at=t)
            msg.sent.callbacks.append(lambda _ev, c=c: last_sent.__setitem__(c, env.now))
        end = []

        def main():
            if co > 0:
                yield env.timeout(co)
            yield from tree_reduce(ctx, self.nbytes, "reduce")
            end.append(env.now)

        env.process(main())
        env.run()
        sub = max((max(info.end, last_sent[c], info.subtree_finish) for c, info in kids), default=0.0)
        got = _Reduce(ctx.offered, end[0], ctx.bytes_sent, ctx.bytes_received, sub,
                      1 + sum(info.sims for _, info in kids))
        self.reduce_memo[key] = got
        return got

    # ---- broadcast: one sub-simulation per (shape, arrival times), top-down ------------------------------
    def broadcast(self, r: int, train: tuple | None, start: float = 0.0) -> _Broadcast:
        p = self.cluster.ranks
        shape = _shape(r, p)
        known = self.bcast_memo.setdefault(shape, [])
        if train is not None:
            tol = _SAME * (train[-1] + 1e-6)
            for other, got in known:
                if len(other) == len(train) and all(abs(a - b) <= tol for a, b in zip(other, train)):
                    return got
        parent, children = binomial(r, p)
        sim = self._sim()
        sim.solo = True  # only this rank sends
        env = sim.env
        ctx = _ClassRank(sim, r, self.op)
        if self.op == "allreduce":  # the counters go on from the reduce
            red = self.reduce_memo[_shape(r, p)]
            ctx.bytes_sent, ctx.bytes_received = red.bytes_sent, red.bytes_received
        if parent is not None:
            for j, t in enumerate(train):
                ev = sim.box((parent, r, ("bcast", j)))
                env.timeout(t).callbacks.append(lambda _ev, ev=ev: ev.succeed())
        finish = []

        def main():
            if start > 0:
                yield env.timeout(start)
            yield from tree_broadcast(ctx, self.nbytes, "bcast")
            finish.append(env.now)

        env.process(main())
        env.run()
        sub, sims = finish[0], 1
        for c in children:
            times = ctx.arrivals[c]
            t0 = times[0]
            info = self.broadcast(c, tuple(t - t0 for t in times))
            sub = max(sub, t0 + info.subtree_finish)
            sims += info.sims
        got = _Broadcast(finish[0], sub, ctx.bytes_sent, ctx.bytes_received, sims)
        known.append((train, got))
        return got


def by_classes(cluster: Cluster, profile: BackendProfile, op: str, nbytes: float) -> CollectiveResult | None:
    """op by the binomial tree, one sub-simulation per class, where that applies (None where not)."""
    return run(cluster, profile, op, nbytes) if applies(cluster, profile, op) else None


def run(cluster: Cluster, profile: BackendProfile, op: str, nbytes: float) -> CollectiveResult:
    """op ("allreduce", "reduce", "broadcast") by the binomial tree, one sub-simulation per class."""
    p = cluster.ranks
    t = TreeRun(cluster, profile, op, nbytes)
    n_slices = len(slices(profile.slice_bytes, nbytes))
    if op == "broadcast":
        root = t.broadcast(0, None, start=profile.call_overhead)
        seconds, msgs = root.subtree_finish, n_slices * (p - 1)
        per_rank = [b for known in t.bcast_memo.values() for _, b in known]
    elif op == "reduce":
        root = t.reduce(0)
        seconds, msgs = max(root.end, root.subtree_finish), n_slices * (p - 1)
        per_rank = t.reduce_memo.values()
    else:
        t.reduce(0)
        root = t.broadcast(0, None, start=t.reduce_memo[_shape(0, p)].end)
        seconds, msgs = root.subtree_finish, 2 * n_slices * (p - 1)
        per_rank = [b for known in t.bcast_memo.values() for _, b in known]
    res = CollectiveResult(op, "binomial-tree", profile.name, p, nbytes, seconds,
                           max(x.bytes_sent for x in per_rank), max(x.bytes_received for x in per_rank))
    res.messages = msgs
    # a power of two per node (applies()): rank r's parent r - lowbit(r) is on another node iff G divides r,
    # so nodes - 1 tree edges leave a node, each carrying the buffer once per phase
    res.nic_bytes_per_node = ((cluster.nodes - 1) * nbytes * (2 if op == "allreduce" else 1) / cluster.nodes
                              * cluster.nic_share)
    res.simulated_ranks = len(per_rank) + (len(t.reduce_memo) if op == "allreduce" else 0)
    return res


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
                                    libraries=("nccl",), by_classes=by_classes)
BROADCAST_BINOMIAL_TREE = Algorithm("broadcast", "binomial-tree", broadcast_binomial_tree, bound=_broadcast_bound,
                                    libraries=("nccl", "gloo"), by_classes=by_classes)
REDUCE_BINOMIAL_TREE = Algorithm("reduce", "binomial-tree", reduce_binomial_tree, bound=_reduce_bound,
                                 libraries=("nccl", "gloo"), by_classes=by_classes)
