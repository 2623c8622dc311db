"""The simulator's entry points: `simulate_collective` (a primitive or a lioncub composite) and
`simulate_transfers` (raw messages, for checking the network model).

    result = simulate_collective(Cluster(nodes=16, bandwidth="10Gbit", latency="1ms"),
                                 "allreduce", "ring", 256 * 2**20, backend="nccl")
    result.seconds, result.bytes_sent_per_rank, result.to_dict()

SIZE convention (`size_bytes`): the bytes of each rank's whole buffer: the allreduce / reduce-scatter /
broadcast / reduce input, the all-gather *output*, the all-to-all *send* buffer. For lioncub's composite
ops (`vote-1bit`, `l1-pbit`, `momentum-sync`, ...) it is the bytes of the fp32 bucket they synchronize
(`composite_elements`), and the collectives they issue are those of `lioncub.methods`.
"""

from __future__ import annotations

import dataclasses
import time

from lioncub import methods
from lioncub.comm import wire

from ..net.cluster import Cluster
from ..profiles import PRIMITIVES, BackendProfile, get_profile
from ..units import parse_size
from .choose import best_algorithm, choose
from .groups import Groups
from .primitive import Cache, primitive
from .ranks import Rank, Sim
from .registry import ALGORITHMS, check_algorithm
from .results import CollectiveResult
from .symmetry import Symmetry

MOMENTUM_SYNC = "momentum-sync"
# lioncub's composite ops: the methods with a codec (a dense method's collectives are primitives on its
# gradients) and the momentum sync
COMPOSITES = (*methods.COMPRESSED, MOMENTUM_SYNC)
OPS = PRIMITIVES + COMPOSITES

# re-exported: the names this module has always offered
__all__ = ["ALGORITHMS", "COMPOSITES", "OPS", "PRIMITIVES", "Cache", "CollectiveResult", "Rank",
           "Symmetry", "best_algorithm", "check_algorithm", "composite_collectives", "composite_elements",
           "method_collectives", "simulate_collective", "simulate_collectives", "simulate_transfers"]


def parse_algorithm_spec(algorithm) -> dict | str:
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


def composite_collectives(op: str, nbytes: float, ranks: int, levels: int | None = None, node_size: int = 0,
                          grad_dtype: str = "float32") -> list[wire.Collective]:
    """The collectives lioncub issues for composite `op` on a bucket of nbytes of fp32; with node_size G,
    those of the hierarchical layout (the method's `hierarchical_collectives`, levels resolved for the
    N/G voters; the momentum sync: an fp32 allreduce of the shard across nodes)."""
    n = composite_elements(int(nbytes))
    if op != MOMENTUM_SYNC:
        return method_collectives(methods.get(op), n, ranks, levels, node_size, grad_dtype)
    if node_size:
        shard = wire.shard_elements(n, node_size)
        return [dataclasses.replace(c, scope="cross") for c in wire.momentum_sync_collectives(shard)] \
            if ranks // node_size > 1 else []
    return wire.momentum_sync_collectives(n) if ranks > 1 else []


def method_collectives(meth: methods.Method, n: int, ranks: int, levels: int | None = None, node_size: int = 0,
                       grad_dtype: str = "float32") -> list[wire.Collective]:
    """The collectives method `meth` issues for a bucket of n parameters on `ranks` ranks (its `collectives`);
    with node_size G, in the hierarchical layout (its `hierarchical_collectives`, levels resolved for the N/G
    voters)."""
    voters = ranks // node_size if node_size else ranks
    lv = meth.resolve_levels(voters, levels) if meth.uses_levels else 0
    if node_size:
        return meth.hierarchical_collectives(n, ranks, node_size, lv, grad_dtype)
    return meth.collectives(n, ranks, lv, grad_dtype)


def composite_elements(nbytes: int) -> int:
    """A composite op's SIZE is the bytes of the fp32 bucket it synchronizes: n = SIZE // 4 parameters."""
    return max(1, nbytes // 4)


def simulate_collective(cluster: Cluster, op: str, algorithm="auto", size_bytes=None, backend="nccl",
                        timeline: bool = False, *, levels: int | None = None, exact: bool = False,
                        use_symmetry: bool = True, cache: Cache | None = None, hierarchical: bool = False,
                        grad_dtype: str = "float32") -> CollectiveResult:
    """Simulate one collective (or a lioncub composite) on `cluster`.

    Args:
        cluster: the ranks and the network between them.
        op: allreduce, allgather, reducescatter, alltoall, broadcast, reduce, or a composite: vote-allgather,
            vote-1bit, vote-pbit, avg-pbit, l1-pbit, momentum-sync (lioncub.comm.wire defines what they send).
        algorithm: an algorithm name (see ALGORITHMS), "auto" (the fastest the backend offers), or for
            composites "op=alg,op=alg" / a dict naming the algorithm of each collective they issue.
        size_bytes: the SIZE convention above; a number or a string like "256MiB".
        backend: "nccl", "gloo", "ideal" or a BackendProfile.
        timeline: also return every rank's send/recv/reduce intervals.
        levels: l1-pbit's number of levels (default: lioncub's default for the world size).
        exact: simulate every rank and every message, and with "auto" every candidate (for checking the fast
            path: representative ranks where a symmetry allows, classes of ranks that behave alike, and
            candidates pruned by a lower bound).
        use_symmetry: False is the same as `exact=True`.
        cache: a memo of simulated primitives to share between calls; default: a new one.
        hierarchical: a composite in LionCub's hierarchical layout, nodes of cluster.gpus_per_node ranks
            (reduce-scatter of `grad_dtype` gradients inside each node, the method's collectives across
            nodes, all-gather inside: groups.py). bytes_sent_per_rank is then wire.traffic's.
        grad_dtype: the gradients' dtype of the hierarchical reduce-scatter.

    Returns:
        A CollectiveResult: `seconds` from the call on every rank until the last is done, the busiest rank's
        bytes, and with "auto" the candidates simulated and those pruned.

    Example:
        >>> cluster = Cluster(nodes=4, bandwidth="10Gbit", latency="50us")
        >>> r = simulate_collective(cluster, "allreduce", "ring", "16MiB", backend="ideal")
        >>> r.algorithm, r.bytes_sent_per_rank == 2 * 3 / 4 * 16 * 2**20
        ('ring', True)
    """
    exact = exact or not use_symmetry
    nbytes, profile, spec = _check_inputs(cluster, op, algorithm, size_bytes, backend)
    cache = cache if cache is not None else Cache()
    if op in PRIMITIVES:
        if hierarchical:
            raise ValueError(f"hierarchical is for lioncub's composite ops, not {op!r} (see its 'hierarchical' "
                             "algorithm)")
        return _simulate_primitive(cluster, profile, op, spec, nbytes, cache, timeline, exact)
    if hierarchical and timeline:
        raise ValueError("no timeline for the hierarchical layout")
    node_size = cluster.gpus_per_node if hierarchical else 0
    colls = composite_collectives(op, nbytes, cluster.ranks, levels, node_size, grad_dtype)
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {c.op for c in colls})
        if unknown and colls:
            raise ValueError(f"{op} issues {', '.join(sorted({c.op for c in colls}))}; "
                             f"cannot set the algorithm of {', '.join(unknown)}")
    return simulate_collectives(cluster, profile, op, colls, spec, nbytes, cache, exact=exact, timeline=timeline,
                                node_size=node_size)


def _check_inputs(cluster, op, algorithm, size_bytes, backend) -> tuple[float, BackendProfile, dict | str]:
    """(bytes, profile, algorithm spec) from simulate_collective's arguments, or ValueError."""
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
    spec = parse_algorithm_spec(algorithm)
    if op in PRIMITIVES and isinstance(spec, dict):
        raise ValueError(f"an 'op=alg' algorithm spec is for composite ops, not {op!r}")
    return nbytes, profile, spec


def _simulate_primitive(cluster, profile, op, alg, nbytes, cache, timeline, exact) -> CollectiveResult:
    """One primitive: the named algorithm, or with "auto" the fastest candidate (its result, with the
    times of the candidates simulated and the bounds of those pruned)."""
    if alg != "auto":
        check_algorithm(op, alg, cluster)
        return primitive(cluster, profile, op, alg, nbytes, cache, timeline, exact)
    c = choose(cluster, profile, op, nbytes, cache, exact)
    res = primitive(cluster, profile, op, c.algorithm, nbytes, None if timeline else cache, timeline, exact)
    return dataclasses.replace(res, candidates=c.seconds, pruned=c.pruned)  # the cached object stays as it was


def simulate_collectives(cluster: Cluster, profile: BackendProfile, name: str, colls: list[wire.Collective],
                         spec: dict | str, nbytes: float, cache: Cache, *, exact: bool = False,
                         timeline: bool = False, node_size: int = 0) -> CollectiveResult:
    """What a method issues for a bucket (or a composite op of nbytes): each collective of `colls`, one after
    the other (each starts on an idle network), on the group its scope names; the parts add up, reported as
    `name`. spec: an algorithm name, "auto", or {op: algorithm} (auto for the ops it leaves out). node_size:
    the hierarchical layout's G; bytes sent and received are then wire.traffic's."""
    t_wall = time.perf_counter()
    total = CollectiveResult(name, "", profile.name, cluster.ranks, nbytes, 0.0, 0.0, 0.0)
    total.timeline = {r: [] for r in range(cluster.ranks)} if timeline else None
    names = []
    for c in colls:
        want = spec.get(c.op, "auto") if isinstance(spec, dict) else spec
        pruned = None
        on, groups = _scope(cluster, c.scope, exact)
        if want == "auto":
            choice = choose(on, profile, c.op, c.nbytes, cache, exact, groups)
            alg, times, pruned = choice.algorithm, choice.seconds, choice.pruned
        else:
            check_algorithm(c.op, want, groups.topology(on) if groups else on)
            alg, times = want, None
        part = primitive(on, profile, c.op, alg, c.nbytes, cache, timeline, exact, groups)
        _add_part(total, c, alg, times, part, pruned)
        names.append(f"{c.op}:{alg}" if c.scope == "world" else f"{c.scope} {c.op}:{alg}")
    total.algorithm = "+".join(names) or "none"
    if node_size:
        total.bytes_sent_per_rank, total.bytes_received_per_rank = wire.traffic(colls, cluster.ranks, node_size)
    total.wall_seconds = time.perf_counter() - t_wall
    return total


def _scope(cluster: Cluster, scope: str, exact: bool) -> tuple[Cluster, Groups | None]:
    """Where a collective of this scope runs: (the cluster to simulate, the groups on it). The fast path
    simulates one group as its own cluster (groups.py), the exact run every group on the full cluster."""
    if scope == "world":
        return cluster, None
    groups = Groups(scope, cluster.gpus_per_node)
    return (cluster, groups) if exact else (groups.topology(cluster), None)


def _add_part(total: CollectiveResult, c: wire.Collective, alg: str, times, part: CollectiveResult,
              pruned: dict | None) -> None:
    """Append one issued collective to a composite's result (its timeline shifted to where it starts)."""
    if total.timeline is not None:
        for r, evs in part.timeline.items():
            total.timeline[r] += [(k, t0 + total.seconds, t1 + total.seconds, peer, b)
                                  for k, t0, t1, peer, b in evs]
    total.parts.append({"op": c.op, "scope": c.scope, "algorithm": alg, "dtype": c.dtype, "size_bytes": c.nbytes,
                        "seconds": part.seconds, "bytes_sent_per_rank": part.bytes_sent_per_rank,
                        "candidates": times, "pruned": pruned or None})
    total.seconds += part.seconds
    total.bytes_sent_per_rank += part.bytes_sent_per_rank
    total.bytes_received_per_rank += part.bytes_received_per_rank
    total.nic_bytes_per_node += part.nic_bytes_per_node
    total.messages += part.messages
    total.simulated_ranks = max(total.simulated_ranks, part.simulated_ranks)
    total.skipped_segments += part.skipped_segments


def simulate_transfers(cluster: Cluster, transfers, backend="ideal", family: str = "p2p") -> float:
    """Seconds until every (src, dst, nbytes) message, all sent at time 0, has arrived. For checking the
    network model directly (incast, oversubscription, window caps)."""
    profile = get_profile(backend)
    sim = Sim(cluster, profile, Symmetry.full(cluster), False)
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
