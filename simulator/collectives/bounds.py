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

Each algorithm's bound is part of its record (algorithm.Algorithm.bound, in the module of its program),
written with this module's building blocks: the cheapest a message can be on each kind of hop (`Hops`), the time
to push bytes through one link, exchange rounds one after another (`rounds`). `choose.bound` looks a record's
bound up and applies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..net.cluster import Cluster
from ..net.network import BURST_SPEEDUP, NIC_LINKS, PORTS
from .ranks import slices

if TYPE_CHECKING:
    from ..profiles import BackendProfile


class Hops:
    """The cheapest a message can be on each kind of hop: inside a node, between nodes of one leaf (or on
    the switch), between leaves."""

    def __init__(self, cluster: Cluster, profile: BackendProfile, family: str):
        self.cluster = cluster
        self.p = cluster.ranks
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

    def slices(self, chunk: float) -> list[float]:
        """The slices the ranks cut a chunk into (the profile's pipelining)."""
        return slices(self.profile.slice_bytes, chunk)

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


def rounds(h: Hops, sizes: list[float], reduce: bool, latency: bool = True) -> float:
    """Exchange rounds one after another: each costs at least a message (with its latency, if the peer's
    message cannot have left before the round began) and the reduction of what arrived."""
    if latency:
        return sum(h.cheapest(s, reduce) for s in sizes)
    return sum(min(h.o + s / h.rates[k] for k in h.pairs) + (h.gamma * s if reduce else 0.0) for s in sizes)
