"""`lioncub autotune`: search method, collective layout, bucket size and momentum-sync schedule for a cluster.

    lioncub autotune --model gpt2-124m --preset 10gbe-4x8
    lioncub autotune --params 1.3B --compute-seconds 0.3 --ranks 64 --gpus-per-node 8 --bandwidth 10Gbit \
        --latency 50us --max-risk low --output tuned.json
    lioncub autotune --model char-small --preset lab-100mbit-4x1 --pilot 60 --output tuned.json

Every configuration's step time comes from the simulator (`lioncub.simulator.simulate_step`), with one
`Cache` shared by the whole search, so each distinct collective (op, algorithm, size) is simulated once.
The search itself imports no torch; only `--pilot` does (it trains).

The search space
----------------
* method: the six of `lioncub.wire.METHODS`;
* l1-pbit levels: the default `127 // N`, and (for N > 4) for each wider p-bit field the most levels that
  fit in it (up to 4 more bits, at most 127): more levels cost bytes and lower the quantization risk;
* bucket size (MiB of fp32 gradients): 4, 25, 100 (sizes that give the same buckets are one candidate);
* collective layout: `flat` (the backend's own choice among the algorithms it implements, per
  collective and message size, as NCCL's tuner or Gloo does) and, with several GPUs per node,
  `hierarchical` allreduce (reduce-scatter inside the node, ring between nodes, all-gather inside);
* momentum sync: none, every:K (K = 1, 2, 4, ..., 1024, below the planned run length), first:K:M
  (every K steps during the first tenth of the run) and geometric:K (interval doubles every K syncs).
  every:K is simulated as such; first/geometric cost the no-sync step plus their sync rate over the
  planned run times the simulated cost of one sync (the simulator's own amortization, made exact).

The convergence risk rule (see `risk`) and the pilot ranking (see `run_pilots`) are documented where they
are defined and in docs/AUTOTUNE.md.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lioncub import schedules, wire
from lioncub.simulator import Cache, Cluster, get_profile, simulate_step
from lioncub.simulator.profiles import ALL_ALGORITHMS, BackendProfile
from lioncub.simulator.units import format_size, format_time, parse_byte_rate, parse_count, parse_time

# ---------------------------------------------------------------------------------------------------------
# models and GPUs
# ---------------------------------------------------------------------------------------------------------
# name -> peak dense bf16/fp16 tensor FLOP/s and memory bandwidth. The default assumption: an A100-class
# GPU reaching UTILIZATION of its peak in training (a typical large-model MFU).
GPUS = {
    "a100": dict(label="A100-class", peak_flops=312e12, memory_bandwidth=2.0e12),
    "h100": dict(label="H100-class (SXM)", peak_flops=989e12, memory_bandwidth=3.35e12),
    "v100": dict(label="V100-class", peak_flops=125e12, memory_bandwidth=0.9e12),
}
DEFAULT_GPU = "a100"
UTILIZATION = 0.40

# name -> parameters, training FLOPs per sample (forward + backward = 3x forward), default samples per rank
# per step, what a sample is. Transformers: 6 * params * tokens (per sequence of `seq` tokens);
# ResNet-50: 4.1 GMAC forward at 224x224 -> 3 * 8.2 GFLOP; ViT-B/16: 17.6 GMAC -> 3 * 35.2 GFLOP.
PRESETS = {
    "gpt2-124m": dict(params=124_439_808, seq=1024, batch=8, what="sequences of 1024 tokens"),
    "gpt2-350m": dict(params=354_823_168, seq=1024, batch=8, what="sequences of 1024 tokens"),
    "resnet50": dict(params=25_557_032, flops_per_sample=3 * 8.2e9, batch=256, what="224x224 images"),
    "vit-b16": dict(params=86_567_656, flops_per_sample=3 * 35.2e9, batch=128, what="224x224 images"),
}
BUILTIN = ("char-tiny", "char-small", "char-medium", "mlp")  # lioncub.train.models (trainable here)
DEFAULT_TOKENS = 8192  # --params N without --tokens: 8 sequences of 1024 tokens per rank


@dataclass(frozen=True)
class ModelSpec:
    name: str  # preset / built-in name, or "custom"
    params: int
    compute_seconds: float  # forward + backward per rank per step
    compute_basis: str  # how compute_seconds was obtained, in words
    builtin: bool = False
    batch_size: int | None = None  # built-in: TrainConfig.batch_size
    block_size: int | None = None  # built-in char models: TrainConfig.block_size

    def to_dict(self) -> dict:
        return asdict(self)


_CHAR_SHAPES = {"char-tiny": (2, 128), "char-small": (4, 256), "char-medium": (6, 384)}  # (layers, width)


def _char_vocab() -> int:
    from pydoc_data.topics import topics  # what lioncub.train.data.CharText reads

    return len(set("".join(topics.values())))


def builtin_params(name: str, block_size: int = 64) -> int:
    """Parameters of a built-in model, counted without torch (the tests check them against the torch
    models): the char transformer is nanoGPT-shaped (lioncub.train.models) over the characters of
    pydoc_data.topics; the MLP is 32 -> 256 -> 256 -> 10."""
    if name == "mlp":
        dims = [32, 256, 256, 10]
        return sum(a * b + b for a, b in zip(dims, dims[1:]))
    layers, c = _CHAR_SHAPES[name]
    v = _char_vocab()
    block = 2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * c + (4 * c * c + 4 * c) + (4 * c * c + c)
    return v * c + block_size * c + layers * block + 2 * c + c * v  # embeddings, blocks, ln_f, head


def _count(value, what: str) -> float:
    try:
        v = parse_count(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{what} must be positive, got {value!r}")
    return v


def model_spec(model: str | None = None, params=None, *, batch: int | None = None, seq_len: int | None = None,
               tokens=None, block_size: int | None = None, compute_seconds=None, flops=None,
               gpu: str = DEFAULT_GPU) -> ModelSpec:
    """The model to tune for: a preset, a built-in model or `params` parameters, and its compute time per
    step (given, or training FLOPs per step / achieved FLOP/s, by default the GPU's peak x UTILIZATION)."""
    if model is not None and params is not None:
        raise ValueError("give --model or --params, not both")
    if model is None and params is None:
        raise ValueError("give the model: --model NAME (" + ", ".join(list(PRESETS) + list(BUILTIN))
                         + ") or --params N (e.g. 1.3B)")
    if gpu not in GPUS:
        raise ValueError(f"unknown --gpu {gpu!r}; choose one of: {', '.join(GPUS)}")
    for name, v in (("batch", batch), ("seq-len", seq_len), ("block-size", block_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name} must be a positive integer, got {v!r}")
    if flops is not None:
        achieved = _count(flops, "--flops")
        flops_text = f"{achieved / 1e12:.4g} TFLOP/s (given)"
    else:
        g = GPUS[gpu]
        achieved = g["peak_flops"] * UTILIZATION
        flops_text = (f"{achieved / 1e12:.4g} TFLOP/s (assumed GPU: {g['label']}, "
                      f"{g['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak at {UTILIZATION:.0%})")
    builtin = False
    bs = blk = None
    if params is not None:
        P = int(_count(params, "--params"))
        if P < 1:
            raise ValueError(f"--params must be at least 1, got {params!r}")
        name = "custom"
        if tokens is None and batch is not None:
            tokens = batch * (seq_len or 1024)
        t = _count(tokens, "--tokens") if tokens is not None else DEFAULT_TOKENS
        flops_step = 6.0 * P * t
        work = f"6 x {P / 1e6:.4g}M params x {t:g} tokens per rank"
    elif model in PRESETS:
        spec = PRESETS[model]
        name, P = model, spec["params"]
        b = batch or spec["batch"]
        if "seq" in spec:
            t = _count(tokens, "--tokens") if tokens is not None else b * (seq_len or spec["seq"])
            flops_step = 6.0 * P * t
            work = f"6 x {P / 1e6:.4g}M params x {t:g} tokens per rank"
        else:
            if tokens is not None or seq_len is not None:
                raise ValueError(f"{model} is not a sequence model: give --batch (images per rank), not tokens")
            flops_step = spec["flops_per_sample"] * b
            work = f"{b} {spec['what']} per rank x {spec['flops_per_sample'] / 1e9:.4g} GFLOP"
    elif model in BUILTIN:
        name, builtin = model, True
        bs = batch or 16
        blk = (block_size or seq_len or 64) if model != "mlp" else 64
        P = builtin_params(model, blk)
        t = bs * (blk if model != "mlp" else 1)
        flops_step = 6.0 * P * t
        work = f"6 x {P / 1e6:.4g}M params x {t} {'tokens' if model != 'mlp' else 'samples'} per rank"
    else:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(list(PRESETS) + list(BUILTIN))}, "
                         "or give --params N")
    if compute_seconds is not None:
        try:
            c = parse_time(compute_seconds)
        except ValueError as exc:
            raise ValueError(f"--compute-seconds: {exc}") from None
        if not c >= 0:
            raise ValueError(f"--compute-seconds must be >= 0, got {compute_seconds!r}")
        basis = f"{format_time(c)} per step (given)"
    else:
        c = flops_step / achieved
        basis = f"{format_time(c)} per step = {work} / {flops_text}"
    return ModelSpec(name, P, c, basis, builtin, bs, blk)


# ---------------------------------------------------------------------------------------------------------
# clusters
# ---------------------------------------------------------------------------------------------------------
CLUSTER_PRESETS = {
    "lab-100mbit-4x1": dict(nodes=4, gpus_per_node=1, bandwidth="100Mbit", latency="50us",
                            about="lioncub's emulated lab: 4 hosts at 100 Mbit/s"),
    "1gbe-8x1": dict(nodes=8, gpus_per_node=1, bandwidth="1Gbit", latency="50us",
                     about="8 single-GPU machines on 1 Gbit Ethernet"),
    "10gbe-4x8": dict(nodes=4, gpus_per_node=8, bandwidth="10Gbit", latency="20us",
                      about="4 servers of 8 GPUs on 10 Gbit Ethernet"),
    "25gbe-8x8": dict(nodes=8, gpus_per_node=8, bandwidth="25Gbit", latency="15us",
                      about="8 servers of 8 GPUs on 25 Gbit Ethernet"),
    "100gbe-16x8": dict(nodes=16, gpus_per_node=8, bandwidth="100Gbit", latency="10us",
                        about="16 servers of 8 GPUs on 100 Gbit Ethernet (TCP)"),
    "wan-1gbit-4x8": dict(nodes=4, gpus_per_node=8, bandwidth="1Gbit", latency="5ms",
                          about="4 sites of 8 GPUs joined by 1 Gbit/s at 5 ms"),
}


def make_cluster(preset: str | None = None, *, ranks: int | None = None, nodes: int | None = None,
                 gpus_per_node: int | None = None, bandwidth=None, latency=None, **extra) -> tuple[Cluster, str]:
    """(cluster, description): a preset, with any explicitly given field overriding it, or the fields.
    Defaults without a preset: 1 GPU per node, 10 Gbit/s, 20 us."""
    base: dict = {}
    if preset is not None:
        if preset not in CLUSTER_PRESETS:
            raise ValueError(f"unknown cluster preset {preset!r}; choose one of: {', '.join(CLUSTER_PRESETS)}")
        base = {k: v for k, v in CLUSTER_PRESETS[preset].items() if k != "about"}
    elif ranks is None and nodes is None:
        raise ValueError("describe the cluster: --preset NAME (" + ", ".join(CLUSTER_PRESETS)
                         + "), or --ranks N / --nodes N with --bandwidth and --latency")
    for name, v in (("ranks", ranks), ("nodes", nodes), ("gpus-per-node", gpus_per_node)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"--{name} must be a positive integer, got {v!r}")
    g = gpus_per_node if gpus_per_node is not None else base.get("gpus_per_node", 1)
    if ranks is not None:
        if ranks % g:
            raise ValueError(f"--ranks ({ranks}) must be a multiple of --gpus-per-node ({g})")
        if nodes is not None and nodes * g != ranks:
            raise ValueError(f"--ranks {ranks} != --nodes {nodes} x --gpus-per-node {g}")
        n = ranks // g
    else:
        n = nodes if nodes is not None else base["nodes"]
    kwargs = dict(bandwidth=bandwidth if bandwidth is not None else base.get("bandwidth", "10Gbit"),
                  latency=latency if latency is not None else base.get("latency", "20us"))
    kwargs.update({k: v for k, v in extra.items() if v is not None})
    cluster = Cluster(nodes=n, gpus_per_node=g, **kwargs)
    desc = cluster.describe() + (f" [preset {preset}]" if preset else "")
    return cluster, desc


# ---------------------------------------------------------------------------------------------------------
# convergence risk
# ---------------------------------------------------------------------------------------------------------
RISK_LEVELS = (("low", 0.20), ("medium", 0.45), ("high", math.inf))  # score < bound
MEASURED_AT = 4  # ranks of the local measurements the rule is anchored to

# Per-method weights of the rule below (see `risk`).
_RANK_SLOPE = 0.08  # per doubling of N beyond MEASURED_AT, for majority-vote / sign-averaging aggregation
_SYNC_WEIGHT = {"vote-allgather": 0.10, "vote-1bit": 0.10, "vote-pbit": 0.10, "avg-pbit": 0.10, "l1-pbit": 0.50}
_FLOOR = 0.05  # any compressed method: its update is not the baseline's

RISK_RULE = f"""\
Convergence risk (a heuristic: the network model cannot predict accuracy). Score = 0 for allreduce
(plain Lion); for the compressed methods:
  score = {_FLOOR} + aggregation(method, N) + sync_weight(method) x u(schedule)
  aggregation = {_RANK_SLOPE} x log2(N / {MEASURED_AT}) (0 for N <= {MEASURED_AT}) for the majority-vote methods
      (vote-allgather, vote-1bit, vote-pbit) and avg-pbit; the same divided by the levels s for l1-pbit
      (s levels carry each rank's magnitude, so sign(sum q) approaches sign(sum c); s = 1 is a vote).
  u = mean over the planned run of the share of each rank's momentum not yet averaged with the others,
      (1 - b2^(t-1-s)) / (1 - b2^(t-1)) at step t with the last sync at s (b2 = 0.99): 1 without sync,
      about 0.04 for every:8 and 0.37 for every:100 over a 10000-step run (more in short runs, where the
      momenta are young).
  sync_weight = {_SYNC_WEIGHT['l1-pbit']} for l1-pbit, {_SYNC_WEIGHT['vote-1bit']} for the others.
Levels: low < {RISK_LEVELS[0][1]}, medium < {RISK_LEVELS[1][1]}, high otherwise.
Basis, measured: local runs (4 ranks, char-tiny, lr 2e-3, 200 steps, eval loss; allreduce 2.444):
l1-pbit without sync 2.761 (+13%), l1-pbit every:1 2.374, vote-pbit without sync 2.281, avg-pbit
without sync 2.386; so at N = 4 only l1-pbit without sync is high. Assumed, not measured: the growth
with N (majority votes lose accuracy as N grows, L1 levels recover it; the qualitative finding of the
Lion Cub paper, arXiv:2411.16462, whose slope here is a guess) and the shape between every:1 and no
sync (the momentum-memory model u). Check them for your model with --pilot."""


def level_of(score: float) -> str:
    for name, bound in RISK_LEVELS:
        if score < bound:
            return name
    return RISK_LEVELS[-1][0]  # pragma: no cover


def parse_max_risk(text) -> float:
    """--max-risk as a score bound: low, medium, high (everything) or a number."""
    if text is None:
        return math.inf
    s = str(text).strip().lower()
    names = [n for n, _ in RISK_LEVELS]
    if s in names:  # a level's scores are those below its bound
        i = names.index(s)
        return math.inf if s == "high" else RISK_LEVELS[i][1] - 1e-9
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"--max-risk must be low, medium, high or a score (e.g. 0.3), got {text!r}") from None
    if not v >= 0:
        raise ValueError(f"--max-risk must be >= 0, got {text!r}")
    return v + 1e-12  # a score equal to the bound passes


_SYNC_STEPS: dict = {}


def _sync_steps(spec: str, steps: int) -> list[int]:
    """The steps in 1..steps after which `spec` averages the momenta (as LionCub's schedule decides)."""
    key = (spec, steps)
    if key not in _SYNC_STEPS:
        sched = schedules.resolve(schedules.parse(spec))
        if isinstance(sched, schedules.Never):
            out = []
        elif isinstance(sched, schedules.EveryK):
            out = list(range(sched.k, steps + 1, sched.k))
        elif isinstance(sched, schedules.FirstSteps):
            out = list(range(sched.k, min(sched.until, steps) + 1, sched.k))
        elif isinstance(sched, schedules.Geometric):  # should_sync walks the intervals from 0 on every call
            out, t, j = [], 0, 0
            while True:
                t += sched._interval(j)
                j += 1
                if t > steps:
                    break
                out.append(t)
        else:  # pragma: no cover  (a schedule object of the user's)
            out = [t for t in range(1, steps + 1) if sched.should_sync(t)]
        _SYNC_STEPS[key] = out
    return _SYNC_STEPS[key]


def unsynced_share(spec: str, steps: int, beta2: float = 0.99) -> float:
    """Mean over steps 2..steps of the share of a rank's momentum that is its own (not averaged): the
    weight of the gradients since the last sync in m, (1 - b2^(t-1-s)) / (1 - b2^(t-1))."""
    if steps < 2:
        return 0.0
    syncs = set(_sync_steps(spec, steps))
    last, total = 0, 0.0
    for t in range(2, steps + 1):
        if (t - 1) in syncs:
            last = t - 1
        total += (1 - beta2 ** (t - 1 - last)) / (1 - beta2 ** (t - 1))
    return total / (steps - 1)


def risk(method: str, ranks: int, levels: int | None, momentum_sync: str, steps: int,
         beta2: float = 0.99, _share: dict | None = None) -> dict:
    """{score, level, parts} of a configuration under RISK_RULE."""
    wire.check_method(method)
    if method == "allreduce" or ranks == 1:
        return {"score": 0.0, "level": "low", "aggregation": 0.0, "sync": 0.0, "unsynced_share": 0.0}
    agg = _RANK_SLOPE * max(0.0, math.log2(ranks / MEASURED_AT))
    if method == "l1-pbit":
        agg /= levels or wire.default_levels(ranks)
    key = (momentum_sync, steps, beta2)
    if _share is not None and key in _share:
        u = _share[key]
    else:
        u = unsynced_share(momentum_sync, steps, beta2)
        if _share is not None:
            _share[key] = u
    sync = _SYNC_WEIGHT[method] * u
    score = _FLOOR + agg + sync
    return {"score": round(score, 4), "level": level_of(score), "aggregation": round(agg, 4),
            "sync": round(sync, 4), "unsynced_share": round(u, 4)}


# ---------------------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------------------
DEFAULT_BUCKETS_MB = (4.0, 25.0, 100.0)
EVERY_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GEOMETRIC_KS = (2, 8, 32)
BASELINE_BUCKET_MB = 25.0  # the reference: PyTorch DDP's default bucket_cap_mb


def default_schedules(steps: int) -> list[str]:
    """none, every:K for K < steps, first:1:M and first:8:M with M = steps // 10, geometric:K."""
    out = ["none"] + [f"every:{k}" for k in EVERY_KS if k < steps]
    m = steps // 10
    if m >= 2:
        out += [f"first:1:{m}"] + ([f"first:8:{m}"] if m > 8 else [])
    out += [f"geometric:{k}" for k in GEOMETRIC_KS]
    return out


def normalize_schedule(text: str) -> str:
    """A schedule in `schedules.describe` form ("none", "every:K", "first:K:M", "geometric:K")."""
    return schedules.describe(schedules.parse(text))


MAX_LEVELS = 127  # Lion Cub's int8-motivated range: more levels than this buy no measurable accuracy


def l1_levels_candidates(ranks: int, extra_bits: int = 4) -> list[int]:
    """The default levels, then for each field up to `extra_bits` wider the most levels that fit in it
    (at most MAX_LEVELS)."""
    s0 = wire.default_levels(ranks)
    w0 = wire.field_layout("l1-pbit", ranks, s0).width
    out = [s0]
    for w in range(w0 + 1, min(wire.MAX_FIELD_WIDTH, w0 + extra_bits) + 1):
        s = (2**w - 1) // (2 * ranks)
        if s > MAX_LEVELS:
            break
        if s > out[-1] and wire.field_layout("l1-pbit", ranks, s).width == w:
            out.append(s)
    return out


def _bucket_layout(params: int, bucket_mb: float) -> tuple[int, int]:
    per = max(1, int(bucket_mb * 2**20 // 4))
    return (min(per, params), params // per if per < params else 1)


@dataclass
class Candidate:
    method: str
    levels: int | None
    momentum_sync: str
    bucket_mb: float
    layout: str  # "flat" or "hierarchical"
    step_seconds: float
    compute_seconds: float
    codec_seconds: float
    optimizer_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    momentum_sync_seconds: float
    bytes_per_step: float  # sent per rank per step, syncs amortized
    speedup: float  # over the reference baseline
    syncs_per_step: float
    collectives: list = field(default_factory=list)
    risk: dict = field(default_factory=dict)

    @property
    def deployable(self) -> bool:
        """LionCub issues flat collectives on one process group: a hierarchical layout is a what-if."""
        return self.layout == "flat"

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

    def label(self) -> str:
        s = self.method + (f" s={self.levels}" if self.levels else "")
        if self.method != "allreduce":
            s += f", sync {self.momentum_sync}"
        return s + f", {self.bucket_mb:g} MiB, {self.layout}"

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

    def best_per_method(self) -> list[Candidate]:
        """The fastest deployable (flat) configuration of each method within the risk bound."""
        seen, out = set(), []
        for c in self.ranked:
            if c.deployable and c.method not in seen:
                seen.add(c.method)
                out.append(c)
        return out

    def twin(self, c: Candidate, layout: str) -> Candidate | None:
        """The same configuration with another collective layout."""
        return next((x for x in self.candidates if x.layout == layout and (x.method, x.levels, x.momentum_sync,
                     x.bucket_mb) == (c.method, c.levels, c.momentum_sync, c.bucket_mb)), None)


def _profile_for(profile: BackendProfile, algorithms: str) -> BackendProfile:
    if algorithms == "all":
        return profile.replace(algorithms={op: [a for a in algs if a != "hierarchical"]
                                           for op, algs in ALL_ALGORITHMS.items()})
    return profile


def search(cluster: Cluster, params: int, compute_seconds: float, *, backend="nccl", steps: int = 10_000,
           methods=wire.METHODS, bucket_mbs=DEFAULT_BUCKETS_MB, momentum_syncs=None, levels: int | None = None,
           algorithms: str = "backend", max_risk: float = math.inf, memory_bandwidth="2TB/s",
           beta2: float = 0.99, cache: Cache | None = None, progress: bool = False) -> SearchResult:
    """Simulate every configuration of the search space and rank those within `max_risk` by step time.

    backend: "nccl", "gloo", "ideal" or a BackendProfile (e.g. loaded from a calibration file).
    steps: the planned run length (sync rates of first/geometric schedules, and the risk's u).
    momentum_syncs: schedule strings (default: `default_schedules(steps)`).
    levels: fix l1-pbit's levels (default: search `l1_levels_candidates`).
    algorithms: "backend" (the backend's algorithms, plus a hierarchical allreduce layout when there are
        several GPUs per node), "flat" (no hierarchical layout), "all" (every algorithm the simulator
        models for `auto` to choose from, plus hierarchical).
    """
    t0 = time.perf_counter()
    if algorithms not in ("backend", "flat", "all"):
        raise ValueError(f"algorithms must be backend, flat or all, got {algorithms!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps (the planned run length) must be a positive integer, got {steps!r}")
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("no methods to search")
    for m in methods:
        wire.check_method(m)
    N = cluster.ranks
    profile = _profile_for(get_profile(backend), algorithms)
    cache = cache if cache is not None else Cache()
    mem_bw = parse_byte_rate(memory_bandwidth)

    bucket_mbs = sorted({float(b) for b in bucket_mbs})
    if not bucket_mbs or any(not b > 0 for b in bucket_mbs):
        raise ValueError(f"bucket sizes must be positive MiB, got {bucket_mbs!r}")
    same: dict = {}  # sizes that cut the model the same way are one candidate: DDP's 25 MiB, else the smallest
    for b in bucket_mbs:
        same.setdefault(_bucket_layout(params, b), []).append(b)
    buckets = sorted(BASELINE_BUCKET_MB if BASELINE_BUCKET_MB in v else v[0] for v in same.values())

    scheds = [normalize_schedule(s) for s in (momentum_syncs or default_schedules(steps))]
    scheds = list(dict.fromkeys(scheds))
    for s in scheds:
        if s.startswith("every:") and int(s.split(":")[1]) > steps:
            raise ValueError(f"momentum sync {s} never syncs in a {steps}-step run (--steps)")
    layouts = ["flat"]
    if algorithms != "flat" and cluster.gpus_per_node > 1 and cluster.nodes > 1:
        layouts.append("hierarchical")
    if levels is not None:
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(f"levels must be a positive integer, got {levels!r}")
        wire.field_layout("l1-pbit", N, levels)  # raises if it cannot fit
        l1_levels = [levels]
    elif N <= MEASURED_AT:  # the risk rule gives more levels no benefit here: they would only cost bytes
        l1_levels = [wire.default_levels(N)]
    else:
        l1_levels = l1_levels_candidates(N)

    step_kw = dict(compute_seconds=compute_seconds, backend=profile, memory_bandwidth=mem_bw, cache=cache)
    base = simulate_step(cluster, "allreduce", params, None, BASELINE_BUCKET_MB, **step_kw)
    base_step = base.step_seconds

    groups = []  # (method, levels, bucket, layout)
    for m in methods:
        for lv in (l1_levels if m == "l1-pbit" else [None]):
            for b in buckets:
                for lay in layouts:
                    groups.append((m, lv, b, lay))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(groups), desc="autotune", unit="group", file=sys.stderr, leave=False)
    share: dict = {}
    rates: dict = {}
    cands: list[Candidate] = []
    try:
        for m, lv, b, lay in groups:
            alg = "auto" if lay == "flat" else {"allreduce": "hierarchical"}

            def sim(k, m=m, lv=lv, b=b, alg=alg):
                return simulate_step(cluster, m, params, k, b, algorithm=alg, levels=lv, **step_kw)

            r0 = sim(None)
            per_sync = None
            for s in (["none"] if m == "allreduce" or N == 1 else scheds):
                if s == "none":
                    r, rate, extra_t, extra_b = r0, 0.0, 0.0, 0.0
                elif s.startswith("every:"):
                    r = sim(int(s.split(":")[1]))
                    rate, extra_t, extra_b = 1.0 / r.momentum_sync, 0.0, 0.0
                else:  # first / geometric: the no-sync step plus this schedule's syncs per step x one sync
                    if per_sync is None:
                        r1 = sim(1)
                        per_sync = (r1.momentum_sync_seconds, r1.bytes_sent_per_rank - r0.bytes_sent_per_rank)
                    if s not in rates:
                        rates[s] = len(_sync_steps(s, steps)) / steps
                    r, rate = r0, rates[s]
                    extra_t, extra_b = rate * per_sync[0], rate * per_sync[1]
                step = r.step_seconds + extra_t
                rk = risk(m, N, lv, s, steps, beta2, _share=share)
                cands.append(Candidate(
                    method=m, levels=lv, momentum_sync=s, bucket_mb=b, layout=lay, step_seconds=step,
                    compute_seconds=r.compute_seconds, codec_seconds=r.codec_seconds,
                    optimizer_seconds=r.optimizer_seconds,
                    communication_seconds=r.communication_seconds + extra_t,
                    exposed_communication_seconds=r.exposed_communication_seconds + extra_t,
                    momentum_sync_seconds=r.momentum_sync_seconds + extra_t,
                    bytes_per_step=r.bytes_sent_per_rank + extra_b,
                    speedup=base_step / step if step > 0 else math.inf, syncs_per_step=rate,
                    collectives=r.collectives, risk=rk))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    order = {m: i for i, m in enumerate(wire.METHODS)}
    cands.sort(key=lambda c: (c.step_seconds, c.risk["score"], c.bytes_per_step, order[c.method]))
    ranked = [c for c in cands if c.risk["score"] <= max_risk]
    space = dict(ranks=N, methods=methods, l1_levels=l1_levels, bucket_mb=buckets, layouts=layouts,
                 momentum_syncs=scheds, algorithms=algorithms, steps=steps,
                 algorithm_candidates={op: profile.candidates(op) for op in ("allreduce", "allgather", "alltoall")})
    return SearchResult(cands, ranked, base.to_dict(), max_risk, time.perf_counter() - t0, len(cache.results),
                        space)


# ---------------------------------------------------------------------------------------------------------
# recommendation and the config file
# ---------------------------------------------------------------------------------------------------------
def recommend(result: SearchResult, min_speedup: float = 1.10) -> tuple[Candidate | None, str]:
    """(the configuration to run, a verdict in words). The fastest deployable (flat) configuration within
    the risk bound, unless it is a compressed method that beats the best allreduce configuration by less
    than `min_speedup`: then compression does not pay and the baseline is recommended."""
    if not result.ranked:
        return None, ("no configuration is within --max-risk: raise it, or keep allreduce (risk 0) in --methods")
    flat = [c for c in result.ranked if c.deployable]
    best = flat[0]
    ar = next((c for c in flat if c.method == "allreduce"), None)
    notes = []
    top = result.ranked[0]
    if not top.deployable and best.step_seconds > 1.02 * top.step_seconds:
        notes.append(f"a hierarchical allreduce ({top.label()}) would be {best.step_seconds / top.step_seconds:.2f}x "
                     "faster still, but LionCub issues flat collectives on one process group today")
    if result.space.get("ranks") == 1:
        verdict = "one rank: nothing is communicated and every method is plain Lion. Use allreduce."
    elif best.method == "allreduce":
        verdict = (f"compression does not pay here: the allreduce baseline is fastest "
                   f"({format_time(best.step_seconds)}/step; its communication mostly hides behind backward, "
                   f"while lioncub's methods add codec time and communicate after backward). Use allreduce.")
    elif ar is not None and ar.step_seconds / best.step_seconds < min_speedup:
        verdict = (f"compression does not pay enough: the best compressed configuration ({best.label()}) is only "
                   f"{ar.step_seconds / best.step_seconds:.2f}x faster than allreduce (< --min-speedup "
                   f"{min_speedup:g}) for {best.risk['level']} convergence risk. Use allreduce.")
        best = ar
    else:
        ref = ar.step_seconds / best.step_seconds if ar is not None else None
        verdict = (f"{best.method} pays: {best.speedup:.2f}x the default allreduce step"
                   + (f" ({ref:.2f}x the best-tuned allreduce)" if ref else "")
                   + f", {best.risk['level']} convergence risk ({best.risk['score']:.2f}).")
    if notes:
        verdict += " Note: " + "; ".join(notes) + "."
    return best, verdict


NCCL_ALGO = {"ring": "Ring", "binomial-tree": "Tree"}


def collective_section(c: Candidate, backend: str) -> dict:
    """The collective choices behind the prediction, and what (if anything) to set to get them."""
    bulk, control = set(), set()  # allreduce algorithms of the gradient/vote/sync allreduces; of the control
    for x in c.collectives:
        algs = {part.split(":")[-1] for part in x["algorithm"].split("+")
                if part.split(":")[0] == "allreduce" or ":" not in part}
        if x["what"] == "control allreduce":
            control |= algs
        elif x["what"] in ("allreduce", "l1-pbit", "vote-pbit", "avg-pbit", "momentum-sync"):
            bulk |= algs
    sec = {"layout": c.layout, "hierarchical": c.layout == "hierarchical", "algorithms": c.algorithms,
           "collectives": c.collectives, "env": {}, "notes": []}
    if c.layout == "hierarchical":
        sec["notes"].append("hierarchical allreduce needs intra-node and inter-node process groups; LionCub "
                            "issues flat collectives on one group, so this is a what-if")
    if backend == "nccl" and bulk:
        both = bulk | control
        if len(both) == 1 and next(iter(both)) in NCCL_ALGO:
            alg = next(iter(both))
            sec["env"]["NCCL_ALGO"] = NCCL_ALGO[alg]
            sec["notes"].append(f"every allreduce of this step uses {alg}; NCCL_ALGO pins it (NCCL's tuner "
                                "usually picks it by itself)")
        else:
            sec["notes"].append(f"the prediction uses {'/'.join(sorted(bulk))} for the bulk allreduces"
                                + (f" and {'/'.join(sorted(control))} for the 4-byte control allreduce" if control
                                   else "") + ", chosen per message size as NCCL's tuner does: leave NCCL_ALGO unset")
    elif backend == "gloo":
        sec["notes"].append("torch's Gloo backend picks its algorithms itself (not selectable); the prediction "
                            "assumes the fastest of those the profile lists")
    return sec


def build_config(c: Candidate, result: SearchResult, model: ModelSpec, cluster: Cluster, cluster_desc: str,
                 profile: BackendProfile, verdict: str, *, steps: int, lr: float | None = None,
                 calibration: str | None = None, backend: str | None = None) -> dict:
    """The JSON config: `LionCub(params, **cfg["optimizer"])` and `lioncub train --config FILE` accept it."""
    opt = {"method": c.method, "bucket_mb": c.bucket_mb,
           "momentum_sync": None if c.momentum_sync == "none" or c.method == "allreduce" else c.momentum_sync}
    if c.method == "l1-pbit":
        opt["levels"] = c.levels
    train = {"method": c.method, "momentum_sync": "none" if c.method == "allreduce" else c.momentum_sync,
             "bucket_mb": c.bucket_mb}
    if c.method == "l1-pbit":
        train["levels"] = c.levels
    if model.builtin:
        train = {"model": model.name, **train, "steps": steps, "batch_size": model.batch_size}
        if model.name != "mlp":
            train["block_size"] = model.block_size
    if lr is not None:
        train["lr"] = lr
    base = result.baseline
    return {
        "lioncub_autotune": 1,
        "optimizer": opt,
        "train": train,
        "collective": collective_section(c, backend or profile.name),
        "predicted": {
            "step_seconds": c.step_seconds, "speedup": c.speedup, "bytes_sent_per_rank": c.bytes_per_step,
            "compute_seconds": c.compute_seconds, "codec_seconds": c.codec_seconds,
            "optimizer_seconds": c.optimizer_seconds, "communication_seconds": c.communication_seconds,
            "exposed_communication_seconds": c.exposed_communication_seconds,
            "momentum_sync_seconds": c.momentum_sync_seconds, "syncs_per_step": c.syncs_per_step,
            "baseline": {"method": "allreduce", "bucket_mb": BASELINE_BUCKET_MB,
                         "step_seconds": base["step_seconds"], "bytes_sent_per_rank": base["bytes_sent_per_rank"],
                         "exposed_communication_seconds": base["exposed_communication_seconds"]},
            "verdict": verdict,
        },
        "cluster": {**cluster.to_dict(), "description": cluster_desc, "backend": profile.name,
                    "calibration": calibration, "profile": profile.to_dict()},
        "model": model.to_dict(),
        "risk": {**c.risk, "rule": RISK_RULE},
        "search": search_info(result),
    }


def search_info(result: SearchResult) -> dict:
    return {**result.space, "configurations": len(result.candidates), "within_risk": len(result.ranked),
            "max_risk": None if math.isinf(result.max_risk) else result.max_risk,
            "seconds": round(result.seconds, 3), "collectives_simulated": result.collectives_simulated}


def write_config(cfg: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, default=str)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------
# pilot: short real trainings of the top candidates
# ---------------------------------------------------------------------------------------------------------
def _local_runner(cfg, ranks: int, cluster: Cluster | None = None) -> dict:
    from lioncub.train.loop import train_local

    return train_local(cfg, ranks, progress=False)


# name -> fn(TrainConfig, ranks, cluster) -> train summary (final_loss, records with per-step "loss").
# `--lab` can register a runner here that trains on the emulated Ethernet lab.
PILOT_RUNNERS: dict[str, Callable] = {"local": _local_runner}


def pilot_candidates(ranked: list[Candidate], top: int, steps: int) -> list[Candidate]:
    """The best allreduce configuration, then the `top` fastest (flat) ones that train differently within a
    `steps`-step pilot: distinct method, levels and momentum-sync steps (bucket and layout do not change
    the arithmetic; every:K with K > steps trains like none there)."""
    out, seen = [], set()
    flat = [c for c in ranked if c.deployable]
    ar = next((c for c in flat if c.method == "allreduce"), None)
    for c in flat:
        key = (c.method, c.levels, tuple(_sync_steps(c.momentum_sync, steps)))
        if c.method == "allreduce" or key in seen:
            continue
        seen.add(key)
        out.append(c)
        if len(out) == top:
            break
    return ([ar] if ar else []) + out


TARGET_AT = 2 / 3


def smoothed(losses: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def run_pilots(cands: list[Candidate], *, steps: int, ranks: int, model: str, batch_size: int | None = None,
               block_size: int | None = None, lr: float | None = None, seed: int = 0,
               target_loss: float | None = None, runner: str = "local", cluster: Cluster | None = None,
               log: Callable[[str], None] | None = None) -> dict:
    """Train each candidate for `steps` steps on `ranks` ranks (same data, seed and model for all) and rank
    them by predicted time to the target loss: (steps until the smoothed training loss of rank 0 first
    reaches the target) x (the candidate's predicted step time on the target cluster). The target is
    `target_loss`, else the allreduce pilot's smoothed training loss at TARGET_AT of the pilot (so a method
    that needs up to 1 / TARGET_AT times the baseline's steps still reaches it within the pilot).
    Candidates that never reach it rank after those that do, by their final smoothed loss. The smoothing is
    a trailing mean over max(1, steps // 10) steps; every pilot sees the same data, seed and model."""
    from lioncub.train.loop import TrainConfig

    if runner not in PILOT_RUNNERS:
        raise ValueError(f"unknown pilot runner {runner!r}; choose one of: {', '.join(PILOT_RUNNERS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--pilot needs a positive number of steps, got {steps!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--pilot-ranks must be a positive integer, got {ranks!r}")
    if model not in BUILTIN:
        raise ValueError(f"pilots train a built-in model ({', '.join(BUILTIN)}), not {model!r}")
    window = max(1, steps // 10)
    runs = []
    for c in cands:
        kw = dict(model=model, method=c.method, levels=c.levels if c.method == "l1-pbit" else None,
                  momentum_sync="none" if c.method == "allreduce" else c.momentum_sync, steps=steps,
                  bucket_mb=c.bucket_mb, seed=seed, warmup=min(10, steps // 10))
        if batch_size:
            kw["batch_size"] = batch_size
        if block_size and model != "mlp":
            kw["block_size"] = block_size
        if lr is not None:
            kw["lr"] = lr
        cfg = TrainConfig(**kw)
        if log:
            log(f"  pilot {c.label()}: {steps} steps of {model} on {ranks} {runner} rank(s)")
        t0 = time.perf_counter()
        s = PILOT_RUNNERS[runner](cfg, ranks, cluster)
        curve = smoothed([r["loss"] for r in s["records"]], window)
        runs.append(dict(candidate=c, config=kw, final_loss=s["final_loss"], train_loss=curve[-1], curve=curve,
                         wall_seconds=time.perf_counter() - t0, measured_step_seconds=s.get("step_seconds")))
    base = next((r for r in runs if r["candidate"].method == "allreduce"), None)
    if target_loss is None:
        if base is None:
            raise ValueError("give --target-loss (no allreduce pilot to take the target from)")
        at = max(1, math.ceil(TARGET_AT * steps))
        target, basis = base["curve"][at - 1], f"the allreduce pilot's smoothed training loss at step {at}"
    else:
        target, basis = float(target_loss), "--target-loss"
    for r in runs:
        hit = next((i + 1 for i, x in enumerate(r["curve"]) if x <= target), None)
        r["steps_to_target"] = hit
        r["time_to_target"] = None if hit is None else hit * r["candidate"].step_seconds
    runs.sort(key=lambda r: (r["time_to_target"] is None,
                             r["time_to_target"] if r["time_to_target"] is not None else r["train_loss"]))
    return dict(steps=steps, ranks=ranks, model=model, runner=runner, target_loss=target, target_basis=basis,
                window=window, runs=runs)


def pilot_to_dict(p: dict) -> dict:
    out = {k: v for k, v in p.items() if k != "runs"}
    out["runs"] = [{"method": r["candidate"].method, "levels": r["candidate"].levels,
                    "momentum_sync": r["candidate"].momentum_sync, "bucket_mb": r["candidate"].bucket_mb,
                    "predicted_step_seconds": r["candidate"].step_seconds, "final_eval_loss": r["final_loss"],
                    "final_train_loss": r["train_loss"], "steps_to_target": r["steps_to_target"],
                    "predicted_time_to_target_seconds": r["time_to_target"],
                    "measured_step_seconds": r["measured_step_seconds"], "wall_seconds": r["wall_seconds"],
                    "train_config": r["config"]}
                   for r in p["runs"]]
    return out


# ---------------------------------------------------------------------------------------------------------
# text output
# ---------------------------------------------------------------------------------------------------------
def format_table(rows: list[Candidate], recommended: Candidate | None = None,
                 hierarchical: dict | None = None) -> str:
    """One row per configuration; `hierarchical` maps a row's index to its hierarchical twin (a column)."""
    head = ["#", "method", "levels", "momentum sync", "bucket", "layout", "algorithms", "step", "speedup",
            "bytes/step", "risk"]
    if hierarchical is not None:
        head.insert(8, "hierarchical")
    body = []
    for i, c in enumerate(rows, 1):
        row = [f"{i}{'*' if c is recommended else ''}", c.method, str(c.levels or "-"),
               "-" if c.method == "allreduce" else c.momentum_sync, f"{c.bucket_mb:g} MiB", c.layout,
               c.algorithm_summary(), format_time(c.step_seconds), f"{c.speedup:.2f}x",
               format_size(c.bytes_per_step), f"{c.risk['level']} {c.risk['score']:.2f}"]
        if hierarchical is not None:
            t = hierarchical.get(i - 1)
            row.insert(8, format_time(t.step_seconds) if t is not None else "-")
        body.append(row)
    widths = [max(len(h), *(len(b[j]) for b in body)) if body else len(h) for j, h in enumerate(head)]
    left = {1, 3, 5, 6}
    fmt = lambda cells: "  ".join(x.ljust(w) if j in left else x.rjust(w) for j, (x, w) in
                                  enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def format_pilot(p: dict) -> str:
    lines = [f"pilot: {p['steps']} steps of {p['model']} on {p['ranks']} {p['runner']} rank(s) per candidate; "
             f"target loss {p['target_loss']:.4f} ({p['target_basis']}, trailing mean over {p['window']} steps)"]
    head = f"  {'#':>2}  {'configuration':44s} {'eval loss':>9s} {'train loss':>10s} {'steps':>6s} " \
           f"{'pred. step':>10s} {'time to target':>14s}"
    lines += [head, "  " + "-" * (len(head) - 2)]
    for i, r in enumerate(p["runs"], 1):
        c = r["candidate"]
        ttt = "not reached" if r["time_to_target"] is None else format_time(r["time_to_target"])
        lines.append(f"  {i:>2}  {c.label():44s} {r['final_loss']:9.4f} {r['train_loss']:10.4f} "
                     f"{r['steps_to_target'] or '-':>6} {format_time(c.step_seconds):>10s} {ttt:>14s}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------
def _presets_help() -> str:
    return "; ".join(f"{k}: {v['about']} ({v['nodes']}x{v['gpus_per_node']}, {v['bandwidth']}, {v['latency']})"
                     for k, v in CLUSTER_PRESETS.items())


def register(sub) -> None:
    import argparse

    g0 = GPUS[DEFAULT_GPU]
    import textwrap

    intro = ("Describe the model and the cluster; the simulator predicts the step time of every configuration "
             "(method, l1-pbit levels, bucket size, flat or hierarchical allreduce, momentum-sync schedule); the "
             "fastest within --max-risk is recommended, and --output writes it as a config that "
             "LionCub(params, **cfg['optimizer']) and `lioncub train --config FILE` accept. When compression "
             "does not pay (or beats allreduce by less than --min-speedup), allreduce is recommended.")
    gpu = (f"Compute time per step, unless --compute-seconds: training FLOPs / achieved FLOP/s. The default "
           f"GPU is {g0['label']}: {g0['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak at {UTILIZATION:.0%} = "
           f"{g0['peak_flops'] * UTILIZATION / 1e12:.0f} TFLOP/s achieved, {g0['memory_bandwidth'] / 1e12:g} TB/s "
           "memory (codec and update kernels).")
    p = sub.add_parser(
        "autotune", help="search method, collective, buckets and sync interval for a cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(intro, 104) + "\n\n" + textwrap.fill(gpu, 104) + "\n\n" + RISK_RULE)
    m = p.add_argument_group("model")
    m.add_argument("--model", help="preset: " + ", ".join(f"{k} ({v['params'] / 1e6:.1f}M, {v['batch']} "
                                                           f"{v['what']}/rank)" for k, v in PRESETS.items())
                   + "; built-in (trainable by `lioncub train`, pilots): " + ", ".join(BUILTIN))
    m.add_argument("--params", help="instead of --model: number of parameters (1.3B, 350M); compute from "
                                    f"6 x params x tokens (--tokens, default {DEFAULT_TOKENS})")
    m.add_argument("--batch", type=int, help="samples per rank per step (sequences, images; built-in: batch_size)")
    m.add_argument("--seq-len", type=int, help="tokens per sequence (GPT presets: 1024)")
    m.add_argument("--block-size", type=int, help="built-in char models: context length (default 64)")
    m.add_argument("--tokens", help="tokens per rank per step (overrides batch x seq-len)")
    m.add_argument("--compute-seconds", help="measured forward + backward time per step (e.g. 0.2, 180ms)")
    m.add_argument("--flops", help="achieved FLOP/s per GPU instead of the GPU assumption (e.g. 150T)")
    m.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPUS),
                   help=f"GPU assumption for compute and kernel times (default {DEFAULT_GPU}: "
                        + ", ".join(f"{k}: {v['label']} {v['peak_flops'] / 1e12:.0f} TFLOP/s, "
                                    f"{v['memory_bandwidth'] / 1e12:g} TB/s" for k, v in GPUS.items()) + ")")
    m.add_argument("--memory-bandwidth", help="device memory bandwidth for codec/update kernels (default: the GPU's)")
    c = p.add_argument_group("cluster")
    c.add_argument("--preset", help="named cluster (explicit flags override its fields): " + _presets_help())
    c.add_argument("--ranks", type=int, help="number of ranks (GPUs)")
    c.add_argument("--nodes", type=int, help="number of nodes (instead of --ranks)")
    c.add_argument("--gpus-per-node", type=int, help="ranks per node (default 1)")
    c.add_argument("--bandwidth", help="NIC line rate per node: 10Gbit, 100Mbit (default 10Gbit)")
    c.add_argument("--latency", help="one-way host-to-host latency: 20us, 1ms (default 20us)")
    c.add_argument("--intra-bandwidth", help="each GPU's port inside a node (default 800Gbit)")
    c.add_argument("--backend", choices=["nccl", "gloo", "ideal"],
                   help="communication library (default nccl; gloo for the built-in models, which train on CPU)")
    c.add_argument("--calibration", metavar="FILE", help="simulator backend profile JSON (from a calibration run)")
    s = p.add_argument_group("search")
    s.add_argument("--methods", help="comma-separated subset of: " + ", ".join(wire.METHODS))
    s.add_argument("--bucket-mb", help="comma-separated bucket sizes in MiB (default 4,25,100)")
    s.add_argument("--momentum-sync", help="comma-separated schedules to try: none, K, every:K, first:K:M, "
                                           "geometric:K (default: none, every:1..1024, first:1:M, first:8:M "
                                           "with M = steps/10, geometric:2,8,32)")
    s.add_argument("--levels", type=int, help="fix l1-pbit's levels (default: 127 // N and wider fields)")
    s.add_argument("--algorithms", default="backend", choices=["backend", "flat", "all"],
                   help="backend: the algorithms the backend implements (chosen per collective), plus a "
                        "hierarchical allreduce with several GPUs per node; flat: no hierarchical; all: every "
                        "algorithm the simulator models (default backend)")
    s.add_argument("--steps", type=int, help="planned run length, for sync rates and risk (default 10000; "
                                             "200 for built-in models, written to the train section)")
    s.add_argument("--max-risk", default="medium",
                   help="low, medium, high (no bound) or a score (default medium)")
    s.add_argument("--min-speedup", type=float, default=1.10,
                   help="a compressed method must beat the best allreduce by this factor to be recommended "
                        "(default 1.10)")
    s.add_argument("--top", type=int, help="show the N fastest configurations (default: the best of each method)")
    s.add_argument("--lr", type=float, help="learning rate written to the train section and used by pilots")
    pl = p.add_argument_group("pilot (imports torch, trains)")
    pl.add_argument("--pilot", type=int, metavar="STEPS", help="train the top candidates for STEPS steps and "
                                                               "rank them by predicted time to the target loss")
    pl.add_argument("--pilot-ranks", type=int, help="ranks per pilot (default min(ranks, 4))")
    pl.add_argument("--pilot-top", type=int, default=3, help="compressed candidates to pilot besides allreduce "
                                                             "(default 3)")
    pl.add_argument("--pilot-model", help="built-in model to pilot (default: the model if built-in, else char-tiny "
                                          "as a proxy)")
    pl.add_argument("--target-loss", type=float,
                    help="target training loss (default: the allreduce pilot's smoothed loss at 2/3 of the pilot)")
    pl.add_argument("--pilot-on", default="local", help="where pilots run: " + ", ".join(PILOT_RUNNERS))
    p.add_argument("--output", metavar="FILE", help="write the recommended configuration as JSON")
    p.add_argument("--json", action="store_true", help="print the ranked list (and recommendation) as JSON")
    p.set_defaults(func=run)


def _csv(text, parse, what):
    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    out = []
    for t in items:
        try:
            out.append(parse(t))
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
    return out


def _float(t):
    try:
        return float(t)
    except ValueError:
        raise ValueError(f"not a number: {t!r}") from None


def run(args) -> int:
    say = (lambda *a: None) if args.json else print
    model = model_spec(args.model, args.params, batch=args.batch, seq_len=args.seq_len, tokens=args.tokens,
                       block_size=args.block_size, compute_seconds=args.compute_seconds, flops=args.flops,
                       gpu=args.gpu)
    cluster, cdesc = make_cluster(args.preset, ranks=args.ranks, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                  bandwidth=args.bandwidth, latency=args.latency,
                                  intra_bandwidth=args.intra_bandwidth)
    backend = args.backend or ("gloo" if model.builtin else "nccl")
    if args.calibration:
        profile = BackendProfile.load(args.calibration, base=backend)
    else:
        profile = get_profile(backend)
    steps = args.steps if args.steps is not None else (200 if model.builtin else 10_000)
    mem_bw = args.memory_bandwidth if args.memory_bandwidth is not None else GPUS[args.gpu]["memory_bandwidth"]
    max_risk = parse_max_risk(args.max_risk)
    methods = _csv(args.methods, wire.check_method, "--methods") or list(wire.METHODS)
    buckets = _csv(args.bucket_mb, _float, "--bucket-mb") or list(DEFAULT_BUCKETS_MB)
    scheds = _csv(args.momentum_sync, normalize_schedule, "--momentum-sync")
    if args.top is not None and args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if not args.min_speedup > 0:
        raise ValueError(f"--min-speedup must be positive, got {args.min_speedup}")
    if args.pilot is not None:  # check pilot inputs before a long search
        if args.pilot < 1:
            raise ValueError(f"--pilot needs a positive number of steps, got {args.pilot}")
        if args.pilot_ranks is not None and args.pilot_ranks < 1:
            raise ValueError(f"--pilot-ranks must be >= 1, got {args.pilot_ranks}")
        if args.pilot_top < 1:
            raise ValueError(f"--pilot-top must be >= 1, got {args.pilot_top}")
        if args.pilot_model is not None and args.pilot_model not in BUILTIN:
            raise ValueError(f"--pilot-model must be a built-in model ({', '.join(BUILTIN)}), not {args.pilot_model!r}")
        if args.pilot_on not in PILOT_RUNNERS:
            raise ValueError(f"unknown --pilot-on {args.pilot_on!r}; choose one of: {', '.join(PILOT_RUNNERS)}")

    result = search(cluster, model.params, model.compute_seconds, backend=profile, steps=steps, methods=methods,
                    bucket_mbs=buckets, momentum_syncs=scheds, levels=args.levels, algorithms=args.algorithms,
                    max_risk=max_risk, memory_bandwidth=mem_bw, progress=sys.stderr.isatty() and not args.json)
    rec, verdict = recommend(result, args.min_speedup)

    say(f"model    {model.name}: {model.params / 1e6:.4g}M parameters; compute {model.compute_basis}")
    if model.builtin and args.compute_seconds is None and args.flops is None:
        say("         (built-in models train on CPU here: pass --compute-seconds, e.g. the compute_seconds "
            "that `lioncub train --json` reports)")
    say(f"cluster  {cdesc}; backend {profile.name}" + (f" (calibration {args.calibration})" if args.calibration
                                                          else ""))
    base = result.baseline
    say(f"baseline allreduce (fp32 DDP, {BASELINE_BUCKET_MB:g} MiB buckets): {format_time(base['step_seconds'])}"
        f"/step, exposed communication {format_time(base['exposed_communication_seconds'])}, "
        f"{format_size(base['bytes_sent_per_rank'])} sent per rank per step")
    sp = result.space
    say(f"search   {len(sp['methods'])} methods x l1 levels {sp['l1_levels']} x buckets "
        f"{', '.join(f'{b:g}' for b in sp['bucket_mb'])} MiB x layouts {'/'.join(sp['layouts'])} x "
        f"{len(sp['momentum_syncs'])} sync schedules over a {steps}-step run: {len(result.candidates)} "
        f"configurations in {result.seconds:.2f} s ({result.collectives_simulated} collectives simulated)")
    names = dict(RISK_LEVELS)
    name = str(args.max_risk).strip().lower()
    bound = ("none" if math.isinf(max_risk) else f"score < {names[name]:g}" if name in names
             else f"score <= {max_risk:.4g}")
    say(f"risk     bound {args.max_risk} ({bound}): {len(result.ranked)} configurations within it, "
        f"{len(result.candidates) - len(result.ranked)} over it")
    say("")
    rows = result.ranked[: args.top] if args.top else result.best_per_method()
    twins = None
    if not args.top and "hierarchical" in sp["layouts"]:
        twins = {i: result.twin(c, "hierarchical") for i, c in enumerate(rows)}
    say(("fastest configurations" if args.top else "fastest flat configuration of each method") + ", ranked by "
        "predicted step time (speedup over the baseline above; bytes sent per rank per step"
        + ("; hierarchical: the same with a hierarchical allreduce, a what-if" if twins else "") + "):")
    say(format_table(rows, rec, twins))
    excluded = [m for m in methods if m not in {c.method for c in result.ranked}]
    if excluded:
        say(f"  over --max-risk in every configuration: {', '.join(excluded)}")
    say("")

    pilot = None
    if args.pilot is not None and rec is not None:
        pmodel = args.pilot_model or (model.name if model.builtin else "char-tiny")
        pranks = args.pilot_ranks or min(cluster.ranks, 4)
        say(f"pilot    {'built-in ' + pmodel if model.builtin and pmodel == model.name else pmodel + ' as a proxy'}"
            f", {args.pilot} steps, {pranks} rank(s) via {args.pilot_on}:")
        cands = pilot_candidates(result.ranked, args.pilot_top, args.pilot)
        pilot = run_pilots(cands, steps=args.pilot, ranks=pranks, model=pmodel,
                           batch_size=model.batch_size if pmodel == model.name else None,
                           block_size=model.block_size if pmodel == model.name else None, lr=args.lr,
                           target_loss=args.target_loss, runner=args.pilot_on, cluster=cluster, log=say)
        say(format_pilot(pilot))
        first = pilot["runs"][0]
        if first["time_to_target"] is not None and first["candidate"] is not rec:
            verdict = (f"the pilot overrides the simulator's pick ({rec.label()}): {first['candidate'].label()} "
                       f"reaches the target loss first in predicted time ({format_time(first['time_to_target'])}"
                       f" = {first['steps_to_target']} steps x {format_time(first['candidate'].step_seconds)}).")
            rec = first["candidate"]
        elif first["time_to_target"] is not None:
            verdict += " The pilot agrees: it reaches the target loss first in predicted time."
        say("")

    cfg = None
    if rec is not None:
        cfg = build_config(rec, result, model, cluster, cdesc, profile, verdict, steps=steps, lr=args.lr,
                           calibration=args.calibration, backend=backend)
        if pilot is not None:
            cfg["pilot"] = pilot_to_dict(pilot)
    say(f"verdict: {verdict}")
    if rec is not None:
        say(f"recommended: {rec.label()}: predicted {format_time(rec.step_seconds)}/step ({rec.speedup:.2f}x), "
            f"{format_size(rec.bytes_per_step)}/step, risk {rec.risk['level']} ({rec.risk['score']:.2f})")
        say("  LionCub(model.parameters(), lr=..., " + ", ".join(f"{k}={v!r}" for k, v in cfg["optimizer"].items())
            + ")")
        env = cfg["collective"]["env"]
        if env:
            say("  env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    if args.output:
        if cfg is None:
            raise ValueError("nothing to write: no configuration is within --max-risk")
        write_config(cfg, args.output)
        say(f"wrote {args.output}" + ("  (lioncub train --config " + args.output + ")" if model.builtin else ""))
    if args.json:
        out = {"recommended": cfg, "verdict": verdict,
               "ranked": [dict(rank=i, **c.to_dict()) for i, c in enumerate(result.ranked[: args.top] if args.top
                                                                           else result.ranked, 1)],
               "best_per_method": [c.to_dict() for c in result.best_per_method()],
               "baseline": {k: v for k, v in base.items() if k != "collectives"},
               "model": model.to_dict(), "cluster": {**cluster.to_dict(), "description": cdesc,
                                                     "backend": profile.name},
               "search": search_info(result)}
        if pilot is not None:
            out["pilot"] = pilot_to_dict(pilot)
        json.dump(out, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0


__all__ = ["CLUSTER_PRESETS", "GPUS", "PRESETS", "RISK_RULE", "Candidate", "ModelSpec", "SearchResult",
           "build_config", "make_cluster", "model_spec", "recommend", "risk", "run_pilots", "search",
           "unsynced_share"]
