"""Simulating one primitive collective: every (representative) rank runs the algorithm's program on one
SimPy environment and network; plain and rendezvous forms; a memo (Cache) of simulated primitives."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager

from .groups import CrossGroup, GroupRank, whole_cluster
from .ranks import Rank, Sim
from .registry import ALGORITHMS
from .results import CollectiveResult
from .symmetry import Symmetry

STAGGER_EXACT_RANKS = 512  # the staggered run of a cross group simulates every group up to this many ranks


@contextmanager
def _no_gc():
    """The cyclic garbage collector paused while a simulation runs (its repeated passes over a growing
    heap of short-lived events cost a third of a tree's time), then one pass over what the run left."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
            gc.collect(0)


def _run_primitive(cluster, profile, op, alg, nbytes, timeline=False, exact=False, groups=None) -> CollectiveResult:
    """Simulate op/alg once. exact: every rank, every message (no representative ranks). groups: run it on
    every group of a scope at once, every rank simulated (groups.py), None: on all ranks."""
    with _no_gc():
        return _run_primitive_gc_off(cluster, profile, op, alg, nbytes, timeline, exact, groups)


def _run_primitive_gc_off(cluster, profile, op, alg, nbytes, timeline, exact, groups) -> CollectiveResult:
    t_wall = time.perf_counter()
    p = groups.size(cluster) if groups else cluster.ranks
    if p == 1:
        res = CollectiveResult(op, alg, profile.name, p, nbytes, 0.0, 0.0, 0.0)
        res.timeline = {0: []} if timeline else None
        return res
    rec = ALGORITHMS[op][alg]
    if profile.rendezvous and rec.rendezvous:
        # Gloo's handshake: a fraction rendezvous_stagger of the calls with the ranks entering one after
        # another (every rank simulated), the others with all entering together.
        f = profile.rendezvous_stagger if rec.matters_in_order(p) else 0.0
        together = _run_rendezvous(cluster, profile, op, alg, nbytes, staggered=False, timeline=timeline,
                                   exact=exact, groups=groups)
        if f > 0:
            on, every = _every_group(cluster, groups)
            apart = _run_rendezvous(on, profile, op, alg, nbytes, staggered=True, groups=every)
            together.seconds = (1 - f) * together.seconds + f * apart.seconds
        together.wall_seconds = time.perf_counter() - t_wall
        return together
    res = None
    if rec.by_classes and not (exact or timeline or groups):
        res = rec.by_classes(cluster, profile, op, nbytes)
    if res is None:
        res = _run_once(cluster, profile, op, alg, nbytes, rec.program, timeline=timeline, exact=exact,
                        groups=groups)
    res.wall_seconds = time.perf_counter() - t_wall
    return res


def _run_rendezvous(cluster, profile, op, alg, nbytes, staggered: bool, timeline: bool = False,
                    exact: bool = False, groups=None) -> CollectiveResult:
    """The rendezvous form of op/alg. Together: every rank enters at once (representative ranks only, as
    the symmetry allows). Staggered: every rank simulated, the ranks entering `gap` apart (`_entry_slot`: the
    nodes taking turns), late enough for the ready notices of the ranks before each to have arrived; seconds
    then runs from the last rank's entry to the last rank's end (the gap is a device to order the entries, not
    a delay to charge)."""
    lat = max(cluster.latency, cluster.intra_latency)
    gap = profile.call_overhead + 2 * cluster.ranks * profile.message_overhead + 2 * lat + 1e-6 if staggered else 0.0
    return _run_once(cluster, profile, op, alg, nbytes, ALGORITHMS[op][alg].rendezvous, rendezvous=True, gap=gap,
                     timeline=timeline, exact=exact or staggered, groups=groups)


def _run_once(cluster, profile, op, alg, nbytes, fn, rendezvous: bool = False, gap: float = 0.0,
              timeline: bool = False, exact: bool = False, groups=None) -> CollectiveResult:
    """Simulate one call of fn on every (representative) rank, entering at `_entry_slot` * gap (on groups: every
    group at once, its members in turn)."""
    p = cluster.ranks
    if groups is not None and timeline:
        raise ValueError("no timeline for collectives on sub-groups")
    # groups: every rank of every group (the exact run: groups.py)
    sym = Symmetry.choose(cluster, None if exact or groups else ALGORITHMS[op][alg].symmetry)
    sim = Sim(cluster, profile, sym, timeline, rendezvous=rendezvous, fast=not exact)
    procs = [Rank(sim, r, op) for r in sym.reps]
    ranks = procs if groups is None else [GroupRank(c, groups, cluster) for c in procs]
    start = {}

    def program(ctx):
        if gap:
            yield sim.env.timeout(_entry_slot(cluster, ctx, groups) * gap)
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
    # each representative stands for orbit_size ranks that send as it does
    res.nic_bytes_per_node = sum(c.bytes_out for c in ranks) * sym.orbit_size / cluster.nodes * cluster.nic_share
    res.messages = sim.messages * sym.orbit_size
    res.simulated_ranks = len(ranks)
    res.skipped_segments = sim.skipped
    if timeline:
        res.timeline = _expand_timeline(sym, ranks)
    return res


def _every_group(cluster, groups) -> tuple:
    """(cluster, groups) of a staggered run: a cross group simulated alone (groups.CrossGroup) stands for its
    node's G groups in lockstep, which entering in turns they are not; up to STAGGER_EXACT_RANKS ranks every
    group is simulated on the whole cluster."""
    if groups is None and isinstance(cluster, CrossGroup) and cluster.share > 1 \
            and cluster.ranks * cluster.share <= STAGGER_EXACT_RANKS:
        return whole_cluster(cluster)
    return cluster, groups


def _entry_slot(cluster, ctx, groups) -> int:
    """The place of `ctx`'s rank in the staggered entry order: the nodes take turns (a rank's lateness does not
    depend on its node, so the ranks that enter early are not all one node's); in cross groups the G groups
    start at different nodes for the same reason."""
    if groups is None:
        return (ctx.r % cluster.gpus_per_node) * cluster.nodes + cluster.node_of(ctx.r)
    if groups.scope == "cross":
        return (ctx.r - ctx.rank.r % groups.node_size) % ctx.p
    return ctx.r


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
        self.bounds: dict = {}  # auto's lower bounds (choose.py)
        self.steps: dict = {}  # whole steps many calls share (the sharded layout's baseline: step/model.py)
        self._profiles: dict = {}

    def key(self, cluster, profile, op, alg, nbytes, groups=None):
        import json

        pk = self._profiles.get(id(profile))
        if pk is None or pk[0] is not profile:
            pk = (profile, json.dumps(profile.to_dict(), sort_keys=True))
            self._profiles[id(profile)] = pk
        return (cluster, pk[1], op, alg, float(nbytes), groups)


def primitive(cluster, profile, op, alg, nbytes, cache: Cache | None, timeline=False, exact=False, groups=None):
    """op/alg simulated, or from the cache (exact runs and timelines are not cached)."""
    if cache is None or timeline or exact:
        return _run_primitive(cluster, profile, op, alg, nbytes, timeline, exact, groups)
    k = cache.key(cluster, profile, op, alg, nbytes, groups)
    if k not in cache.results:
        cache.results[k] = _run_primitive(cluster, profile, op, alg, nbytes, groups=groups)
    return cache.results[k]
