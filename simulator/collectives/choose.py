"""`algorithm="auto"`: the fastest algorithm the backend offers for an op.

Candidates are simulated in the order of their lower bounds (`bound`: the record's, written with bounds.py's
building blocks), cheapest first. A candidate whose lower bound exceeds the best time simulated so far cannot win
and is not simulated: it is reported as pruned, with its bound and why. `exact=True` simulates every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..net.cluster import Cluster
from ..units import format_time
from .bounds import Hops
from .primitive import primitive
from .registry import ALGORITHMS, get, valid
from .symmetry import pow2

if TYPE_CHECKING:
    from ..profiles import BackendProfile

# times this close are a tie, which the backend's order breaks (float round-off must not pick); a bound
# must exceed the best time by more than that to prune
_TIE = 1e-9


@dataclass
class Choice:
    algorithm: str
    seconds: dict[str, float]  # the candidates simulated, in the backend's order
    pruned: dict[str, dict] = field(default_factory=dict)  # candidate -> {lower_bound, chain, bytes, reason}


def candidates(cluster, profile, op) -> list[str]:
    """The algorithms `auto` chooses from: the backend's, those that can run on this cluster."""
    cands = [a for a in profile.candidates(op) if valid(op, a, cluster)]
    return cands or [a for a in ALGORITHMS[op] if valid(op, a, cluster)]


def choose(cluster, profile, op, nbytes, cache=None, exact: bool = False, groups=None) -> Choice:
    """groups: choose for a collective run by every group of a scope at once (groups.py): the candidates
    are those that can run on one group, bounded on it as its own cluster."""
    seen = groups.topology(cluster) if groups else cluster
    cands = candidates(seen, profile, op)
    if exact or len(cands) == 1:
        times = {a: primitive(cluster, profile, op, a, nbytes, cache, exact=exact, groups=groups).seconds
                 for a in cands}
        return Choice(_fastest(cands, times), times)
    bounds = {a: _bound(seen, profile, op, a, nbytes, cache) for a in cands}
    order = sorted(cands, key=lambda a: (bounds[a]["seconds"], cands.index(a)))
    times: dict[str, float] = {}
    pruned: dict[str, dict] = {}
    best, best_t = None, math.inf
    for a in order:
        b = bounds[a]
        if b["seconds"] > best_t * (1 + 2 * _TIE):
            what = "latency chain" if b["chain"] >= b["bytes"] else "bytes over the bottleneck link"
            pruned[a] = {"lower_bound": b["seconds"], "chain": b["chain"], "bytes": b["bytes"],
                         "reason": f"lower bound {format_time(b['seconds'])} ({what}) > {best} simulated "
                                   f"{format_time(best_t)}"}
            continue
        times[a] = primitive(cluster, profile, op, a, nbytes, cache, groups=groups).seconds
        if times[a] < best_t:
            best, best_t = a, times[a]
    times = {a: times[a] for a in cands if a in times}
    return Choice(_fastest(list(times), times), times, pruned)


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


def _bound(cluster, profile, op, alg, nbytes, cache) -> dict:
    if cache is None:
        return bound(cluster, profile, op, alg, nbytes)
    key = cache.key(cluster, profile, op, alg, nbytes)
    got = cache.bounds.get(key)
    if got is None:
        got = cache.bounds[key] = bound(cluster, profile, op, alg, nbytes)
    return got


def _fastest(cands: list[str], times: dict) -> str:
    """The fastest candidate; among those within _TIE of it, the first in the backend's order."""
    t = min(times.values())
    return next(a for a in cands if times[a] <= t * (1 + _TIE))


def best_algorithm(cluster, profile, op, nbytes, cache=None, use_symmetry=True, exact: bool = False):
    """(algorithm, {candidate: seconds}) of the fastest algorithm the profile offers for `op` (the pruned
    candidates are left out; `choose` says which and why)."""
    c = choose(cluster, profile, op, nbytes, cache, exact=exact or not use_symmetry)
    return c.algorithm, c.seconds
