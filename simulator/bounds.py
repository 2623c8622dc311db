"""Lower bounds on an algorithm's simulated time, from the simulator's own mechanisms, so that `auto` can
skip a candidate that provably cannot win.

A bound is the larger of two things no simulation can beat:

* a **chain**: messages that must follow one another (a ring step forwards what the previous step
  delivered; a tree's root reduces before it broadcasts and sends its slices one after another). Each
  message on it costs at least the sender's `message_overhead`, its bytes at the fastest rate its path
  allows (the slowest link of the path at line rate, or at memory speed while a port holds burst credit;
  the window cap window/RTT), the path's latency, and the reductions the algorithm does before it
  forwards;
* the **bytes over a bottleneck link**: what the algorithm must push through one link, at the link's
  capacity, less the burst credit the link can pass at once.

Both start after `call_overhead`. A bound leaves out every mechanism that can only slow a run down
(sharing a link with other flows, host_bandwidth, a rendezvous); tests check bound <= simulated time
for every algorithm on many clusters and profiles. Algorithms in their rendezvous form with staggered
entry, whose time is counted from the last rank's entry, get no bound (0: always simulated).
"""

from __future__ import annotations

from .cluster import Cluster
from .network import BURST_SPEEDUP, NIC_LINKS, PORTS
from .profiles import BackendProfile
from .ranks import slices
from .registry import RENDEZVOUS_FORMS, entry_order_matters
from .symmetry import pow2


class Hops:
    """The cheapest a message can be on each kind of hop: inside a node, between nodes of one leaf (or on
    the switch), between leaves."""

    def __init__(self, cluster: Cluster, profile: BackendProfile, family: str):
        self.cluster = cluster
        self.profile = profile
        self.o = profile.message_overhead
        self.gamma = profile.gamma
        self.eff = profile.family_efficiency(family)
        g = cluster.gpus_per_node
        self.pairs = {}
        if g > 1:
            self.pairs["intra"] = (0, 1)
        if cluster.nodes > 1:
            if cluster.topology == "leaf-spine":
                if cluster.nodes_per_leaf > 1:
                    self.pairs["inter"] = (0, g)
                if cluster.leaves > 1:
                    self.pairs["cross"] = (0, g * cluster.nodes_per_leaf)
            else:
                self.pairs["inter"] = (0, g)
        self.rates = {kind: self._max_rate(*pair) for kind, pair in self.pairs.items()}
        self.latencies = {kind: cluster.path(*pair)[1] for kind, pair in self.pairs.items()}

    def _cost(self, link) -> float:
        if link[0] in NIC_LINKS:
            return self.cluster.nic_share / (self.eff * self.profile.wire_efficiency)
        return 1.0 / self.eff

    def _capacity(self, link) -> float:
        cap = self.cluster.link_capacity(link)
        if self.profile.link_burst > 0 and link[0] in PORTS:
            cap *= BURST_SPEEDUP
        return cap

    def _max_rate(self, a: int, b: int) -> float:
        """Payload bytes/s a connection a -> b gets alone on the network."""
        prof = self.profile
        links, lat = self.cluster.path(a, b)
        rate = min(self._capacity(link) / self._cost(link) for link in links)
        if prof.host_bandwidth is not None:
            rate = min(rate, prof.host_bandwidth * self.eff)
        if prof.window_bytes is not None and lat > 0:
            rate = min(rate, prof.channels * prof.window_bytes / (2.0 * lat))
        return rate

    def kind(self, a: int, b: int) -> str:
        return self.cluster.hop(a, b)

    def hop(self, kind: str, nbytes: float, reduce: bool = False) -> float:
        """o + transfer + latency (+ the reduction of what arrived) of one message on a hop of this kind."""
        return (self.o + nbytes / self.rates[kind] + self.latencies[kind]
                + (self.gamma * nbytes if reduce else 0.0))

    def cheapest(self, nbytes: float, reduce: bool = False) -> float:
        return min(self.hop(kind, nbytes, reduce) for kind in self.pairs)

    def link_time(self, kind_of_link: str, nbytes: float) -> float:
        """Seconds to push nbytes of payload through one link of this kind ("nic", "leaf", "gpu", "host"),
        less the burst credit a NIC port passes at once."""
        c, prof = self.cluster, self.profile
        link = {"nic": ("up", 0), "leaf": ("leaf-up", 0), "gpu": ("gpu-up", 0)}.get(kind_of_link)
        if link is None:  # host
            return nbytes / (prof.host_bandwidth * self.eff) if prof.host_bandwidth is not None else 0.0
        t = nbytes * self._cost(link) / c.link_capacity(link)
        if prof.link_burst > 0 and link[0] in PORTS:
            t -= prof.link_burst
        return max(0.0, t)


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


def ring(h: Hops, n: float, steps: int, reduce_steps: int) -> tuple[float, float]:
    c = h.cluster
    p = c.ranks
    chunk = n / p
    parts = slices(h.profile.slice_bytes, chunk)
    chain = _ring_chain(h, _ring_hops(c, steps, c.gpus_per_node), parts[0], reduce_steps, steps)
    return chain, _ring_bytes(h, steps * chunk, c.gpus_per_node)


def hierarchical(h: Hops, n: float) -> tuple[float, float]:
    """Three phases one after another: a ring inside the node, G rings between nodes, a ring inside."""
    c = h.cluster
    g, nodes = c.gpus_per_node, c.nodes
    t = nic = 0.0
    if g > 1:
        s = slices(h.profile.slice_bytes, n / g)[0]
        t += (g - 1) * h.hop("intra", s, reduce=True) + (g - 1) * h.hop("intra", s)
    if nodes > 1:
        chunk = n / g / nodes
        s = slices(h.profile.slice_bytes, chunk)[0]
        steps = 2 * (nodes - 1)
        counts = _ring_hops(c, steps, 1)
        counts.pop("intra", None)
        chain = _ring_chain(h, counts, s, nodes - 1, steps)
        nic = h.link_time("nic", g * steps * chunk)
        t += chain
    return t, t - chain + nic if nodes > 1 else 0.0


def tree_reduce(h: Hops, n: float) -> tuple[float, float]:
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
    s = slices(h.profile.slice_bytes, n)[-1]
    chain, r = 0.0, 0
    for ch in reversed(children):
        if r + ch < p:
            chain += h.hop(h.kind(r, r + ch), s, reduce=True)
            r += ch
    return chain, t


def tree_broadcast(h: Hops, n: float) -> float:
    """Rank 0 sends every slice to each child, waiting for each send to leave; the last then arrives."""
    c = h.cluster
    p = c.ranks
    children = [1 << i for i in range((p - 1).bit_length()) if (1 << i) < p]
    parts = slices(h.profile.slice_bytes, n)  # equal slices
    per_slice = sum(h.o + parts[0] / h.rates[h.kind(0, ch)] for ch in children)
    return len(parts) * per_slice + h.latencies[h.kind(0, children[0])]


def _rounds(h: Hops, sizes: list[float], reduce: bool, latency: bool = True) -> float:
    """Exchange rounds one after another: each costs at least a message (with its latency, if the peer's
    message cannot have left before the round began) and the reduction of what arrived."""
    if latency:
        return sum(h.cheapest(s, reduce) for s in sizes)
    return sum(min(h.o + s / h.rates[k] for k in h.pairs) + (h.gamma * s if reduce else 0.0) for s in sizes)


def doubling(h: Hops, op: str, alg: str, n: float) -> float:
    """Recursive doubling / halving: every rank of the power of two q starts round i no earlier than the
    earliest rank ended round i-1, so rounds add up. For other p (MPICH's folding) a folded rank's
    result comes back after the core: fold-in, its reduction and the core's rounds on the odd rank (whose
    peers may have sent early: its own sends only), then fold-out."""
    p = h.cluster.ranks
    q = 1 << (p.bit_length() - 1)
    lg = q.bit_length() - 1
    if alg in ("recursive-doubling", "rabenseifner") and op == "allreduce":
        if alg == "recursive-doubling":
            rounds = [([n] * lg, True)]
        else:
            rs = [n / 2 ** (i + 1) for i in range(lg)]
            rounds = [(rs, True), (list(reversed(rs)), False)]
        core = sum(_rounds(h, sz, red) for sz, red in rounds)
        if q == p:
            return core
        odd = h.cheapest(n) + h.gamma * n + sum(_rounds(h, sz, red, latency=False) for sz, red in rounds)
        return max(core, odd) + h.cheapest(n)
    if (op, alg) == ("reducescatter", "halving"):
        return _rounds(h, [n / 2 ** (i + 1) for i in range(lg)], True)
    block = n / p
    if (op, alg) == ("allgather", "recursive-doubling"):
        return _rounds(h, [block * 2**i for i in range(lg)], False)
    if (op, alg) == ("allgather", "bruck"):
        sizes, d = [], 1
        while d < p:
            sizes.append(min(d, p - d) * block)
            d *= 2
        return _rounds(h, sizes, False)
    return 0.0


def alltoall(h: Hops, alg: str, n: float) -> tuple[float, float]:
    c = h.cluster
    p, g = c.ranks, c.gpus_per_node
    piece = n / p
    if alg == "pairwise":
        chain = (p - 1) * h.cheapest(piece)
    else:  # all-at-once: p-1 sends through one communication thread, then the last one travels
        chain = (p - 1) * h.o + h.cheapest(piece) - h.o
    t = h.link_time("host", (p - 1) * piece)
    if c.nodes > 1:  # every NIC carries the node's G * (p - G) pieces out (and as many in)
        t = max(t, h.link_time("nic", g * (p - g) * piece))
    return chain, t


def bound(cluster: Cluster, profile: BackendProfile, op: str, alg: str, nbytes: float) -> dict:
    """{"seconds": the bound, "chain": its latency-chain part, "bytes": its bottleneck-bytes part} for `alg`
    running `op` on nbytes; seconds = call_overhead + max(chain, bytes), 0 where there is no bound."""
    p = cluster.ranks
    none = {"seconds": 0.0, "chain": 0.0, "bytes": 0.0}
    if p == 1:
        return none
    h = Hops(cluster, profile, op)
    chain = nbytes_t = 0.0
    if profile.rendezvous and (op, alg) in RENDEZVOUS_FORMS:
        if profile.rendezvous_stagger > 0 and entry_order_matters(op, alg, p):
            return none
        if (op, alg) == ("allreduce", "ring"):
            # Gloo's segmented ring moves the same bytes per hop as the ring: its bytes bound holds
            nbytes_t = _ring_bytes(h, 2 * (p - 1) * nbytes / p, cluster.gpus_per_node)
    elif alg == "ring":
        steps, red = {"allreduce": (2 * (p - 1), p - 1), "reducescatter": (p - 1, p - 1),
                      "allgather": (p - 1, 0)}[op]
        chain, nbytes_t = ring(h, nbytes, steps, red)
    elif alg == "hierarchical":
        chain, nbytes_t = hierarchical(h, nbytes)
    elif alg == "binomial-tree":
        # allreduce: the root reduces (bounded by its chain or its down links), then broadcasts
        red = tree_reduce(h, nbytes) if op in ("allreduce", "reduce") else (0.0, 0.0)
        bc = tree_broadcast(h, nbytes) if op in ("allreduce", "broadcast") else 0.0
        chain, nbytes_t = red[0] + bc, red[1] + bc
    elif op == "alltoall":
        chain, nbytes_t = alltoall(h, alg, nbytes)
    elif alg in ("recursive-doubling", "rabenseifner", "halving", "bruck"):
        if not (alg in ("recursive-doubling", "halving") and op != "allreduce" and not pow2(p)):
            chain = doubling(h, op, alg, nbytes)
    return {"seconds": profile.call_overhead + max(chain, nbytes_t), "chain": chain, "bytes": nbytes_t}


def lower_bound(cluster: Cluster, profile: BackendProfile, op: str, alg: str, nbytes: float) -> float:
    """Seconds below which `alg` cannot run `op` on nbytes (0: no bound)."""
    return bound(cluster, profile, op, alg, nbytes)["seconds"]
