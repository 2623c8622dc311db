"""Training-step model: compute, codec kernels, communication and how much of it is exposed.

Every method is costed the same way: a bucket's exchange is the collectives the method issues for it (its
`collectives` in lioncub.methods, simulated one after another). Gradients are grouped into buckets of
`bucket_mb` MiB (in reverse layer order); a bucket's exchange can start once backward has produced it, and
buckets are exchanged one after another on one communication stream, overlapping the rest of backward.
Only the tail that outlasts backward is exposed. Then every rank runs the Lion update locally.

A dense method (the baseline, methods.BASELINE: PyTorch DDP, and LionCub's allreduce) averages the
gradients: nothing more. A method with a codec (methods.COMPRESSED) overlaps the same way
(lioncub.optim.overlap): per bucket encode (codec kernel) and its collectives; at the end of backward one
control allreduce (lioncub.comm.wire.CONTROL); then decode and update. Every K steps the momentum is averaged
with an fp32 allreduce of all parameters (bucketed the same way) after the update; that cost is amortized as
1/K per step.

With `overlap=False` every bucket waits for the end of backward, as `LionCub(..., overlap=False)` does (it
communicates inside step(): the control allreduce first, then the buckets).

Local steps (`local_steps=H`, LionCub(local_steps=H[, fragments=F, outer_delay=D])): every step is compute and a
local Lion update; every H steps the outer exchange of the pseudo-gradients, inside step() or streamed in
fragments on the communication thread; flat or in the node layout (step/local.py). No momentum sync.

Kernel times are bytes moved through device memory / `memory_bandwidth`:
  Lion update (all methods): read p, g, m, write p, m = 20 bytes per parameter.
  Codec (method-specific: the method's `codec_bytes_per_element`): the extra passes that build and consume the
  wire format (reading m and g to form the sign/level, packing, the vote, unpacking; a bf16 cast).
Compute is given (`compute_seconds`), or 6 * params * tokens / flops_per_second (forward 1/3, backward 2/3).

Each distinct collective is simulated once (on an idle network, as it runs on the communication stream)
and its simulated time reused for every bucket of the same size.

Hierarchical layout (`hierarchical=True`, nodes of G = cluster.gpus_per_node ranks): a bucket's exchange is
the method's `hierarchical_collectives`: a reduce-scatter inside every node, the method's collectives on
the S = wire.shard_elements(n, G) element shard across nodes (G groups of N/G ranks sharing each NIC),
an all-gather of the agreed codes inside every node (simulated on sub-groups: collectives/groups.py); the momentum
sync is an fp32 allreduce of the shard across nodes; the control allreduce stays one world allreduce.
Codec per bucket: the method's codec_bytes_per_element for N/G voters on the S-element shard and the
decode of all G gathered shards' codes (G * agreed_bytes(S)) at the codec's speed, and one pass over the
bucket's n gradients into the reduce-scatter's buffer (read fp32, write the wire dtype) at the Lion update's
(a memory pass: on CPU ranks several times the compute-bound codec's speed). The Lion update stays 20 bytes per
parameter (an upper bound: each rank updates the momentum of its shard only).

Sharded layout (`sharded=True`: the model sharded by FSDP2 inside nodes of G ranks, HSDP): FSDP's all-gathers
and reduce-scatter inside the node, the method across nodes on the 1/G shard, the update on the shard, as
FSDP2 overlaps them; step/sharded.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from lioncub import methods
from lioncub.comm import wire

from ..collectives.results import CONTROL, CollectiveResult
from ..collectives.results import tally as _tally
from ..collectives.simulate import (
    ALGORITHMS,
    MOMENTUM_SYNC,
    Cache,
    composite_collectives,
    method_collectives,
    parse_algorithm_spec,
    simulate_collective,
    simulate_collectives,
)
from ..net.cluster import Cluster
from ..profiles import BackendProfile, get_profile
from ..units import parse_byte_rate, parse_count, parse_time
from . import contention, local
from . import sharded as shard
from .hosts import HostModel

UPDATE_BYTES_PER_PARAM = 20.0  # fp32 Lion update: read p, g, m; write p, m
DDP_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb: the baseline's buckets
GRAD_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class StepResult:
    """One training step on every rank (seconds; bytes are per rank per step, momentum sync amortized).

    step_seconds = compute + optimizer + what outlasts backward (with overlap: the tail of the buckets'
    codec and collectives; without: the codec and every collective).
    bytes_sent_per_rank: the collectives' (hierarchical: wire.traffic's, with node_size G).
    nic_bytes_per_node: what crosses each node's NIC outwards, from the simulated messages (flat and
    hierarchical alike, so the two layouts compare; trees: the mean over nodes).
    speedup = baseline_step_seconds / step_seconds, the baseline being torch DDP's fp32 allreduce (25 MiB
    buckets, overlapped) and Lion on the same cluster and backend.
    """

    method: str
    backend: str
    ranks: int
    params: float
    step_seconds: float
    compute_seconds: float
    optimizer_seconds: float
    codec_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    momentum_sync_seconds: float
    bytes_sent_per_rank: float
    baseline_step_seconds: float
    speedup: float
    momentum_sync: int | None
    buckets: int
    collectives: list[dict] = field(default_factory=list)
    baseline: dict | None = None
    hierarchical: bool = False
    node_size: int = 1  # G, the ranks per node of the hierarchical layout (1: flat)
    nic_bytes_per_node: float = 0.0  # payload bytes leaving each node's NIC per step (CollectiveResult's)
    # with a profile's host (contention.py): the simulated phases of the step on the shared devices (seconds:
    # compute = forward + backward as they ran, codec, comm, exposed, update, msync; host: the HostModel)
    contention: dict | None = None
    # with a profile's forecast_error: the step and the speedup the measurement should fall between
    step_interval: tuple[float, float] | None = None
    speedup_interval: tuple[float, float] | None = None
    local_steps: int | None = None  # H: the outer exchange every H steps, amortized per step
    fragments: int | None = None  # F, D: the outer exchanges streamed in F fragments, each applied D steps later
    outer_delay: int | None = None
    sharded: bool = False  # the model sharded by FSDP2 inside nodes of node_size ranks (HSDP)
    # fp32 parameters, gradients and momenta each rank holds, and that over an unsharded replica's (12 B/param)
    memory_bytes_per_rank: float = 0.0
    memory_fraction: float = 1.0
    node_bytes_per_rank: float = 0.0  # of bytes_sent_per_rank, what stays inside the node (sharded: FSDP's)
    # sharded: how long forward and backward waited for FSDP's collectives (in step_seconds, not in exposed
    # communication, which is what outlasts backward)
    fsdp_exposed_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.step_seconds

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["seconds"] = self.step_seconds
        return d


def _buckets(params: int, bucket_bytes: float, tensors=None) -> list[tuple[int, int]]:
    """Runs of buckets in backward's order: (fp32 parameters per bucket, how many such buckets in a row). Equal
    buckets; with the model's `tensors` (element counts in model.parameters() order), LionCub's own cut of them."""
    if tensors is not None:
        backward = tensors[::-1]
        sizes = [sum(backward[i] for i in ks) for ks in wire.cut_buckets([4 * n for n in backward], bucket_bytes)]
        return [(e, len(list(run))) for e, run in itertools.groupby(sizes)]
    per = max(1, int(bucket_bytes // 4))
    full, last = divmod(params, per)
    return ([(per, full)] if full else []) + ([(last, 1)] if last else [])


def _tensors(tensors, params):
    """The model's tensor sizes (a list of positive ints) and the parameter count they give; one-line errors."""
    if tensors is None:
        return None, params
    sizes = list(tensors) if isinstance(tensors, (list, tuple)) else None
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ValueError(f"tensors must be a non-empty list of positive element counts, got {tensors!r}")
    if params is not None and parse_count(params) != sum(sizes):
        raise ValueError(f"params={params!r} but the tensors hold {sum(sizes)} parameters: give one or make them agree")
    return sizes, sum(sizes)


@dataclass(frozen=True)
class StepSpec:
    """What one training step runs, the cluster aside: the workload, the method and its options, the backend.

    `simulate_step(cluster, spec)` simulates it; the keyword form `simulate_step(cluster, method, params, ...)`
    builds one. A variant: `dataclasses.replace(spec, momentum_sync=10)`. The fields are checked when the step is
    simulated (one-line ValueErrors).

    Args:
        method: a name in lioncub.methods.NAMES, or a `Method` (costed by the collectives it declares).
        params: number of parameters (int, or '1.3B').
        momentum_sync: K, average momentum every K steps (None or 0: never). Ignored by a dense method.
        bucket_mb: bucket size in MiB of fp32 gradients (DDP's bucket_cap_mb; lioncub uses the same).
        compute_seconds: forward + backward time per step; or give flops_per_second and tokens_per_step.
        flops_per_second: with tokens_per_step (per rank), compute = 6 * params * tokens / flops.
        tokens_per_step: see flops_per_second.
        backend: "nccl", "gloo", "ideal" or a BackendProfile.
        algorithm: "auto" (fastest the backend offers for each collective), an algorithm name, or
            "op=alg,..." (see simulate_collective).
        grad_dtype: the gradients' dtype on the wire ("float32", "bfloat16", "float16") where the method sends
            them: a dense method's allreduce (DDP's bf16 compression hook), the hierarchical reduce-scatter.
        levels: l1-pbit's and vote-pbit's number of levels (default: lioncub's for the world size).
        memory_bandwidth: device memory bandwidth for kernel times (bytes/s or '2TB/s'). A profile whose
            `codec_bandwidth` names this method's codec (or "update") was measured on the ranks' own
            devices by a calibration: those speeds replace memory_bandwidth for those kernels.
        backward_fraction: the share of compute_seconds that is backward (the rest is forward).
        overlap: each bucket is exchanged as soon as backward has produced it, overlapping the rest of
            backward, as DDP and LionCub do (True); or after backward, as `LionCub(..., overlap=False)` does
            (False). Applies to the baseline of other methods too.
        exact: simulate every collective rank by rank (see simulate_collective).
        hierarchical: LionCub's hierarchical layout with nodes of cluster.gpus_per_node ranks (methods with a
            codec only). The baseline stays torch DDP's flat allreduce.
        local_steps: H, LionCub(local_steps=H): the outer exchange every H steps, amortized; with hierarchical,
            in the node layout.
        fragments: F, the outer exchanges streamed in F fragments (LionCub's option of that name; flat only).
        outer_delay: D, each fragment applied D steps after it was sent (LionCub's option of that name).
        sharded: the model sharded by FSDP2 inside nodes of cluster.gpus_per_node ranks, the method across nodes
            on the shards (HSDP, step/sharded.py; a dense method: FSDP2's own HSDP with plain Lion, which is
            then the baseline).
        units: sharded: the FSDP units' parameter counts in forward order, the root first (default: bucket_mb MiB
            each).
        param_dtype: sharded: the parameters' all-gather dtype (MixedPrecisionPolicy).
        tensors: the model's parameter tensors' element counts in model.parameters() order (params defaults to
            their sum): LionCub's buckets are cut at their boundaries, as the optimizer cuts them (each closes
            once it holds bucket_mb); default: equal buckets of bucket_mb. Not sharded; the baseline keeps DDP's
            equal buckets.

    Example:
        >>> spec = StepSpec("vote-1bit", params="124M", compute_seconds=0.2, momentum_sync=10)
        >>> dataclasses.replace(spec, momentum_sync=None).momentum_sync is None
        True
    """

    method: str | methods.Method = methods.BASELINE
    params: int | float | str | None = None
    momentum_sync: int | None = None
    bucket_mb: float = 25.0
    compute_seconds: float | str | None = None
    flops_per_second: float | str | None = None
    tokens_per_step: float | str | None = None
    backend: str | BackendProfile = "nccl"
    algorithm: str | dict = "auto"
    grad_dtype: str = "float32"
    levels: int | None = None
    memory_bandwidth: float | str = "2TB/s"
    backward_fraction: float = 2 / 3
    overlap: bool = True
    exact: bool = False
    hierarchical: bool = False
    local_steps: int | None = None
    fragments: int | None = None
    outer_delay: int | None = None
    sharded: bool = False
    units: list[int] | None = None
    param_dtype: str = "float32"
    tensors: list[int] | None = None


def simulate_step(cluster: Cluster, method: str | methods.Method | StepSpec = methods.BASELINE, params=None,
                  momentum_sync: int | None = None, bucket_mb: float = 25.0, compute_seconds=None,
                  flops_per_second=None, tokens_per_step=None, backend="nccl", algorithm="auto", *,
                  cache: Cache | None = None, **options) -> StepResult:
    """Simulate one data-parallel training step on `cluster`, and the same step with torch DDP and Lion.

    Args:
        cluster: the ranks and the network between them.
        method: a StepSpec (then the options below stay unset), or the method: a name in lioncub.methods.NAMES or
            a `Method`, with the options given here, which build the StepSpec.
        params: the number of parameters (StepSpec.params).
        momentum_sync: K, the momenta averaged every K steps (StepSpec.momentum_sync).
        bucket_mb: MiB of fp32 gradients per bucket (StepSpec.bucket_mb).
        compute_seconds: forward + backward per step (StepSpec.compute_seconds).
        flops_per_second: with tokens_per_step, instead of compute_seconds (StepSpec.flops_per_second).
        tokens_per_step: see flops_per_second (StepSpec.tokens_per_step).
        backend: "nccl", "gloo", "ideal" or a BackendProfile (StepSpec.backend).
        algorithm: "auto", an algorithm name or "op=alg,..." (StepSpec.algorithm).
        cache: a memo of simulated collectives to share between calls (a sweep, a search); default: a new one.
        **options: StepSpec's other fields: grad_dtype, levels, memory_bandwidth, backward_fraction, overlap,
            exact, hierarchical, local_steps, fragments, outer_delay, sharded, units, param_dtype, tensors.

    Returns:
        A StepResult: the step's seconds and their parts, the bytes each rank sends, and `speedup` over the
        baseline, torch DDP's fp32 allreduce in 25 MiB buckets with Lion on the same cluster and backend.

    Example:
        >>> cluster = Cluster.for_ranks(16, gpus_per_node=4, bandwidth="1Gbit", latency="50us")
        >>> r = simulate_step(cluster, StepSpec("vote-1bit", params="124M", compute_seconds=0.2))
        >>> r == simulate_step(cluster, "vote-1bit", "124M", compute_seconds=0.2) and r.speedup > 1
        True
    """
    if isinstance(method, StepSpec):
        keywords = StepSpec(methods.BASELINE, params, momentum_sync, bucket_mb, compute_seconds, flops_per_second,
                            tokens_per_step, backend, algorithm)
        if options or keywords != StepSpec():
            raise ValueError("give simulate_step a StepSpec or its options, not both; a variant of a spec: "
                             "dataclasses.replace(spec, ...)")
        spec = method
    else:
        spec = StepSpec(method, params, momentum_sync, bucket_mb, compute_seconds, flops_per_second, tokens_per_step,
                        backend, algorithm, **options)
    return _simulate(cluster, spec, Cache() if cache is None else cache, baseline=True)


def _simulate(cluster: Cluster, s: StepSpec, cache: Cache, baseline: bool) -> StepResult:
    """The step of `s` (with the baseline's, for the speedup, unless `baseline` is False: it is the baseline)."""
    if s.sharded:
        if s.tensors is not None:
            raise ValueError("tensors describe LionCub's buckets; a sharded model's are its FSDP units: give units")
        return _sharded_step(cluster, s, cache, baseline)
    if s.units is not None or s.param_dtype != "float32":
        raise ValueError("units and param_dtype describe the sharded layout: give sharded=True")
    return _replicated_step(cluster, s, cache, baseline)


def _replicated_step(cluster: Cluster, s: StepSpec, cache: Cache, baseline: bool) -> StepResult:
    """simulate_step in the flat and hierarchical layouts (every rank holds the whole model)."""
    meth = methods.get(s.method)
    _check_layout(meth, s.hierarchical)
    stream = local.check(s.local_steps, s.fragments, s.outer_delay, s.momentum_sync)
    tensors, params = _tensors(s.tensors, s.params)
    P, K, compute, mem_bw = _check_inputs(cluster, s, params)
    profile = get_profile(s.backend)
    cluster, host = _host_transport(cluster, profile)
    G, algs = (cluster.gpus_per_node if s.hierarchical else 0), _algorithms_by_op(s.algorithm)
    # 1. what the buckets, the control message and the momentum sync cost on the wire, each simulated once
    ex = _Exchanges(cluster, profile, meth, algs, cache, s.exact, s.levels, s.grad_dtype, G)
    voters = ex.voters() if s.local_steps else None  # local steps: the outer exchange's voters, the node's
    # 2. the kernels: forward, backward, codec (local steps: the voters' outer codec, fp32), Lion update
    times = _kernel_times(meth, P, compute, s.backward_fraction, profile, mem_bw, ex.N, G, s.levels, s.grad_dtype) \
        if voters is None else _kernel_times(meth, P, compute, s.backward_fraction, profile, mem_bw, voters[0].N, 0,
                                             s.levels, "float32")
    if host is not None and not G and voters is None:  # the update as the run's optimizer ran it (flat layout)
        measured = host.update_of("lion" if _is_ddp(meth, s.grad_dtype, s.bucket_mb) else meth.name, P)
        if measured is not None:  # (alone: device-seconds)
            times.update(optimizer=measured, measured=True)
    # 3. the step: the buckets' exchanges against backward, and what outlasts it (on shared devices: processes)
    buckets = _buckets(P, s.bucket_mb * 2**20, tensors)
    if voters is not None:
        shared = None if host is None else (host.ranks_per_host(ex.N, ex.cluster.gpus_per_node),
                                            *ex.probed(contention.HOP_PROBE).voters())
        t = local.local_step(*voters, buckets, P, times, s.local_steps, stream, host, shared)
        t.setdefault("step", _step_seconds(compute, t["tail"], times["optimizer"]))
    else:
        t = _the_step(ex, meth, buckets, P, times, s.overlap, K, host, compute)
    step = t["step"]
    # 4. the baseline, torch DDP on the same cluster (a dense method with fp32 gradients in DDP's buckets is it)
    base_step, base_dict = step, None
    if baseline and not _is_ddp(meth, s.grad_dtype, s.bucket_mb):
        base_step, base_dict = _ddp_baseline(cluster, P, compute, profile, algs, mem_bw, s, cache)
    speedup, err = (base_step / step if step > 0 else math.inf), profile.forecast_error
    held, fraction = shard.memory(P, G or 1, "hierarchical" if G else "flat")
    return StepResult(
        memory_bytes_per_rank=held, memory_fraction=fraction,
        hierarchical=bool(G), node_size=G or 1, nic_bytes_per_node=t["nic"], contention=t.get("contention"),
        step_interval=interval(step, err), speedup_interval=baseline and ratio_interval(speedup, err) or None,
        method=meth.name, backend=profile.name, ranks=ex.N, params=P, step_seconds=step,
        compute_seconds=compute, optimizer_seconds=t.get("optimizer", times["optimizer"]), codec_seconds=t["codec"],
        communication_seconds=t["comm"], exposed_communication_seconds=t["exposed"],
        momentum_sync_seconds=t["msync"], bytes_sent_per_rank=t["sent"], baseline_step_seconds=base_step,
        speedup=speedup, momentum_sync=K, buckets=sum(k for _, k in buckets),
        collectives=t["collectives"], baseline=base_dict, local_steps=s.local_steps,
        fragments=stream and stream[0], outer_delay=stream and stream[1],
    )


def _is_ddp(meth, grad_dtype: str, bucket_mb: float) -> bool:
    """Whether the step is torch DDP's with plain Lion: a dense method, fp32 gradients in DDP's buckets."""
    return meth.dense and grad_dtype == "float32" and bucket_mb == DDP_BUCKET_MB


def _sharded_step(given: Cluster, s: StepSpec, cache: Cache, baseline: bool) -> StepResult:
    """simulate_step with sharded=True (step/sharded.py) on the `given` cluster."""
    meth = methods.get(s.method)
    shard.check(given, meth, s.hierarchical, s.local_steps or s.fragments, s.momentum_sync, s.param_dtype)
    P, K, compute, mem_bw = _check_inputs(given, s, s.params)
    profile = get_profile(s.backend)
    cluster, host = _host_transport(given, profile)
    sizes, bwd = shard.unit_sizes(P, s.units, s.bucket_mb), compute * s.backward_fraction
    t = shard.simulate(dict(
        cluster=cluster, profile=profile, meth=meth, P=P, sizes=sizes, K=K, fwd=compute - bwd, bwd=bwd,
        update_bytes=UPDATE_BYTES_PER_PARAM, update_bw=profile.codec_bandwidth.get("update", mem_bw),
        codec_bw=profile.codec_bandwidth.get(meth.name, mem_bw), host=host, spec=_algorithms_by_op(s.algorithm),
        cache=cache, exact=s.exact, levels=s.levels, grad_dtype=s.grad_dtype, param_dtype=s.param_dtype,
        overlap=s.overlap))
    step, base_dict = t["step"], None
    base_step = step
    if baseline and not meth.dense:  # the sharded baseline: FSDP2's own HSDP and plain Lion
        base_step, base_dict = _sharded_baseline(given, s, cache, cluster, profile, P, sizes)
    speedup, err = (base_step / step if step > 0 else math.inf), profile.forecast_error
    return StepResult(
        method=meth.name, backend=profile.name, ranks=cluster.ranks, params=P, step_seconds=step,
        compute_seconds=compute, optimizer_seconds=t["optimizer"], codec_seconds=t["codec"],
        communication_seconds=t["comm"], exposed_communication_seconds=t["exposed"], momentum_sync_seconds=t["msync"],
        bytes_sent_per_rank=t["sent"], baseline_step_seconds=base_step, speedup=speedup,
        momentum_sync=None if meth.dense else K, buckets=len(sizes), collectives=t["collectives"], baseline=base_dict,
        node_size=cluster.gpus_per_node, nic_bytes_per_node=t["nic"], contention=t["contention"],
        step_interval=interval(step, err), speedup_interval=baseline and ratio_interval(speedup, err) or None,
        sharded=True, memory_bytes_per_rank=t["memory"], memory_fraction=t["memory_fraction"],
        node_bytes_per_rank=t["node_sent"], fsdp_exposed_seconds=t["fsdp_exposed"])


def _sharded_baseline(given: Cluster, s: StepSpec, cache: Cache, cluster, profile, P, sizes) -> tuple[float, dict]:
    """(step seconds, StepResult fields) of FSDP2's own HSDP with plain Lion on the same units, simulated once per
    cache (autotune asks it of every sharded candidate)."""
    key = cache.key(cluster, profile, "sharded baseline", repr(s.algorithm), P) + tuple(
        repr(getattr(s, k)) for k in ("compute_seconds", "flops_per_second", "tokens_per_step", "grad_dtype",
                                      "memory_bandwidth", "backward_fraction", "overlap", "exact")) + (
        tuple(sizes), s.param_dtype)
    if key not in cache.steps:
        spec = dataclasses.replace(s, method=methods.BASELINE, momentum_sync=None, levels=None, units=sizes)
        base = _simulate(given, spec, cache, baseline=False)
        cache.steps[key] = base.step_seconds, {k: v for k, v in base.to_dict().items()
                                               if k not in ("baseline", "collectives")}
    return cache.steps[key]


def _the_step(ex, meth, buckets, P, times, overlap, K, host, compute) -> dict:
    """Phase 3: on devices not shared, the analytic model; on a host's shared devices, processes (contention.py)."""
    if host is not None:
        return _contended(ex, meth, buckets, times, overlap, K, host)
    t = _communicate(ex, meth, buckets, P, times, overlap, K)
    return dict(t, step=_step_seconds(compute, t["tail"], times["optimizer"]))


def interval(value: float, error) -> tuple[float, float] | None:
    """Where a measurement of a forecast `value` should fall, from a calibration's held-out error band
    [low, high] (measured / predicted - 1): value x (1 + low) .. value x (1 + high)."""
    if error is None or not math.isfinite(value):
        return None
    return value * (1 + error[0]), value * (1 + error[1])


def ratio_interval(value: float, error) -> tuple[float, float] | None:
    """The band of a ratio of two forecasts (a speedup) made with one calibration: each forecast's error
    taken as independent, their log-widths add in quadrature around the ratio."""
    if error is None or not math.isfinite(value):
        return None
    half = math.sqrt(2) * (math.log1p(error[1]) - math.log1p(error[0])) / 2
    return value * math.exp(-half), value * math.exp(half)


def _host_transport(cluster: Cluster, profile) -> tuple[Cluster, HostModel | None]:
    """(the cluster with the host's own transport between ranks of one host where the profile's host model has
    one, that host model or None)."""
    host = profile.host_model()
    if host is None or host.intra_bandwidth is None:
        return cluster, host
    latency = cluster.intra_latency if host.intra_latency is None else host.intra_latency
    return dataclasses.replace(cluster, intra_bandwidth=host.intra_bandwidth, intra_latency=latency), host


def _contended(ex, meth, buckets, times, overlap, K, host) -> dict:
    """The step on shared devices (contention.py): the representative rank's processes on its host's cores."""
    N, G = ex.N, ex.G
    weight = host.ranks_per_host(N, ex.cluster.gpus_per_node)
    probed = ex.probed(contention.HOP_PROBE)
    work = dict(fwd=contention.compute_work(host, weight, times["fwd"]),
                bwd=contention.compute_work(host, weight, times["bwd"]), optimizer=times["optimizer"])
    plan, sent, nic, colls = [], 0.0, 0.0, []
    for e, k in buckets:
        calls = []
        if N > 1:
            r, alg, size = ex.bucket(e)
            calls = contention.calls_of(r, probed.bucket(e)[0], ex.meth.name, size, N, G, ex.profile)
            sent, nic = sent + k * r.bytes_sent_per_rank, nic + k * r.nic_bytes_per_node
            _tally(colls, ex.meth.name, alg, size, r.seconds, count=k)
        plan += [(e, times["codec_bytes"](e) / times["codec_bw"], calls)] * k
    codecs, applied = contention.apply_split(host, meth, [codec for _, codec, _ in plan])
    if applied is not None and N > 1:  # a compressed step's apply runs in step(), after the exchange
        plan = [(e, codec, calls) for (e, _, calls), codec in zip(plan, codecs)]
        work["optimizer"] = times["optimizer"] if times.get("measured") else applied
    control = None
    if not meth.dense and N > 1:
        control = contention.control_call(ex, probed, N)
        r = ex.control()
        sent, nic = sent + r.bytes_sent_per_rank, nic + r.nic_bytes_per_node
        _tally(colls, CONTROL, r.algorithm, wire.CONTROL.nbytes, r.seconds)
    sync = []
    if K is not None and N > 1 and not meth.dense:
        for e, k in buckets:
            r = ex.momentum_sync(e)
            sync += contention.calls_of(r, probed.momentum_sync(e), MOMENTUM_SYNC, 4 * e, N, G, ex.profile) * k
            sent, nic = sent + k * r.bytes_sent_per_rank / K, nic + k * r.nic_bytes_per_node / K
            _tally(colls, MOMENTUM_SYNC, r.algorithm, 4 * e, r.seconds, per_step=1 / K, count=k)
    sim = contention.StepSim(host, weight, work, plan, control, sync, overlap and N > 1, members=N,
                              compute=times["fwd"] + times["bwd"])
    out = sim.run()
    msync = out["msync"] / K if K else 0.0
    step = out["step"] + msync
    # as the analytic model counts it: without overlap the codec after backward is not communication
    exposed = out["exposed"] - (0.0 if overlap and N > 1 else out["codec"])
    return dict(step=step, codec=out["codec"], comm=out["comm"] - out["msync"] + msync,
                exposed=exposed + msync, msync=msync, sent=sent, nic=nic, collectives=colls, optimizer=out["update"],
                contention=dict(out, host=host.to_dict(), ranks_per_host=weight))


def _step_seconds(compute: float, tail: list[float], optimizer: float) -> float:
    """Compute, what outlasts backward (in the order the step runs it), the Lion update."""
    step = compute
    for part in tail:
        step += part
    return step + optimizer


def _ddp_baseline(cluster, P, compute, profile, algs, mem_bw, s: StepSpec, cache: Cache) -> tuple[float, dict]:
    """(step seconds, StepResult fields) of torch DDP: the baseline method, fp32 gradients in 25 MiB buckets."""
    spec = StepSpec(methods.BASELINE, P, None, DDP_BUCKET_MB, compute, backend=profile, algorithm=algs,
                    memory_bandwidth=mem_bw, backward_fraction=s.backward_fraction, overlap=s.overlap, exact=s.exact)
    base = _simulate(cluster, spec, cache, baseline=False)
    return base.step_seconds, {k: v for k, v in base.to_dict().items() if k not in ("baseline", "collectives")}


class _Exchanges:
    """What a step puts on the wire, each distinct collective simulated once (on an idle network, as it runs on
    the communication stream) and reused for every bucket of its size."""

    def __init__(self, cluster, profile, meth, spec, cache, exact, levels, grad_dtype, node_size):
        self.cluster, self.profile, self.meth, self.spec = cluster, profile, meth, spec
        self.cache, self.exact, self.levels, self.grad_dtype, self.G = cache, exact, levels, grad_dtype, node_size
        self.N = cluster.ranks
        self.memo: dict = {}

    def bucket(self, e: int) -> tuple[CollectiveResult, str, int]:
        """A bucket of e parameters: (the collectives the method issues for it, how StepResult lists them:
        algorithm and size). A method with a codec is listed as a composite (collectives/simulate.py): every collective
        it issues (op:algorithm) and its fp32 bucket; a dense method by the algorithms of its collectives and
        the gradients they carry, as they are on the wire."""
        if ("bucket", e) not in self.memo:
            colls = method_collectives(self.meth, e, self.N, self.levels, self.G, self.grad_dtype)
            r = simulate_collectives(self.cluster, self.profile, self.meth.name, colls, self.spec, 4 * e, self.cache,
                                     exact=self.exact, node_size=self.G)
            if self.meth.dense:
                row = "+".join(part["algorithm"] for part in r.parts), wire.DTYPE_BYTES[self.grad_dtype] * e
            else:
                row = r.algorithm, 4 * e
            self.memo["bucket", e] = (r, *row)
        return self.memo["bucket", e]

    def control(self) -> CollectiveResult:
        """The step's control message (lioncub.comm.wire.CONTROL), one world collective."""
        c = wire.CONTROL
        if "control" not in self.memo:
            self.memo["control"] = simulate_collective(self.cluster, c.op, self.spec.get(c.op, "auto"), c.nbytes,
                                                       self.profile, cache=self.cache, exact=self.exact)
        return self.memo["control"]

    def probed(self, extra_latency: float) -> _Exchanges:
        """The same exchanges on the cluster with `extra_latency` on every link (contention.py counts the
        latencies on each collective's critical path from the difference)."""
        c = self.cluster
        twin = dataclasses.replace(c, latency=c.latency + extra_latency, intra_latency=c.intra_latency + extra_latency)
        return _Exchanges(twin, self.profile, self.meth, self.spec, self.cache, self.exact, self.levels,
                          self.grad_dtype, self.G)

    def voters(self) -> tuple[_Exchanges, local.NodeExchanges | None]:
        """Local steps: the exchanges of the ranks that vote in the outer step (flat: every rank, without the
        hierarchical collectives; the node layout: local rank 0 of every node, one rank per node on the cross
        links) and the node's own collectives (None when flat)."""
        cluster = dataclasses.replace(self.cluster, gpus_per_node=1) if self.G else self.cluster
        twin = _Exchanges(cluster, self.profile, self.meth, self.spec, self.cache, self.exact, self.levels,
                          "float32", 0)
        if not self.G:
            return twin, None

        def simulate(name, colls, nbytes):
            return simulate_collectives(self.cluster, self.profile, name, colls, self.spec, nbytes, self.cache,
                                        exact=self.exact, node_size=self.G)
        return twin, local.NodeExchanges(simulate, self.G)

    def momentum_sync(self, e: int) -> CollectiveResult:
        """The fp32 momentum average of a bucket of e parameters (of its shard, in the hierarchical layout)."""
        if ("sync", e) not in self.memo:
            colls = composite_collectives(MOMENTUM_SYNC, 4 * e, self.N, self.levels, self.G, self.grad_dtype)
            self.memo["sync", e] = simulate_collectives(self.cluster, self.profile, MOMENTUM_SYNC, colls, self.spec,
                                                        4 * e, self.cache, exact=self.exact, node_size=self.G)
        return self.memo["sync", e]


def _kernel_times(meth, P, compute, backward_fraction, profile, mem_bw, N, G, levels, grad_dtype) -> dict:
    """Forward and backward, the Lion update, and the codec (bytes per bucket, at the codec's speed)."""
    t_bwd = compute * backward_fraction
    codec_bw = profile.codec_bandwidth.get(meth.name, mem_bw)
    update_bw = profile.codec_bandwidth.get("update", mem_bw)
    return dict(
        fwd=compute - t_bwd, bwd=t_bwd, optimizer=UPDATE_BYTES_PER_PARAM * P / update_bw,
        codec_bytes=_codec_bytes(meth, N, G, levels, grad_dtype, codec_bw / update_bw),
        codec_bw=codec_bw, codec_on_compute=profile.codec_on_compute)


def _communicate(ex, meth, buckets, P, times, overlap, K) -> dict:
    """The buckets' exchanges against backward (codec, communication, what is exposed, bytes, the collectives
    issued). A dense method's ranks share one momentum: no control message, nothing to sync."""
    if meth.dense:
        t = _overlapped_step(ex, buckets, P, times, overlap)
    elif overlap:
        t = _overlapped_step(ex, buckets, P, times, True, control=True)
        _add_momentum_sync(t, ex, buckets, K)
    else:
        t = _vote_step(ex, buckets, times, K)
    return t


def _check_inputs(cluster, s: StepSpec, params):
    """(parameters, sync interval K or None, compute seconds, memory bandwidth) from the step's inputs."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if params is None:
        raise ValueError("params (number of parameters) is required")
    P = parse_count(params)
    if not P >= 1:
        raise ValueError(f"params must be >= 1, got {params!r}")
    if s.grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {s.grad_dtype!r}")
    if not (isinstance(s.bucket_mb, (int, float)) and s.bucket_mb > 0):
        raise ValueError(f"bucket_mb must be positive, got {s.bucket_mb!r}")
    K = s.momentum_sync or None
    if K is not None and (isinstance(K, bool) or not isinstance(K, int) or K < 1):
        raise ValueError(f"momentum_sync must be a positive integer (or None), got {s.momentum_sync!r}")
    if not 0 < s.backward_fraction <= 1:
        raise ValueError(f"backward_fraction must be in (0, 1], got {s.backward_fraction!r}")
    mem_bw = parse_byte_rate(s.memory_bandwidth)
    if not mem_bw > 0:
        raise ValueError(f"memory_bandwidth must be positive, got {s.memory_bandwidth!r}")
    if s.compute_seconds is not None:
        compute = parse_time(s.compute_seconds)
    elif s.flops_per_second is not None and s.tokens_per_step is not None:
        flops, tokens = parse_count(s.flops_per_second), parse_count(s.tokens_per_step)
        if not (flops > 0 and tokens > 0):
            raise ValueError("flops_per_second and tokens_per_step must be positive")
        compute = 6.0 * int(P) * tokens / flops
    else:
        raise ValueError("give compute_seconds, or flops_per_second and tokens_per_step")
    if compute < 0:
        raise ValueError(f"compute time must be >= 0, got {s.compute_seconds!r}")
    return int(P), K, compute, mem_bw


def _codec_bytes(meth, N, G, levels, grad_dtype, copy_cost: float):
    """Device-memory bytes the codec kernels move for a bucket of e parameters, at the codec's speed, as a
    function of e (flat: the method's bytes per element; hierarchical: see the module's docstring). The
    hierarchical layout's copy of the bucket into the reduce-scatter is a plain memory pass, which runs at the
    Lion update's speed, not the codec's: its bytes count `copy_cost` = codec speed / update speed each (about
    1 on a GPU, where both are memory-bound; well below 1 on CPU ranks, whose codec is compute-bound)."""
    if not G:
        per = meth.codec_bytes_per_element(N, levels or 0, grad_dtype)
        return lambda e: per * e
    M = N // G
    lv = meth.resolve_levels(M, levels) if meth.uses_levels else 0
    per = meth.codec_bytes_per_element(M, lv, grad_dtype)
    if G == 1:
        return lambda e: per * wire.shard_elements(e, 1)
    rs_in = (4 + wire.DTYPE_BYTES[grad_dtype]) * copy_cost

    def bucket(e):
        S = wire.shard_elements(e, G)
        return per * S + rs_in * e + G * meth.agreed_bytes(S, M, lv)
    return bucket


def _overlapped_step(ex, buckets, P, times, overlap, control=False) -> dict:
    """DDP, and LionCub with overlap: bucket i is ready when backward has produced it; one stream (LionCub:
    one thread) encodes and exchanges the buckets in order, then (methods with a codec) sends the step's
    control message; only the tail that outlasts backward is exposed."""
    # on CPU ranks (codec_on_compute) each bucket's codec runs on the computing cores: backward lasts the
    # codecs longer, and the stream carries only the collectives
    on_cores = times["codec_on_compute"]
    codec_total = sum(k * times["codec_bytes"](e) / times["codec_bw"] for e, k in buckets) if on_cores else 0.0
    bwd = times["bwd"] + codec_total

    def ready(done):
        return times["fwd"] + bwd * (done / P if overlap else 1.0)

    done, end, comm, codec, sent, nic, colls = 0, times["fwd"], 0.0, 0.0, 0.0, 0.0, []
    for e, k in buckets:
        t_codec = times["codec_bytes"](e) / times["codec_bw"]
        t_comm = 0.0
        if ex.N > 1:
            r, alg, size = ex.bucket(e)
            t_comm, sent, nic = r.seconds, sent + k * r.bytes_sent_per_rank, nic + k * r.nic_bytes_per_node
            _tally(colls, ex.meth.name, alg, size, r.seconds, count=k)
        c = (0.0 if on_cores else t_codec) + t_comm
        # bucket j of the run is ready at ready(done + j e) and takes c on the stream, so the stream ends at
        # the max over j of ready_j + (k - j + 1) c and of end + k c; linear in j: j = 1 or j = k
        end = max(end + k * c, ready(done + e) + k * c, ready(done + k * e) + c)
        done += k * e
        comm += k * t_comm
        codec += k * t_codec
    if control and ex.N > 1:
        r = ex.control()
        end = max(end, times["fwd"] + bwd) + r.seconds
        comm, sent, nic = comm + r.seconds, sent + r.bytes_sent_per_rank, nic + r.nic_bytes_per_node
        _tally(colls, CONTROL, r.algorithm, wire.CONTROL.nbytes, r.seconds)
    exposed = max(0.0, end - (times["fwd"] + bwd))
    return dict(codec=codec, comm=comm, exposed=exposed, tail=[codec_total, exposed] if on_cores else [exposed],
                msync=0.0, sent=sent, nic=nic, collectives=colls)


def _vote_step(ex, buckets, times, K) -> dict:
    """After backward: the control all-reduce, then each bucket's codec and collectives in turn; every
    K steps the momenta are averaged (amortized as 1/K per step). Everything is exposed."""
    comm, codec, sent, nic, msync, colls = 0.0, 0.0, 0.0, 0.0, 0.0, []
    if ex.N > 1:
        r = ex.control()
        comm, sent, nic = r.seconds, r.bytes_sent_per_rank, r.nic_bytes_per_node
        _tally(colls, CONTROL, r.algorithm, wire.CONTROL.nbytes, r.seconds)
    for e, k in buckets:
        codec += k * times["codec_bytes"](e) / times["codec_bw"]
        if ex.N > 1:
            r, alg, size = ex.bucket(e)
            comm, sent = comm + k * r.seconds, sent + k * r.bytes_sent_per_rank
            nic += k * r.nic_bytes_per_node
            _tally(colls, ex.meth.name, alg, size, r.seconds, count=k)
    t = dict(codec=codec, comm=comm, exposed=comm, tail=[], msync=msync, sent=sent, nic=nic, collectives=colls)
    _add_momentum_sync(t, ex, buckets, K)
    t.update(exposed=t["comm"], tail=[t["codec"], t["comm"]])
    return t


def _check_layout(meth, hierarchical) -> None:
    if hierarchical and meth.dense:
        raise ValueError(f"hierarchical is LionCub's layout for the compressed methods, not {meth.name!r}")


def _add_momentum_sync(t: dict, ex, buckets, K) -> None:
    """Every K steps step() averages the momenta (fp32, bucketed the same way), after backward: exposed,
    amortized as 1/K per step."""
    if K is None or ex.N == 1:
        return
    total, bytes_, nic = 0.0, 0.0, 0.0
    for e, k in buckets:
        r = ex.momentum_sync(e)
        total, bytes_, nic = total + k * r.seconds, bytes_ + k * r.bytes_sent_per_rank, nic + k * r.nic_bytes_per_node
        _tally(t["collectives"], MOMENTUM_SYNC, r.algorithm, 4 * e, r.seconds, per_step=1 / K, count=k)
    t["msync"] = total / K
    t["comm"] += t["msync"]
    t["exposed"] += t["msync"]
    t["tail"].append(t["msync"])
    t["sent"] += bytes_ / K
    t["nic"] += nic / K


def _algorithms_by_op(algorithm) -> dict:
    """A step's `algorithm` argument as {op: algorithm}: 'auto', 'op=alg,...' / a dict, or one name that
    applies to every op it is an algorithm of (auto for the others)."""
    spec = parse_algorithm_spec(algorithm)
    if isinstance(spec, dict):
        for op, alg in spec.items():
            if op not in ALGORITHMS:
                raise ValueError(f"unknown op {op!r} in algorithm spec; choose from {', '.join(ALGORITHMS)}")
            if alg != "auto" and alg not in ALGORITHMS[op]:
                raise ValueError(f"unknown {op} algorithm {alg!r}; choose one of: {', '.join(ALGORITHMS[op])}")
        return spec
    if spec == "auto":
        return {}
    ops = [op for op, algs in ALGORITHMS.items() if spec in algs]
    if not ops:
        known = sorted({a for algs in ALGORITHMS.values() for a in algs})
        raise ValueError(f"unknown algorithm {spec!r}; choose one of: {', '.join(known)}, auto")
    return {op: spec for op in ops}


__all__ = ["StepResult", "StepSpec", "simulate_step"]
