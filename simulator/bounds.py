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
written with hops.py's building blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cluster import Cluster
from .hops import Hops
from .registry import get
from .symmetry import pow2

if TYPE_CHECKING:
    from .profiles import BackendProfile


def bound(cluster: Cluster, profile: BackendProfile, op: str, alg: str, nbytes: float) -> dict:
    """{"seconds": the bound, "chain": its latency-chain part, "bytes": its bottleneck-bytes part} for `alg`
    running `op` on nbytes; seconds = call_overhead + max(chain, bytes), 0 where there is no bound."""
    p = cluster.ranks
    none = {"seconds": 0.0, "chain": 0.0, "bytes": 0.0}
    if p == 1:
        return none
    rec = get(op, alg)
    of = rec.bound
    if profile.rendezvous and rec.rendezvous:
        if profile.rendezvous_stagger > 0 and rec.matters_in_order(p):
            return none
        of = rec.rendezvous_bound
    chain = nbytes_t = 0.0
    if of is not None and not (rec.pow2 and not pow2(p)):  # an algorithm that cannot run here: no bound
        chain, nbytes_t = of(Hops(cluster, profile, op), nbytes)
    return {"seconds": profile.call_overhead + max(chain, nbytes_t), "chain": chain, "bytes": nbytes_t}


def lower_bound(cluster: Cluster, profile: BackendProfile, op: str, alg: str, nbytes: float) -> float:
    """Seconds below which `alg` cannot run `op` on nbytes (0: no bound)."""
    return bound(cluster, profile, op, alg, nbytes)["seconds"]
