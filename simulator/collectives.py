"""Collective algorithms as SimPy processes, one per rank, that read like the protocol: send, recv, reduce.

    result = simulate_collective(Cluster(nodes=16, bandwidth="10Gbit", latency="1ms"),
                                 "allreduce", "ring", 256 * 2**20, backend="nccl")
    result.seconds, result.bytes_sent_per_rank, result.to_dict()

SIZE convention (`size_bytes`): the bytes of each rank's whole buffer: the allreduce / reduce-scatter /
broadcast / reduce input, the all-gather *output*, the all-to-all *send* buffer. For lioncub's composite
ops (`vote-1bit`, `l1-pbit`, `momentum-sync`, ...) it is the bytes of the fp32 bucket they synchronize
(`composite_elements`), and the collectives they issue are those of `lioncub.methods`.

A rank's program is a generator. `ctx.send(dst, nbytes, tag)` hands a message to the network and returns
at once (the message's `.sent` event fires when its last byte has left); `yield ctx.recv(src, tag, n)`
waits for a message; `yield from ctx.reduce(n)` spends n * gamma seconds; `yield from ctx.sendrecv(...)`
is MPI_Sendrecv. A collective ends on a rank when its own sends have left and its receives arrived.

Pipelining: ring and tree algorithms cut every step's chunk into `profile.slice_bytes` slices and forward
each slice as soon as it has arrived; with `slice_bytes=None` a step is one message and the next step
starts when it has arrived, which is the textbook step-by-step algorithm.

Symmetry (speed): when the topology and the algorithm are invariant under a group of rank translations
(cyclic shifts by one node, or XOR with multiples of a node for recursive halving/doubling), only one
representative rank per orbit is simulated. A representative's receive from rank s is the image of a
send by the representative of s; its connections stand for their orbits, which load every link of a link
orbit equally (network.py). The result is the same as simulating every rank (tests check this on small
clusters); a 1024-rank ring with 8 GPUs per node runs 8 processes instead of 1024.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import simpy

from lioncub import methods, wire

from .cluster import Cluster
from .network import Network
from .profiles import ALL_ALGORITHMS, BackendProfile, get_profile

PRIMITIVES = tuple(ALL_ALGORITHMS)  # allreduce, allgather, reducescatter, alltoall, broadcast, reduce
# lioncub's composite ops: every method but the fp32 "allreduce" (a primitive), and the momentum sync
COMPOSITES = tuple(op for op in methods.NAMES if op != "allreduce") + ("momentum-sync",)
OPS = PRIMITIVES + COMPOSITES


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# ---------------------------------------------------------------------------------------------------------
# symmetry
# ---------------------------------------------------------------------------------------------------------
class Symmetry:
    """Rank translations r -> r + a*unit (mod p) ("cyclic") or r -> r XOR a*unit ("xor").

    `unit == p` is the trivial group: every rank is simulated."""

    def __init__(self, cluster: Cluster, unit: int, kind: str):
        self.cluster = cluster
        self.p = cluster.ranks
        self.unit = unit
        self.kind = kind
        g = cluster.gpus_per_node
        self._node_mod = unit // g
        self._leaf_mod = max(1, unit // (g * (cluster.nodes_per_leaf or cluster.nodes)))

    @classmethod
    def full(cls, cluster: Cluster) -> Symmetry:
        return cls(cluster, cluster.ranks, "cyclic")

    @classmethod
    def choose(cls, cluster: Cluster, kind: str | None) -> Symmetry:
        p, u = cluster.ranks, cluster.symmetry_unit()
        if kind is None or u >= p or p % u:
            return cls.full(cluster)
        if kind == "xor" and not (_pow2(p) and _pow2(u)):
            return cls.full(cluster)
        return cls(cluster, u, kind)

    @property
    def reps(self) -> range:
        return range(self.unit)

    @property
    def orbit_size(self) -> int:
        return self.p // self.unit

    def to_rep(self, src: int, dst: int) -> tuple[int, int]:
        """The group element mapping src to its representative, applied to (src, dst)."""
        base = src - src % self.unit
        if base == 0:
            return src, dst
        if self.kind == "cyclic":
            return src - base, (dst - base) % self.p
        return src ^ base, dst ^ base

    def image(self, r: int, a: int) -> int:
        """The a-th element of the group applied to rank r."""
        if self.kind == "cyclic":
            return (r + a * self.unit) % self.p
        return r ^ (a * self.unit)

    def canonical(self, link: tuple) -> tuple:
        kind, idx = link
        if kind in ("up", "down"):
            return (kind, idx % self._node_mod)
        if kind in ("leaf-up", "leaf-down"):
            return (kind, idx % self._leaf_mod)
        return (kind, idx % self.unit)  # gpu-*, host-*: per rank


# ---------------------------------------------------------------------------------------------------------
# the simulation of one collective
# ---------------------------------------------------------------------------------------------------------
class _Sim:
    def __init__(self, cluster: Cluster, profile: BackendProfile, sym: Symmetry, timeline: bool,
                 rendezvous: bool = False):
        self.env = simpy.Environment()
        self.cluster = cluster
        self.profile = profile
        self.sym = sym
        self.net = Network(self.env, cluster, profile, canonical=sym.canonical if sym.unit < sym.p else None)
        self.mailbox: dict = {}
        self.timeline = timeline
        self.messages = 0
        # rendezvous: a send waits for the receiver's ready notice (profile.rendezvous); every rank simulated
        self.rendezvous = rendezvous


class _Deferred:
    """A send waiting for the receiver's ready notice; `.sent` fires when its last byte has left."""

    __slots__ = ("sent",)

    def __init__(self, env):
        self.sent = env.event()


class Rank:
    """What an algorithm sees of one rank."""

    def __init__(self, sim: _Sim, r: int, family: str):
        self.sim = sim
        self.env = sim.env
        self.r = r
        self.p = sim.cluster.ranks
        self.cluster = sim.cluster
        self.family = family
        self.pending: list = []
        self.bytes_sent = 0.0
        self.bytes_received = 0.0
        self.events: list | None = [] if sim.timeline else None
        self.finished = 0.0

    # ---- primitives ---------------------------------------------------------------------------------
    def _box(self, key) -> simpy.Event:
        box = self.sim.mailbox
        ev = box.pop(key, None)
        if ev is None:
            ev = self.env.event()
            box[key] = ev
        return ev

    def send(self, dst: int, nbytes: float, tag):
        """Hand nbytes for rank dst to the network; returns the Message (its .sent event fires when the
        last byte has left). Does not wait. In rendezvous mode the message is handed over only once dst's
        ready notice for this tag has arrived (at once if it already has)."""
        sim = self.sim
        delivered = self._box((self.r, dst, tag))
        if sim.rendezvous:
            notice = self._box((dst, self.r, ("ready", tag)))
            if notice.triggered:
                msg = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
            else:
                msg = _Deferred(self.env)

                def go(_ev, msg=msg):
                    real = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
                    real.sent.callbacks.append(lambda _e: msg.sent.succeed())

                notice.callbacks.append(go)
        else:
            msg = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
        sim.messages += 1
        self.bytes_sent += nbytes
        self.pending.append(msg.sent)
        if self.events is not None:
            t0 = self.env.now
            msg.sent.callbacks.append(
                lambda _ev: self.events.append(("send", t0, self.env.now, dst, nbytes)))
        return msg

    def recv(self, src: int, tag, nbytes: float) -> simpy.Event:
        """The event of the message from rank src with this tag arriving here."""
        s, d = self.sim.sym.to_rep(src, self.r)
        ev = self._box((s, d, tag))
        if self.sim.rendezvous:  # tell src we are ready: a control message on our connection to src
            self.sim.net.submit(self.r, src, 0.0, self.family, self._box((d, s, ("ready", tag))))
        self.bytes_received += nbytes
        if self.events is not None:
            t0 = self.env.now
            ev.callbacks.append(lambda _ev: self.events.append(("recv", t0, self.env.now, src, nbytes)))
        return ev

    def reduce(self, nbytes: float):
        """Sum nbytes of received data into the local buffer (gamma * nbytes seconds)."""
        gamma = self.sim.profile.gamma
        if gamma > 0 and nbytes > 0:
            t0 = self.env.now
            yield self.env.timeout(gamma * nbytes)
            if self.events is not None:
                self.events.append(("reduce", t0, self.env.now, None, nbytes))

    def sendrecv(self, dst: int, src: int, nbytes: float, tag, recv_bytes: float | None = None):
        """Send to dst and receive from src at the same time; wait for both (MPI_Sendrecv)."""
        msg = self.send(dst, nbytes, tag)
        ev = self.recv(src, tag, nbytes if recv_bytes is None else recv_bytes)
        yield self.env.all_of([msg.sent, ev])

    def slices(self, chunk: float) -> list[float]:
        s = self.sim.profile.slice_bytes
        if s is None or chunk <= s:
            return [chunk]
        m = math.ceil(chunk / s)
        return [chunk / m] * m

    def flush(self):
        """Wait until every message this rank sent has left."""
        waiting = [e for e in self.pending if not e.processed]
        self.pending = []
        if waiting:
            yield self.env.all_of(waiting)


# ---------------------------------------------------------------------------------------------------------
# algorithms: fn(ctx, n) generators; n follows the SIZE convention
# ---------------------------------------------------------------------------------------------------------
def _ring(ctx: Rank, members: list[int], chunk: float, steps: int, reduce_steps: int, label):
    """A ring over `members`: each step sends a chunk to the next member and receives one from the
    previous; the first `reduce_steps` received chunks are summed in. Reduce-scatter is (q-1, q-1),
    all-gather (q-1, 0), allreduce (2(q-1), q-1)."""
    q = len(members)
    if q == 1 or steps == 0:
        return
    i = members.index(ctx.r)
    nxt, prv = members[(i + 1) % q], members[(i - 1) % q]
    parts = ctx.slices(chunk)
    for j, s in enumerate(parts):
        ctx.send(nxt, s, (label, 0, j))
    for k in range(steps):
        for j, s in enumerate(parts):
            yield ctx.recv(prv, (label, k, j), s)
            if k < reduce_steps:
                yield from ctx.reduce(s)
            if k + 1 < steps:
                ctx.send(nxt, s, (label, k + 1, j))


def allreduce_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, 2 * (p - 1), p - 1, "ar")


def reducescatter_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, p - 1, p - 1, "rs")


def allgather_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, p - 1, 0, "ag")


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


def _binomial(r: int, p: int) -> tuple[int | None, list[int]]:
    """Parent and children (smallest subtree first) of rank r in a binomial tree rooted at 0."""
    children, d = [], 1
    while d < p:
        if r & d:
            return r - d, children
        if r + d < p:
            children.append(r + d)
        d *= 2
    return None, children


def _tree_reduce(ctx, n, label):
    parent, children = _binomial(ctx.r, ctx.p)
    for j, s in enumerate(ctx.slices(n)):
        for c in children:
            yield ctx.recv(c, (label, j), s)
            yield from ctx.reduce(s)
        if parent is not None:
            ctx.send(parent, s, (label, j))


def _tree_broadcast(ctx, n, label):
    parent, children = _binomial(ctx.r, ctx.p)
    for j, s in enumerate(ctx.slices(n)):
        if parent is not None:
            yield ctx.recv(parent, (label, j), s)
        for c in reversed(children):  # largest subtree first, one after the other
            yield ctx.send(c, s, (label, j)).sent


def allreduce_binomial_tree(ctx, n):
    yield from _tree_reduce(ctx, n, "reduce")
    yield from _tree_broadcast(ctx, n, "bcast")


def reduce_binomial_tree(ctx, n):
    yield from _tree_reduce(ctx, n, "reduce")


def broadcast_binomial_tree(ctx, n):
    yield from _tree_broadcast(ctx, n, "bcast")


def allreduce_hierarchical(ctx, n):
    """Reduce-scatter inside the node, ring allreduce of the node's 1/G share between nodes (G rings at
    once, one per local index, sharing the NIC), all-gather inside the node."""
    g, nodes = ctx.cluster.gpus_per_node, ctx.cluster.nodes
    node, local = divmod(ctx.r, g)
    inside = [node * g + i for i in range(g)]
    across = [m * g + local for m in range(nodes)]
    yield from _ring(ctx, inside, n / g, g - 1, g - 1, "h-rs")
    yield from _ring(ctx, across, n / g / nodes, 2 * (nodes - 1), nodes - 1, "h-ar")
    yield from _ring(ctx, inside, n / g, g - 1, 0, "h-ag")


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


def allgather_ring_halves(ctx, n):
    """Gloo's ring all-gather: every step's block travels in two halves with at most two in flight, and
    each half's send is posted before its receive (its rendezvous form)."""
    p, r = ctx.p, ctx.r
    nxt, prv = (r + 1) % p, (r - 1) % p
    half = n / p / 2
    done = []
    for i in range(2 * (p - 1)):
        if i >= 2:
            yield done[i - 2]
        msg = ctx.send(nxt, half, ("ag2", i))
        done.append(ctx.env.all_of([msg.sent, ctx.recv(prv, ("ag2", i), half)]))
    yield ctx.env.all_of(done[-2:])


def allreduce_ring_segmented(ctx, n):
    """Gloo's ring all-reduce (gloo/allreduce.cc): the buffer is cut into segments of at most slice_bytes,
    at least two per rank's chunk and a multiple of p in all; a reduce-scatter then an all-gather, each
    p-1 chunks long, with two segments in flight: iteration i posts the receive of segment i, then its
    send, and waits for (and reduces) the segment of iteration i-2 (its rendezvous form)."""
    p, r = ctx.p, ctx.r
    dst, src = (r - 1) % p, (r + 1) % p  # gloo sends to rank-1
    cap = ctx.sim.profile.slice_bytes or math.inf
    nseg = max(math.ceil(n / cap), 2 * p)
    nseg = -(-nseg // p) * p
    seg = n / nseg
    iters = nseg - nseg // p
    for phase, reduce in (("rs", True), ("ag", False)):
        inflight = []
        for i in range(iters + 2):
            if i >= 2:
                arrived, sent = inflight[i - 2]
                yield arrived
                if reduce:
                    yield from ctx.reduce(seg)
                yield sent
            if i < iters:
                arrived = ctx.recv(src, (phase, i), seg)
                inflight.append((arrived, ctx.send(dst, seg, (phase, i)).sent))


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


def _entry_order_matters(op: str, alg: str, p: int) -> bool:
    """Whether ranks entering one after another can serialize this rendezvous form: it must post a send
    before the receive from the same peer, on a connection that carries data both ways (the all-to-all;
    the ring all-gather only on 2 ranks, where the next rank is the previous one; the all-reduce posts
    every receive first)."""
    return (op, alg) == ("alltoall", "all-at-once") or ((op, alg) == ("allgather", "ring") and p == 2)


def _symmetry_kind(op: str, alg: str, p: int) -> str | None:
    if alg in ("ring", "bruck", "pairwise", "all-at-once", "hierarchical"):
        return "cyclic"
    if alg in ("recursive-doubling", "rabenseifner", "halving"):
        return "xor" if _pow2(p) else None
    return None  # trees have a root


def check_algorithm(op: str, alg: str, cluster: Cluster) -> None:
    """Raise ValueError if `alg` cannot run `op` on this cluster."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown op {op!r}; choose one of: {', '.join(OPS)}")
    if alg not in ALGORITHMS[op]:
        raise ValueError(f"unknown {op} algorithm {alg!r}; choose one of: {', '.join(ALGORITHMS[op])}, auto")
    p = cluster.ranks
    if (op, alg) in (("allgather", "recursive-doubling"), ("reducescatter", "halving")) and not _pow2(p):
        raise ValueError(f"{op} {alg} needs a power-of-two number of ranks, got {p}")


def _valid(op, alg, cluster) -> bool:
    try:
        check_algorithm(op, alg, cluster)
    except ValueError:
        return False
    return not (alg == "hierarchical" and cluster.gpus_per_node == 1)  # identical to ring


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------
@dataclass
class CollectiveResult:
    """One simulated collective (or composite).

    seconds: from the call on all ranks until the last rank is done.
    bytes_sent_per_rank / bytes_received_per_rank: payload bytes of the busiest rank.
    parts: for composites, one dict per collective issued (op, algorithm, size_bytes, seconds, ...).
    candidates: with algorithm "auto", the simulated seconds of every algorithm tried.
    timeline: if asked for, {rank: [(kind, start, end, peer, bytes), ...]} with kind send/recv/reduce.
    """

    op: str
    algorithm: str
    backend: str
    ranks: int
    size_bytes: float
    seconds: float
    bytes_sent_per_rank: float
    bytes_received_per_rank: float
    parts: list[dict] = field(default_factory=list)
    candidates: dict[str, float] | None = None
    timeline: dict[int, list[tuple]] | None = None
    messages: int = 0
    simulated_ranks: int = 0
    wall_seconds: float = 0.0

    @property
    def algbw(self) -> float:
        """size_bytes / seconds, bytes per second (nccl-tests' algbw)."""
        return self.size_bytes / self.seconds if self.seconds > 0 else math.inf

    @property
    def busbw(self) -> float | None:
        """algbw times nccl-tests' bus factor (primitives only), bytes per second."""
        return self.algbw * wire.bus_factor(self.op, self.ranks) if self.op in PRIMITIVES else None

    def to_dict(self) -> dict:
        d = {
            "op": self.op,
            "algorithm": self.algorithm,
            "backend": self.backend,
            "ranks": self.ranks,
            "size_bytes": self.size_bytes,
            "seconds": self.seconds,
            "bytes_sent_per_rank": self.bytes_sent_per_rank,
            "bytes_received_per_rank": self.bytes_received_per_rank,
            "algbw_bytes_per_s": self.algbw if self.seconds > 0 else None,
            "busbw_bytes_per_s": self.busbw if self.seconds > 0 else None,
            "parts": self.parts,
            "candidates": self.candidates,
            "messages": self.messages,
            "simulated_ranks": self.simulated_ranks,
        }
        if self.timeline is not None:
            d["timeline"] = {
                str(r): [dict(zip(("kind", "start", "end", "peer", "bytes"), e)) for e in evs]
                for r, evs in self.timeline.items()
            }
        return d


# ---------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------
def _run_primitive(cluster, profile, op, alg, nbytes, timeline=False, use_symmetry=True) -> CollectiveResult:
    t_wall = time.perf_counter()
    p = cluster.ranks
    if p == 1:
        res = CollectiveResult(op, alg, profile.name, p, nbytes, 0.0, 0.0, 0.0)
        res.timeline = {0: []} if timeline else None
        return res
    if profile.rendezvous and (op, alg) in RENDEZVOUS_FORMS:
        # Gloo's handshake: a fraction rendezvous_stagger of the calls with the ranks entering one after
        # another (every rank simulated), the others with all entering together.
        f = profile.rendezvous_stagger if _entry_order_matters(op, alg, p) else 0.0
        together = _run_rendezvous(cluster, profile, op, alg, nbytes, staggered=False, timeline=timeline,
                                   use_symmetry=use_symmetry)
        if f > 0:
            apart = _run_rendezvous(cluster, profile, op, alg, nbytes, staggered=True)
            together.seconds = (1 - f) * together.seconds + f * apart.seconds
        together.wall_seconds = time.perf_counter() - t_wall
        return together
    res = _run_once(cluster, profile, op, alg, nbytes, ALGORITHMS[op][alg], timeline=timeline,
                    use_symmetry=use_symmetry)
    res.wall_seconds = time.perf_counter() - t_wall
    return res


def _run_rendezvous(cluster, profile, op, alg, nbytes, staggered: bool, timeline: bool = False,
                    use_symmetry: bool = True) -> CollectiveResult:
    """The rendezvous form of op/alg. Together: every rank enters at once (representative ranks only, as
    the symmetry allows). Staggered: every rank simulated, rank r entering at r * gap, late enough for
    the ready notices of the ranks before it to have arrived; seconds then runs from the last rank's
    entry to the last rank's end (the gap is a device to order the entries, not a delay to charge)."""
    lat = max(cluster.latency, cluster.intra_latency)
    gap = profile.call_overhead + 2 * cluster.ranks * profile.message_overhead + 2 * lat + 1e-6 if staggered else 0.0
    return _run_once(cluster, profile, op, alg, nbytes, RENDEZVOUS_FORMS[op, alg], rendezvous=True, gap=gap,
                     timeline=timeline, use_symmetry=use_symmetry and not staggered)


def _run_once(cluster, profile, op, alg, nbytes, fn, rendezvous: bool = False, gap: float = 0.0,
              timeline: bool = False, use_symmetry: bool = True) -> CollectiveResult:
    """Simulate one call of fn on every (representative) rank, rank r entering at r * gap."""
    p = cluster.ranks
    kind = _symmetry_kind(op, alg, p) if use_symmetry else None
    sym = Symmetry.choose(cluster, kind)
    sim = _Sim(cluster, profile, sym, timeline, rendezvous=rendezvous)
    ranks = [Rank(sim, r, op) for r in sym.reps]
    start = {}

    def program(ctx):
        if gap:
            yield sim.env.timeout(ctx.r * gap)
        start[ctx.r] = sim.env.now
        if profile.call_overhead > 0:
            yield sim.env.timeout(profile.call_overhead)
        yield from fn(ctx, nbytes)
        yield from ctx.flush()
        ctx.finished = sim.env.now

    for ctx in ranks:
        sim.env.process(program(ctx))
    sim.env.run()
    if sim.mailbox:  # an algorithm bug: a send nobody received or a receive nobody sent
        raise RuntimeError(f"{op}/{alg}{' (rendezvous)' if rendezvous else ''}: {len(sim.mailbox)} unmatched messages")
    res = CollectiveResult(op, alg, profile.name, p, nbytes, max(c.finished for c in ranks) - max(start.values()),
                           max(c.bytes_sent for c in ranks), max(c.bytes_received for c in ranks))
    res.messages = sim.messages * sym.orbit_size
    res.simulated_ranks = len(ranks)
    if timeline:
        res.timeline = _expand_timeline(sym, ranks)
    return res


def _expand_timeline(sym: Symmetry, ranks: list[Rank]) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for a in range(sym.orbit_size):
        for ctx in ranks:
            r = sym.image(ctx.r, a)
            out[r] = sorted(
                ((kind, t0, t1, None if peer is None else sym.image(peer, a), nb)
                 for kind, t0, t1, peer, nb in ctx.events),
                key=lambda e: (e[1], e[2], e[0]),
            )
    return dict(sorted(out.items()))


class Cache:
    """Memo of simulated primitives, keyed by everything that determines them (cluster, profile contents,
    op, algorithm, size). A profile must not be changed while a cache that saw it is in use."""

    def __init__(self):
        self.results: dict = {}
        self._profiles: dict = {}

    def key(self, cluster, profile, op, alg, nbytes):
        import json

        pk = self._profiles.get(id(profile))
        if pk is None or pk[0] is not profile:
            pk = (profile, json.dumps(profile.to_dict(), sort_keys=True))
            self._profiles[id(profile)] = pk
        return (cluster, pk[1], op, alg, float(nbytes))


def _primitive(cluster, profile, op, alg, nbytes, cache: Cache | None, timeline=False, use_symmetry=True):
    if cache is None or timeline or not use_symmetry:
        return _run_primitive(cluster, profile, op, alg, nbytes, timeline, use_symmetry)
    k = cache.key(cluster, profile, op, alg, nbytes)
    if k not in cache.results:
        cache.results[k] = _run_primitive(cluster, profile, op, alg, nbytes)
    return cache.results[k]


def best_algorithm(cluster, profile, op, nbytes, cache=None, use_symmetry=True):
    """(algorithm, {candidate: seconds}) of the fastest algorithm the profile offers for `op`."""
    cands = [a for a in profile.candidates(op) if _valid(op, a, cluster)]
    if not cands:
        cands = [a for a in ALGORITHMS[op] if _valid(op, a, cluster)]
    times = {a: _primitive(cluster, profile, op, a, nbytes, cache, use_symmetry=use_symmetry).seconds
             for a in cands}
    best = min(cands, key=lambda a: (times[a], cands.index(a)))
    return best, times


def _parse_algorithm_spec(algorithm) -> dict | str:
    if isinstance(algorithm, dict):
        return dict(algorithm)
    if not isinstance(algorithm, str) or not algorithm:
        raise ValueError(f"algorithm must be a name, 'auto' or 'op=alg,...', got {algorithm!r}")
    if "=" in algorithm:
        spec = {}
        for item in algorithm.split(","):
            op, _, alg = item.partition("=")
            if not op.strip() or not alg.strip():
                raise ValueError(f"malformed algorithm spec {algorithm!r}; expected 'alltoall=pairwise,...'")
            spec[op.strip()] = alg.strip()
        return spec
    return algorithm


def composite_collectives(op: str, nbytes: float, ranks: int, levels: int | None = None) -> list[wire.Collective]:
    """The collectives lioncub issues for composite `op` on a bucket of nbytes of fp32."""
    n = composite_elements(int(nbytes))
    if op == "momentum-sync":
        return wire.momentum_sync_collectives(n) if ranks > 1 else []
    meth = methods.get(op)
    return meth.collectives(n, ranks, meth.resolve_levels(ranks, levels) if meth.uses_levels else 0)


def composite_elements(nbytes: int) -> int:
    """A composite op's SIZE is the bytes of the fp32 bucket it synchronizes: n = SIZE // 4 parameters."""
    return max(1, nbytes // 4)


def simulate_collective(
    cluster: Cluster,
    op: str,
    algorithm="auto",
    size_bytes=None,
    backend="nccl",
    timeline: bool = False,
    *,
    levels: int | None = None,
    use_symmetry: bool = True,
    cache: Cache | None = None,
) -> CollectiveResult:
    """Simulate one collective (or a lioncub composite) on `cluster`.

    op: allreduce, allgather, reducescatter, alltoall, broadcast, reduce, or a composite: vote-allgather,
        vote-1bit, vote-pbit, avg-pbit, l1-pbit, momentum-sync (lioncub.wire defines what they send).
    algorithm: an algorithm name (see ALGORITHMS), "auto" (the fastest the backend offers), or for
        composites "op=alg,op=alg" / a dict naming the algorithm of each collective they issue.
    size_bytes: the SIZE convention above; a number or a string like "256MiB".
    backend: "nccl", "gloo", "ideal" or a BackendProfile.
    timeline: also return every rank's send/recv/reduce intervals.
    levels: l1-pbit's number of levels (default: lioncub's default for the world size).
    use_symmetry: simulate representative ranks only where the symmetry allows (same result, faster).
    """
    from .units import parse_size

    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if size_bytes is None:
        raise ValueError("size_bytes is required")
    nbytes = parse_size(size_bytes)
    if not nbytes > 0:
        raise ValueError(f"size must be positive, got {size_bytes!r}")
    profile = get_profile(backend)
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of: {', '.join(OPS)}")
    spec = _parse_algorithm_spec(algorithm)
    cache = cache if cache is not None else Cache()

    if op in PRIMITIVES:
        if isinstance(spec, dict):
            raise ValueError(f"an 'op=alg' algorithm spec is for composite ops, not {op!r}")
        if spec == "auto":
            alg, times = best_algorithm(cluster, profile, op, nbytes, cache, use_symmetry)
            res = _primitive(cluster, profile, op, alg, nbytes, None if timeline else cache, timeline,
                             use_symmetry)
            res = dataclasses.replace(res, candidates=times)  # the cached object stays as it was
        else:
            check_algorithm(op, spec, cluster)
            res = _primitive(cluster, profile, op, spec, nbytes, cache, timeline, use_symmetry)
        return res

    # composite: each collective it issues, one after the other (each starts on an idle network)
    t_wall = time.perf_counter()
    colls = composite_collectives(op, nbytes, cluster.ranks, levels)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {c.op for c in colls})
        if unknown and colls:
            raise ValueError(f"{op} issues {', '.join(sorted({c.op for c in colls}))}; "
                             f"cannot set the algorithm of {', '.join(unknown)}")
    total = CollectiveResult(op, "", profile.name, cluster.ranks, nbytes, 0.0, 0.0, 0.0)
    total.timeline = {r: [] for r in range(cluster.ranks)} if timeline else None
    names = []
    for c in colls:
        want = spec.get(c.op, "auto") if isinstance(spec, dict) else spec
        if want == "auto":
            alg, times = best_algorithm(cluster, profile, c.op, c.nbytes, cache, use_symmetry)
        else:
            check_algorithm(c.op, want, cluster)
            alg, times = want, None
        part = _primitive(cluster, profile, c.op, alg, c.nbytes, cache, timeline, use_symmetry)
        if timeline:
            for r, evs in part.timeline.items():
                total.timeline[r] += [(k, t0 + total.seconds, t1 + total.seconds, peer, b)
                                      for k, t0, t1, peer, b in evs]
        total.parts.append({"op": c.op, "algorithm": alg, "dtype": c.dtype, "size_bytes": c.nbytes,
                            "seconds": part.seconds, "bytes_sent_per_rank": part.bytes_sent_per_rank,
                            "candidates": times})
        total.seconds += part.seconds
        total.bytes_sent_per_rank += part.bytes_sent_per_rank
        total.bytes_received_per_rank += part.bytes_received_per_rank
        total.messages += part.messages
        total.simulated_ranks = max(total.simulated_ranks, part.simulated_ranks)
        names.append(f"{c.op}:{alg}")
    total.algorithm = "+".join(names) or "none"
    total.wall_seconds = time.perf_counter() - t_wall
    return total


def simulate_transfers(cluster: Cluster, transfers, backend="ideal", family: str = "p2p") -> float:
    """Seconds until every (src, dst, nbytes) message, all sent at time 0, has arrived. For checking the
    network model directly (incast, oversubscription, window caps)."""
    profile = get_profile(backend)
    sim = _Sim(cluster, profile, Symmetry.full(cluster), False)
    done = []
    for src, dst, nbytes in transfers:
        for r in (src, dst):
            if not (isinstance(r, int) and 0 <= r < cluster.ranks):
                raise ValueError(f"rank {r!r} out of range for {cluster.ranks} ranks")
        if src == dst:
            raise ValueError(f"a transfer from rank {src} to itself")
        ev = sim.env.event()
        sim.net.submit(src, dst, float(nbytes), family, ev)
        done.append(ev)
    finished = []
    for ev in done:
        ev.callbacks.append(lambda _e: finished.append(sim.env.now))
    sim.env.run()
    return max(finished, default=0.0)
