"""Ring algorithms: allreduce, reduce-scatter and all-gather rings, the hierarchical allreduce (rings
inside and between nodes), and Gloo's ring forms (segmented allreduce, all-gather in half blocks); their
lower bounds and records.

Pipelining: a ring cuts every step's chunk into `profile.slice_bytes` slices and forwards each slice as
soon as it has arrived; with `slice_bytes=None` a step is one message and the next step starts when it
has arrived, which is the textbook step-by-step algorithm.
"""

from __future__ import annotations

import math

from ..net.cluster import Cluster
from .algorithm import Algorithm
from .bounds import Hops
from .ranks import Rank
from .steady import StepTags


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
    last = len(parts) - 1
    for j, s in enumerate(parts):
        ctx.send(nxt, s, (label, 0, j))
    k = 0
    while k < steps:
        for j, s in enumerate(parts):
            yield ctx.recv(prv, (label, k, j), s)
            if j == last and k >= 1:
                # the end of segment k (since the receipt of step k-1's last slice): steps alike in what
                # they reduce and send may be fast-forwarded
                kind = (label, *_step_kind(k, steps, reduce_steps, last))
                k += ctx.fast_forward(kind, _alike_ahead(k, steps, reduce_steps, last), StepTags(k))
            if k < reduce_steps:
                yield from ctx.reduce(s)
            if k + 1 < steps:
                ctx.send(nxt, s, (label, k + 1, j))
        k += 1


def _step_kind(k: int, steps: int, reduce_steps: int, last: int) -> tuple:
    """What segment k does: reduce step k-1's last slice, reduce step k's slices, send step k+1's
    (slices but the last; with one slice, send step k)."""
    return (k - 1 < reduce_steps, last > 0 and k < reduce_steps, k + 1 < steps if last > 0 else k < steps)


def _alike_ahead(k: int, steps: int, reduce_steps: int, last: int) -> int:
    """How many segments after k are of segment k's kind: up to the next step where one of _step_kind's
    terms changes (reduce_steps + 1, reduce_steps, steps - 1) or the last segment."""
    changes = [reduce_steps + 1, steps]
    if last > 0:
        changes += [reduce_steps, steps - 1]
    return min(c for c in changes if c > k) - k - 1


def allreduce_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, 2 * (p - 1), p - 1, "ar")


def reducescatter_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, p - 1, p - 1, "rs")


def allgather_ring(ctx, n):
    p = ctx.p
    yield from _ring(ctx, list(range(p)), n / p, p - 1, 0, "ag")


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


# ---- lower bounds (bounds.py) ---------------------------------------------------------------------------
def _ring_hops(cluster: Cluster, steps: int, per_node: int) -> dict:
    """How many of the hops m -> m+1, m = 0 .. steps-1, of a ring with `per_node` consecutive members in
    each node are inside a node, between nodes of a leaf, and between leaves."""
    if cluster.nodes == 1:
        return {"intra": steps}
    inter = steps // per_node if per_node > 1 else steps
    out = {"intra": steps - inter}
    if cluster.topology == "leaf-spine":
        per_leaf = per_node * cluster.nodes_per_leaf
        cross = steps // per_leaf if per_leaf > 1 else steps
        out["cross"] = cross
        out["inter"] = inter - cross
    else:
        out["inter"] = inter
    return out


def _ring_chain(h: Hops, counts: dict, s: float, reduce_steps: int, steps: int) -> float:
    """A slice going once round the ring: every hop of each kind, the first reduce_steps reduced."""
    t = 0.0
    for kind, k in counts.items():
        if k:
            t += k * h.hop(kind, s)
    return t + min(reduce_steps, steps) * h.gamma * s


def _ring_bytes(h: Hops, per_hop: float, g: int) -> float:
    """Every hop of the ring carries per_hop bytes: through a GPU port, a NIC, a leaf uplink, a host."""
    c = h.cluster
    t = h.link_time("host", per_hop)
    if g > 1:
        t = max(t, h.link_time("gpu", per_hop))
    if c.nodes > 1:
        t = max(t, h.link_time("nic", per_hop))
        if c.topology == "leaf-spine" and c.leaves > 1:
            t = max(t, h.link_time("leaf", per_hop))
    return t


def ring_bound(h: Hops, n: float, steps: int, reduce_steps: int) -> tuple[float, float]:
    """A ring of every rank, `steps` steps of n/p, the first `reduce_steps` received chunks reduced."""
    c = h.cluster
    p = c.ranks
    chunk = n / p
    parts = h.slices(chunk)
    chain = _ring_chain(h, _ring_hops(c, steps, c.gpus_per_node), parts[0], reduce_steps, steps)
    return chain, _ring_bytes(h, steps * chunk, c.gpus_per_node)


def hierarchical_bound(h: Hops, n: float) -> tuple[float, float]:
    """Three phases one after another: a ring inside the node, G rings between nodes, a ring inside."""
    c = h.cluster
    g, nodes = c.gpus_per_node, c.nodes
    t = nic = 0.0
    if g > 1:
        s = h.slices(n / g)[0]
        t += (g - 1) * h.hop("intra", s, reduce=True) + (g - 1) * h.hop("intra", s)
    if nodes > 1:
        chunk = n / g / nodes
        s = h.slices(chunk)[0]
        steps = 2 * (nodes - 1)
        counts = _ring_hops(c, steps, 1)
        counts.pop("intra", None)
        chain = _ring_chain(h, counts, s, nodes - 1, steps)
        nic = h.link_time("nic", g * steps * chunk)
        t += chain
    return t, t - chain + nic if nodes > 1 else 0.0


def segmented_bound(h: Hops, n: float) -> tuple[float, float]:
    """Gloo's segmented ring moves the same bytes per hop as the ring: its bytes bound holds (no chain: the
    handshakes are left out)."""
    p = h.p
    return 0.0, _ring_bytes(h, 2 * (p - 1) * n / p, h.cluster.gpus_per_node)


# ---- the algorithms -------------------------------------------------------------------------------------
ALLREDUCE_RING = Algorithm(
    "allreduce", "ring", allreduce_ring, symmetry="cyclic", libraries=("nccl", "gloo"),
    bound=lambda h, n: ring_bound(h, n, 2 * (h.p - 1), h.p - 1),
    rendezvous=allreduce_ring_segmented, rendezvous_bound=segmented_bound)
ALLREDUCE_HIERARCHICAL = Algorithm(
    "allreduce", "hierarchical", allreduce_hierarchical, symmetry="cyclic", bound=hierarchical_bound,
    redundant_on=lambda cluster: cluster.gpus_per_node == 1)  # one GPU per node: the ring
REDUCESCATTER_RING = Algorithm(
    "reducescatter", "ring", reducescatter_ring, symmetry="cyclic", libraries=("nccl", "gloo"),
    bound=lambda h, n: ring_bound(h, n, h.p - 1, h.p - 1))
ALLGATHER_RING = Algorithm(
    "allgather", "ring", allgather_ring, symmetry="cyclic", libraries=("nccl", "gloo"),
    bound=lambda h, n: ring_bound(h, n, h.p - 1, 0),
    # on 2 ranks the next rank is the previous one: both directions share a connection
    rendezvous=allgather_ring_halves, entry_order_matters=lambda p: p == 2)
