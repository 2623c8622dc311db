"""The search space, the search over it and the recommendation."""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import lioncub.methods as registry
from lioncub.comm import wire
from lioncub.optim import schedules
from lioncub.simulator import Cache, Cluster, get_profile, simulate_step
from lioncub.simulator.profiles import ALL_ALGORITHMS, BackendProfile
from lioncub.simulator.step.model import DDP_BUCKET_MB
from lioncub.simulator.units import format_size, format_time, parse_byte_rate, parse_size

from . import local_evidence
from .risk_rule import MEASURED_AT, _sync_steps, dense_warmup_for, risk

# ---------------------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------------------
DEFAULT_BUCKETS_MB = (4.0, 25.0, 100.0)
EVERY_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GEOMETRIC_KS = (2, 8, 32)
BASELINE_BUCKET_MB = DDP_BUCKET_MB  # the reference: PyTorch DDP's default bucket_cap_mb


def default_schedules(steps: int) -> list[str]:
    """none, every:K for K < steps, first:1:M and first:8:M with M = steps // 10, geometric:K, adaptive."""
    out = ["none"] + [f"every:{k}" for k in EVERY_KS if k < steps]
    m = steps // 10
    if m >= 2:
        out += [f"first:1:{m}"] + ([f"first:8:{m}"] if m > 8 else [])
    out += [f"geometric:{k}" for k in GEOMETRIC_KS]
    return out + ["adaptive"]


def normalize_schedule(text: str) -> str:
    """A schedule in `schedules.describe` form ("none", "every:K", "first:K:M", "geometric:K")."""
    return schedules.describe(schedules.parse(text))


MAX_LEVELS = 127  # Lion Cub's int8-motivated range: more levels than this buy no measurable accuracy


def l1_levels_candidates(ranks: int, extra_bits: int = 4) -> list[int]:
    """The default levels, then for each field up to `extra_bits` wider the most levels that fit in it
    (at most MAX_LEVELS)."""
    l1 = registry.get("l1-pbit")
    s0 = l1.resolve_levels(ranks)
    w0 = l1.layout(ranks, s0).width
    out = [s0]
    for w in range(w0 + 1, min(wire.MAX_FIELD_WIDTH, w0 + extra_bits) + 1):
        s = (2**w - 1) // (2 * ranks)
        if s > MAX_LEVELS:
            break
        if s > out[-1] and l1.layout(ranks, s).width == w:
            out.append(s)
    return out


NODE_VOTERS = ("hierarchical", "sharded")  # the layouts whose voters are the nodes (a node's mean gradient each)


def node_split(r, gpus_per_node: int) -> tuple[float, float]:
    """(bytes inside the node, bytes leaving it) per rank per step of a simulated step (a StepResult): what leaves
    is what crosses the node's NIC outwards (nic_bytes_per_node, from the simulated messages) shared by its G
    ranks; the rest of bytes_sent_per_rank goes to ranks of the same node. With one rank per node, all leaves."""
    if gpus_per_node <= 1:  # (bytes_sent_per_rank is the busiest rank's, the NIC's the mean node's: trees differ)
        return 0.0, r.bytes_sent_per_rank
    leaving = r.nic_bytes_per_node / gpus_per_node
    return max(0.0, r.bytes_sent_per_rank - leaving), leaving


def _bucket_layout(params: int, bucket_mb: float) -> tuple[int, int]:
    per = max(1, int(bucket_mb * 2**20 // 4))
    return (min(per, params), params // per if per < params else 1)


@dataclass
class Candidate:
    method: str
    levels: int | None
    momentum_sync: str
    bucket_mb: float
    # "flat"; "hierarchical": LionCub(hierarchical=True, node_size=gpus_per_node); "sharded": the model sharded by
    # FSDP2 inside each node, the method across nodes (lioncub.attach_fsdp; `lioncub train --method hsdp+<method>`)
    layout: str
    step_seconds: float
    compute_seconds: float
    codec_seconds: float
    optimizer_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    momentum_sync_seconds: float
    bytes_per_step: float  # sent per rank per step, syncs amortized (inside the node + leaving it)
    speedup: float  # over the reference baseline
    syncs_per_step: float
    collectives: list = field(default_factory=list)
    risk: dict = field(default_factory=dict)
    # the planned run's first dense steps: the adaptive guard's start, or the dense warm-up the config
    # recommends at medium or high risk (LionCub(dense_warmup=K)); each costs an allreduce step
    dense_steps: int = 0
    dense_step_seconds: float = 0.0  # one of them: an allreduce step in the same buckets
    run_step_seconds: float = 0.0  # the mean step over the planned run, dense steps included
    run_speedup: float = 0.0
    # fp32 parameters, gradients and momenta per rank, and that over an unsharded replica's; whether they fit the
    # search's memory_per_rank (candidates that do not are never ranked)
    memory_bytes_per_rank: float = 0.0
    memory_fraction: float = 1.0
    fits: bool = True
    # LionCub(local_steps=H[, fragments=F, outer_delay=D]): the outer exchange every H steps (streamed in F
    # fragments), its risk the measured one (local_evidence.py)
    local_steps: int | None = None
    fragments: int | None = None
    outer_delay: int | None = None
    # bytes_per_step split: what goes to ranks of the same node, and what leaves the node (its NIC's bytes over
    # its G ranks), per rank per step (node_split)
    bytes_inside_node_per_step: float = 0.0
    bytes_leaving_node_per_step: float = 0.0

    @property
    def dense(self) -> bool:
        """Gradient averaging (the baseline): no momentum sync, no convergence risk."""
        return registry.get(self.method).dense

    @property
    def deployable(self) -> bool:
        """Every configuration searched runs as it is (LionCub implements both layouts); kept for the
        JSON's readers."""
        return True

    @property
    def algorithms(self) -> dict:
        """What the backend chose per collective: {what: algorithm}."""
        out: dict = {}
        for c in self.collectives:
            out.setdefault(c["what"], [])
            if c["algorithm"] not in out[c["what"]]:
                out[c["what"]].append(c["algorithm"])
        return {k: "/".join(v) for k, v in out.items()}

    def algorithm_summary(self) -> str:
        """Compact: the method's collective algorithms, then the momentum sync's (e.g. 'a2a:all-at-once+ag:ring,
        sync:ring')."""
        short = lambda a: a.replace("allreduce:", "").replace("alltoall:", "a2a:").replace("allgather:", "ag:")
        algs = self.algorithms
        out = short(algs.get(self.method, "-"))
        if "momentum-sync" in algs:
            out += ", sync:" + short(algs["momentum-sync"])
        return out

    @property
    def sync_label(self) -> str:
        """The momentum sync, or the local steps as `lioncub bench`'s configurations write them."""
        if self.local_steps:
            return f"local:{self.local_steps}" + (f"+stream:{self.fragments}:{self.outer_delay}" if self.fragments
                                                  else "")
        return "-" if self.dense else self.momentum_sync

    def label(self) -> str:
        s = self.method + (f" s={self.levels}" if self.levels else "")
        if self.local_steps:
            s += f", {self.sync_label}"
        elif not self.dense:
            s += f", sync {self.momentum_sync}"
        return s + f", {self.bucket_mb:.3g} MiB, {self.layout}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["algorithms"] = self.algorithms
        d["deployable"] = self.deployable
        return d


@dataclass
class SearchResult:
    candidates: list[Candidate]  # every configuration, ranked by step time (risk not applied)
    ranked: list[Candidate]  # those within max_risk, fastest first
    baseline: dict  # the reference allreduce step (StepResult.to_dict())
    max_risk: float
    seconds: float
    collectives_simulated: int
    space: dict

    @property
    def recommendable(self) -> list[Candidate]:
        """The ranked configurations autotune recommends from. Sharding asks the user to wrap the model in FSDP2,
        and the step model leaves out FSDP's own overheads (padding, copies, NVLink contention), so the sharded
        ones count only where no unsharded configuration fits the memory."""
        return [c for c in self.ranked if c.layout != "sharded"] or self.ranked

    def best_per_method(self) -> list[Candidate]:
        """The fastest recommendable configuration of each method within the risk bound."""
        seen, out = set(), []
        for c in self.recommendable:
            if c.method not in seen:
                seen.add(c.method)
                out.append(c)
        return out

    def twin(self, c: Candidate, layout: str) -> Candidate | None:
        """The same configuration with another collective layout."""
        key = lambda x: (x.method, x.levels, x.momentum_sync, x.bucket_mb, x.local_steps, x.fragments, x.outer_delay)
        return next((x for x in self.candidates if x.layout == layout and key(x) == key(c)), None)


def _profile_for(profile: BackendProfile, algorithms: str) -> BackendProfile:
    if algorithms == "all":
        return profile.replace(algorithms={op: [a for a in algs if a != "hierarchical"]
                                           for op, algs in ALL_ALGORITHMS.items()})
    return profile


def search(cluster: Cluster, params: int, compute_seconds: float, *, backend="nccl", steps: int = 10_000,
           methods=registry.NAMES, bucket_mbs=DEFAULT_BUCKETS_MB, momentum_syncs=None, levels: int | None = None,
           algorithms: str = "backend", max_risk: float = math.inf, memory_bandwidth="2TB/s",
           beta2: float = 0.99, overlap: bool = True, cache: Cache | None = None,
           progress: bool = False, batch_size: int | None = None, lr: float | None = None,
           tuned_lr: float | None = None, memory_per_rank=None, local_steps=None, fragments=(),
           outer_delays=()) -> SearchResult:
    """Simulate every configuration of the search space and rank those within `max_risk` by step time.

    What `lioncub autotune` runs. Every configuration is costed by `lioncub.simulator.simulate_step` on
    `cluster`, with one `Cache` for the whole search (each distinct collective is simulated once). Phases:
    1. the space (methods x levels x buckets x layouts, and the sync schedules); 2. the baseline step; 3. each
    configuration's step, with each schedule's syncs; 4. rank within the risk bound.

    Args:
        cluster: the `lioncub.simulator.Cluster`.
        params: the model's parameter count.
        compute_seconds: forward + backward time per step.
        backend: "nccl", "gloo", "ideal" or a BackendProfile (e.g. loaded from a calibration file).
        steps: the planned run length (sync rates of first/geometric schedules, dense warm-up, the risk's u).
        methods: the method names to search (default: every registered method).
        bucket_mbs: the bucket sizes in MiB to search.
        momentum_syncs: schedule strings (default: `default_schedules(steps)`).
        levels: fix l1-pbit's levels (default: search `l1_levels_candidates`).
        algorithms: which collective algorithms `auto` chooses from, and the layouts: "backend" (the backend's
            algorithms; with several GPUs per node on several nodes each compressed method also in LionCub's
            node layout, and every method on a model sharded inside the node), "flat" (the flat layout only),
            "all" (every algorithm the simulator models, every layout).
        max_risk: the convergence-risk bound (`parse_max_risk("medium")`; infinity: no bound).
        memory_bandwidth: device memory bandwidth for the kernels' times (bytes/s or '2TB/s').
        beta2: Lion's beta2, which the risk rule reads.
        overlap: allreduce overlaps backward as DDP does (True), or runs after backward as
            `LionCub(method="allreduce")` does (False).
        cache: a simulator `Cache` to share with other searches.
        progress: show a progress bar.
        batch_size: the per-rank batch the risk rule reads (None: the tuned default).
        lr: the learning rate the risk rule reads (None: the tuned default).
        tuned_lr: the lr the model's allreduce baseline trains best at, which the rule reads lr against (None: the
            map's).
        memory_per_rank: bytes (or '40GiB') each rank has for the fp32 parameters, gradients and momenta; a
            configuration that needs more is never ranked (None: no bound).
        local_steps: also search local steps: "measured" (the configurations whose loss was measured,
            local_evidence.py), a list of H (each method, each layout, not streamed and streamed in each of
            `fragments`), or None. Their risk is the measured loss excess (the worst measured one where none was).
        fragments: with a list of H, each also streamed in each of these fragment counts F.
        outer_delays: with a list of H, each streamed configuration also with each of these outer_delay D (default:
            LionCub's own, 1); a D that F and H do not allow (D F >= H) is skipped.

    Returns:
        A `SearchResult`: every candidate, those within the bound fastest first (`ranked`), the baseline step;
        `recommend(result)` picks from it.

    Example:
        The fastest configuration within the default risk bound:

            cluster = Cluster.for_ranks(16, bandwidth="10Gbit", latency="50us")
            result = search(cluster, 124_000_000, 0.3, max_risk=parse_max_risk("medium"))
            best, verdict = recommend(result)
    """
    t0 = time.perf_counter()
    space = _space(cluster, params, steps, methods, bucket_mbs, momentum_syncs, levels, algorithms)
    profile = _profile_for(get_profile(backend), algorithms)
    cache = cache if cache is not None else Cache()
    step_kw = dict(compute_seconds=compute_seconds, backend=profile, memory_bandwidth=parse_byte_rate(memory_bandwidth),
                   overlap=overlap, cache=cache)
    base = simulate_step(cluster, registry.BASELINE, params, None, BASELINE_BUCKET_MB, **step_kw)
    inside, leaving = node_split(base, cluster.gpus_per_node)
    base_dict = dict(base.to_dict(), bytes_inside_node_per_rank=inside, bytes_leaving_node_per_rank=leaving)
    cands = _simulate_space(cluster, params, space, step_kw, base.step_seconds, steps, beta2, progress,
                            dict(batch_size=batch_size, lr=lr, tuned_lr=tuned_lr))
    locals_ = _local_space(space, local_steps, fragments, outer_delays)
    cands += [c for key in locals_ if (c := _local_candidate(cluster, params, key, step_kw, base.step_seconds))]
    space["local_steps"] = [list(k) for k in locals_]
    if memory_per_rank is not None:
        limit = parse_size(memory_per_rank)
        if not limit > 0:
            raise ValueError(f"memory_per_rank must be positive, got {memory_per_rank!r}")
        for c in cands:
            c.fits = c.memory_bytes_per_rank <= limit
    order = {m: i for i, m in enumerate(registry.NAMES)}
    cands.sort(key=lambda c: (c.run_step_seconds, c.risk["score"], c.bytes_per_step, order[c.method]))
    ranked = [c for c in cands if c.risk["score"] <= max_risk and c.fits]
    space = dict(space, algorithms=algorithms, steps=steps, memory_per_rank=memory_per_rank,
                 algorithm_candidates={op: profile.candidates(op) for op in ("allreduce", "allgather", "alltoall")})
    return SearchResult(cands, ranked, base_dict, max_risk, time.perf_counter() - t0, len(cache.results),
                        space)


def _space(cluster, params, steps, methods, bucket_mbs, momentum_syncs, levels, algorithms) -> dict:
    """The configurations to simulate, validated: methods, L1 levels, buckets, layouts, sync schedules."""
    if algorithms not in ("backend", "flat", "all"):
        raise ValueError(f"algorithms must be backend, flat or all, got {algorithms!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps (the planned run length) must be a positive integer, got {steps!r}")
    methods = [registry.check(m) for m in dict.fromkeys(methods)]
    if not methods:
        raise ValueError("no methods to search")
    N = cluster.ranks
    bucket_mbs = sorted({float(b) for b in bucket_mbs})
    if not bucket_mbs or any(not b > 0 for b in bucket_mbs):
        raise ValueError(f"bucket sizes must be positive MiB, got {bucket_mbs!r}")
    same: dict = {}  # sizes that cut the model the same way are one candidate: DDP's 25 MiB, else the smallest
    for b in bucket_mbs:
        same.setdefault(_bucket_layout(params, b), []).append(b)
    buckets = sorted(BASELINE_BUCKET_MB if BASELINE_BUCKET_MB in v else v[0] for v in same.values())
    scheds = list(dict.fromkeys(normalize_schedule(s) for s in (momentum_syncs or default_schedules(steps))))
    for s in scheds:
        if s.startswith("every:") and int(s.split(":")[1]) > steps:
            raise ValueError(f"momentum sync {s} never syncs in a {steps}-step run (--steps)")
    # LionCub's hierarchical layout (compressed methods) and the sharded one (every method; dense: FSDP2's own
    # HSDP): nodes of gpus_per_node ranks, N/G voters
    layouts = ["flat"]
    if algorithms != "flat" and cluster.gpus_per_node > 1 and cluster.nodes > 1:
        layouts += ["hierarchical", "sharded"]
    if levels is not None and (isinstance(levels, bool) or not isinstance(levels, int) or levels < 1):
        raise ValueError(f"levels must be a positive integer, got {levels!r}")
    l1_levels = {lay: _l1_levels(N if lay == "flat" else cluster.nodes, levels) for lay in layouts}
    return dict(ranks=N, node_size=cluster.gpus_per_node, methods=methods, l1_levels=l1_levels["flat"],
                bucket_mb=buckets, layouts=layouts, momentum_syncs=scheds, l1_levels_by_layout=l1_levels)


def _local_space(space: dict, local_steps, fragments, outer_delays=()) -> list[tuple]:
    """The local-step configurations to search: (method, layout, H, F, D), F and D None when not streamed, D None
    for LionCub's default."""
    if local_steps is None or local_steps == "none" or space["ranks"] == 1:
        return []
    layouts = [lay for lay in space["layouts"] if lay != "sharded"]  # (LionCub: no local steps on sharded models)
    if local_steps == "measured":
        if fragments or outer_delays:
            raise ValueError(f"{'fragments' if fragments else 'outer delays'} apply to the local steps given as a list "
                             "(--local-steps H,...): the measured configurations carry their own")
        return local_evidence.configurations(space["methods"], layouts)
    for name, values, low in (("local steps", local_steps, 1), ("fragments", fragments, 1),
                              ("outer delays", outer_delays, 0)):
        if any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise ValueError(f"{name} must be {'positive integers' if low else 'integers >= 0'}, got {list(values)!r}")
    streamed = lambda H, F: [(F, D) for D in (outer_delays or [None]) if D is None or D * F < H]
    return [(m, lay, H, *FD) for m in space["methods"] for lay in layouts
            if lay == "flat" or not registry.get(m).dense for H in local_steps
            for FD in [(None, None), *(fd for f in fragments if f <= H for fd in streamed(H, f))]]


def _local_candidate(cluster, params, key, step_kw, base_step) -> Candidate | None:
    """One local-step configuration in LionCub's automatic buckets (None where it cannot run: more fragments
    than buckets)."""
    m, lay, H, F, D = key
    bucket = wire.auto_bucket_mb(4 * params)
    if F is not None and F > math.ceil(params / max(1, int(bucket * 2**20 // 4))):
        return None
    r = simulate_step(cluster, m, params, None, bucket, local_steps=H, fragments=F, outer_delay=D,
                      hierarchical=lay == "hierarchical", **step_kw)
    step = r.step_seconds
    inside, leaving = node_split(r, cluster.gpus_per_node)
    return Candidate(
        method=m, levels=None, momentum_sync="none", bucket_mb=bucket, layout=lay, step_seconds=step,
        compute_seconds=r.compute_seconds, codec_seconds=r.codec_seconds, optimizer_seconds=r.optimizer_seconds,
        communication_seconds=r.communication_seconds, exposed_communication_seconds=r.exposed_communication_seconds,
        momentum_sync_seconds=0.0, bytes_per_step=r.bytes_sent_per_rank, speedup=base_step / step,
        syncs_per_step=0.0, collectives=r.collectives, risk=local_evidence.local_risk(m, lay, H, F, r.outer_delay),
        run_step_seconds=step, run_speedup=base_step / step, memory_bytes_per_rank=r.memory_bytes_per_rank,
        memory_fraction=r.memory_fraction, local_steps=H, fragments=r.fragments, outer_delay=r.outer_delay,
        bytes_inside_node_per_step=inside, bytes_leaving_node_per_step=leaving)


def _l1_levels(voters: int, levels: int | None) -> list[int]:
    """l1-pbit's levels to search for this many voters (N; the nodes in the hierarchical layout)."""
    l1 = registry.get("l1-pbit")
    if levels is not None:
        return [l1.resolve_levels(voters, levels)]  # raises if it cannot fit
    if voters <= MEASURED_AT:  # the risk rule gives more levels no benefit here: they would only cost bytes
        return [l1.resolve_levels(voters)]
    return l1_levels_candidates(voters)


def _risk(method, levels, sync, layout, space, steps, beta2, share, regime) -> dict:
    """The convergence risk of a configuration. In the hierarchical layout a node votes as one voter with G
    times the per-rank batch: N/G voters of batch G x b (what the map's regimes are in)."""
    N, G, regime = space["ranks"], space["node_size"], dict(regime or {})
    if layout in NODE_VOTERS:
        N //= G
        if regime.get("batch_size"):
            regime["batch_size"] *= G
    return risk(method, N, levels, sync, steps, beta2, _share=share, **regime)


def _credit_bytes(r, layout: str, G: int) -> float:
    """The bytes per rank the adaptive guard's credit counts (LionCub._credit_bytes): those that leave the
    node in the hierarchical layout (the NIC's bytes over its G ranks), every byte sent in the flat one."""
    return r.nic_bytes_per_node / G if layout in NODE_VOTERS else r.bytes_sent_per_rank


def _guard_price(s: str, steps: int, beta2: float, warmup: int, step_bytes: float, dense_bytes: float,
                 sync_bytes: float) -> tuple[int, float]:
    """(dense steps, syncs per compressed step) of the adaptive guard `s` in a `steps`-step run after a
    dense warm-up of `warmup` steps, at worst: its whole byte credit spent on syncs (how many it makes
    depends on the ranks' agreement). As in LionCub, the run is dense until the later of the warm-up and
    the guard's start, and only the start's steps after the warm-up are charged to the credit."""
    sched = schedules.resolve(schedules.parse(s))
    start = sched.start_steps([(0.9, beta2)])  # LionCub's default beta1
    dense = min(steps, max(warmup, start))
    rest = steps - dense
    credit = sched.budget * step_bytes * rest - max(0, min(start, steps) - warmup) * dense_bytes
    if rest == 0 or sync_bytes <= 0 or credit < sync_bytes:
        return dense, 0.0
    return dense, min(rest, math.floor(credit / sync_bytes)) / rest


def _simulate_space(cluster, params, space, step_kw, base_step, steps, beta2, progress,
                    regime=None) -> list[Candidate]:
    """One Candidate per (method, levels, bucket, layout, schedule). Schedules other than every:K cost the
    no-sync step plus their syncs per step times one sync. The planned run's dense steps (the adaptive
    guard's start; the dense warm-up at medium or high risk) cost an allreduce step each."""
    groups = [(m, lv, b, lay) for m in space["methods"] for lay in space["layouts"]
              if lay != "hierarchical" or not registry.get(m).dense
              for lv in (space["l1_levels_by_layout"][lay] if registry.get(m).uses_levels else [None])
              for b in space["bucket_mb"]]
    bar = None
    if progress:
        from lioncub.optional import progress_bar

        bar = progress_bar(total=len(groups), desc="autotune", unit="group", file=sys.stderr, leave=False)
    memo = _Memo()
    cands: list[Candidate] = []
    try:
        for group in groups:
            cands += _group_candidates(cluster, params, group, space, step_kw, base_step, steps, beta2, regime, memo)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return cands


@dataclass
class _Memo:
    """What the groups of one search share: the risk rule's, the schedules' sync rates, the dense steps."""

    share: dict = field(default_factory=dict)
    rates: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)  # (bucket MiB, layout) -> a dense step


def _group_candidates(cluster, params, group, space, step_kw, base_step, steps, beta2, regime,
                      memo: _Memo) -> list[Candidate]:
    """The candidates of one (method, levels, bucket, layout): one per momentum-sync schedule."""
    m, lv, b, lay = group
    G, layout = cluster.gpus_per_node, dict(hierarchical=lay == "hierarchical", sharded=lay == "sharded")

    def sim(k):
        return simulate_step(cluster, m, params, k, b, levels=lv, **layout, **step_kw)

    if (b, lay) not in memo.dense:  # the dense steps: the gradients' allreduce (sharded: FSDP's HSDP) in them
        memo.dense[b, lay] = simulate_step(cluster, registry.BASELINE, params, None, b,
                                           sharded=lay == "sharded", **step_kw)
    dense = memo.dense[b, lay]
    r0 = sim(None)

    @functools.cache
    def per_sync() -> tuple[float, float, float, float]:
        """One sync's seconds, bytes sent, bytes the adaptive guard's credit counts and bytes leaving the node."""
        r1 = sim(1)
        return (r1.momentum_sync_seconds, r1.bytes_sent_per_rank - r0.bytes_sent_per_rank,
                _credit_bytes(r1, lay, G) - _credit_bytes(r0, lay, G), node_split(r1, G)[1] - node_split(r0, G)[1])

    out = []
    for s in (["none"] if registry.get(m).dense or cluster.ranks == 1 else space["momentum_syncs"]):
        rk = _risk(m, lv, s, lay, space, steps, beta2, memo.share, regime)
        # the dense warm-up the config recommends at this risk (none at low risk, as for allreduce; the guard's
        # start may run longer)
        n_dense = dense_warmup_for(rk["level"], steps)
        if s == "none":
            r, rate, extra_t, extra_b, extra_out = r0, 0.0, 0.0, 0.0, 0.0
        elif s.startswith("every:") and lay != "sharded":
            r = sim(int(s.split(":")[1]))
            rate, extra_t, extra_b, extra_out = 1.0 / r.momentum_sync, 0.0, 0.0, 0.0
        else:  # (the sharded step syncs after everything else: its every:K step is the no-sync step + sync / K)
            seconds, sent, credit, sync_leaving = per_sync()
            if s.startswith("adaptive"):
                n_dense, rate = _guard_price(s, steps, beta2, n_dense, _credit_bytes(r0, lay, G),
                                             _credit_bytes(dense, lay, G), credit)
            else:
                if s not in memo.rates:
                    memo.rates[s] = 1 / int(s[6:]) if s.startswith("every:") else len(_sync_steps(s, steps)) / steps
                rate = memo.rates[s]
            r, extra_t, extra_b, extra_out = r0, rate * seconds, rate * sent, rate * sync_leaving
        step = r.step_seconds + extra_t
        inside, leaving = node_split(r, G)
        leaving += extra_out
        run_step = (n_dense * dense.step_seconds + (steps - n_dense) * step) / steps
        out.append(Candidate(
            method=m, levels=lv, momentum_sync=s, bucket_mb=b, layout=lay, step_seconds=step,
            compute_seconds=r.compute_seconds, codec_seconds=r.codec_seconds, optimizer_seconds=r.optimizer_seconds,
            communication_seconds=r.communication_seconds + extra_t,
            exposed_communication_seconds=r.exposed_communication_seconds + extra_t,
            momentum_sync_seconds=r.momentum_sync_seconds + extra_t, bytes_per_step=r.bytes_sent_per_rank + extra_b,
            speedup=base_step / step if step > 0 else math.inf, syncs_per_step=rate, collectives=r.collectives,
            risk=rk, dense_steps=n_dense, dense_step_seconds=dense.step_seconds if n_dense else 0.0,
            run_step_seconds=run_step, run_speedup=base_step / run_step if run_step > 0 else math.inf,
            memory_bytes_per_rank=r.memory_bytes_per_rank, memory_fraction=r.memory_fraction,
            bytes_inside_node_per_step=max(0.0, inside + extra_b - extra_out), bytes_leaving_node_per_step=leaving))
    return out


# ---------------------------------------------------------------------------------------------------------
# recommendation
# ---------------------------------------------------------------------------------------------------------
def recommend(result: SearchResult, min_speedup: float = 1.10) -> tuple[Candidate | None, str]:
    """The configuration to run, from a search: the fastest within the risk bound, unless compression does not pay.

    Args:
        result: what `search` returned.
        min_speedup: a compressed configuration that beats the best allreduce configuration by less than this
            is not recommended: the baseline is.

    Returns:
        `(candidate, verdict)`: the `Candidate` to run (None when nothing is within the bound or fits the
        memory) and a verdict in words.
    """
    if not result.ranked:
        if not any(c.fits for c in result.candidates):
            return None, ("no configuration fits --memory-per-rank: the least memory is "
                          f"{format_size(min(c.memory_bytes_per_rank for c in result.candidates))} per rank")
        return None, ("no configuration is within --max-risk: raise it, or keep allreduce (risk 0) in --methods")
    pool = result.recommendable
    best = pool[0]
    ar = next((c for c in pool if c.dense and not c.local_steps), None)
    if result.space.get("ranks") == 1:
        verdict = "one rank: nothing is communicated and every method is plain Lion. Use allreduce."
    elif best.local_steps:
        ref = f" ({ar.run_step_seconds / best.run_step_seconds:.2f}x the best-tuned allreduce)" if ar else ""
        verdict = (f"local steps pay: {best.label()} is {best.speedup:.2f}x the default allreduce step{ref}, "
                   f"{best.risk['level']} convergence risk ({best.risk['score']:.2f}): loss {best.risk['evidence']}.")
    elif best.dense:
        verdict = (f"compression does not pay here: the allreduce baseline is fastest "
                   f"({format_time(best.step_seconds)}/step: its communication hides behind backward as well as "
                   f"the compressed methods' does, and they add codec time). Use allreduce.")
    elif ar is not None and ar.run_step_seconds / best.run_step_seconds < min_speedup:
        verdict = (f"compression does not pay enough: the best compressed configuration ({best.label()}) is only "
                   f"{ar.run_step_seconds / best.run_step_seconds:.2f}x faster than allreduce (< --min-speedup "
                   f"{min_speedup:g}) for {best.risk['level']} convergence risk. Use allreduce.")
        best = ar
    else:
        ref = ar.step_seconds / best.step_seconds if ar is not None else None
        start = (f"; {best.run_speedup:.2f}x over the whole run, whose first {best.dense_steps} steps are dense"
                 if best.dense_steps else "")
        verdict = (f"{best.method} pays: {best.speedup:.2f}x the default allreduce step"
                   + (f" ({ref:.2f}x the best-tuned allreduce)" if ref else "") + start
                   + f", {best.risk['level']} convergence risk ({best.risk['score']:.2f}).")
    notes = _layout_notes(result, best)
    local = next((c for c in result.candidates if c.local_steps and c.fits and c not in result.ranked), None)
    if local is not None and local.run_step_seconds < best.run_step_seconds:
        gain = best.run_step_seconds / local.run_step_seconds
        notes.append(f"local steps ({local.label()}) are forecast {gain:.2f}x faster, but over --max-risk: loss "
                     f"{local.risk['evidence']} (--max-risk high accepts it)")
    if notes:
        verdict += " Note: " + "; ".join(notes) + "."
    return best, verdict


def _layout_notes(result: SearchResult, best: Candidate) -> list[str]:
    """What the recommended layout gains over the same configuration flat, or that flat does not fit; what a
    sharded one holds per rank."""
    notes = []
    if best.layout in NODE_VOTERS and (flat := result.twin(best, "flat")) is not None:
        notes.append(f"the {best.layout} layout (nodes of {result.space['node_size']}) is "
                     f"{flat.step_seconds / best.step_seconds:.2f}x faster than the same configuration flat"
                     if flat.fits else f"the flat layout needs {format_size(flat.memory_bytes_per_rank)} per rank, "
                     f"more than --memory-per-rank")
    if best.layout == "sharded":
        notes.append(f"sharded, each rank holds {best.memory_fraction:.3f} of an unsharded replica's parameters, "
                     f"gradients and momenta ({format_size(best.memory_bytes_per_rank)}): no unsharded "
                     f"configuration fits --memory-per-rank")
    elif (top := result.ranked[0]).layout == "sharded" and top.step_seconds < best.step_seconds:
        notes.append(f"sharded ({top.label()}, the model wrapped in FSDP2: lioncub.attach_fsdp) is forecast "
                     f"{best.step_seconds / top.step_seconds:.2f}x faster, with {top.memory_fraction:.3f} of the "
                     f"memory; recommended only when memory requires it (FSDP's own overheads are not modelled)")
    return notes
