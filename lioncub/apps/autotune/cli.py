"""Text output and the `lioncub autotune` command (`register`, `run`)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from lioncub import methods
from lioncub.apps.tuned_lr import ADAMW_DEFAULT_WD, ADAMW_TO_LION, DEFAULT_LR, lion_from_adamw
from lioncub.files import check_writable
from lioncub.simulator import Cluster, get_profile
from lioncub.simulator.profiles import BackendProfile
from lioncub.simulator.units import format_size, format_time

from .clusters import CLUSTER_PRESETS, make_cluster
from .config import build_config, search_info, write_config
from .models import BUILTIN, DEFAULT_GPU, DEFAULT_TOKENS, GPUS, PRESETS, UTILIZATION, ModelSpec, model_spec
from .pilot import PILOT_RUNNERS, pilot_candidates, pilot_to_dict, pilot_verdict, run_pilots
from .risk_rule import RISK_LEVELS, RISK_RULE, parse_max_risk
from .space import (
    BASELINE_BUCKET_MB,
    DEFAULT_BUCKETS_MB,
    Candidate,
    SearchResult,
    normalize_schedule,
    recommend,
    search,
)


# ---------------------------------------------------------------------------------------------------------
# text output
# ---------------------------------------------------------------------------------------------------------
def format_table(rows: list[Candidate], recommended: Candidate | None = None,
                 other_layout: dict | None = None) -> str:
    """One row per configuration; `other_layout` maps a row's index to the same configuration in the other
    layout (flat <-> hierarchical), whose step time is a column."""
    head = ["#", "method", "levels", "sync / local", "bucket", "layout", "algorithms", "step", "speedup",
            "run", "in node", "leaves node", "memory", "risk"]
    if other_layout is not None:
        head.insert(8, "other layout")
    body = []
    for i, c in enumerate(rows, 1):
        row = [f"{i}{'*' if c is recommended else ''}", c.method, str(c.levels or "-"),
               c.sync_label, f"{c.bucket_mb:.3g} MiB", c.layout,
               c.algorithm_summary(), format_time(c.step_seconds), f"{c.speedup:.2f}x",
               f"{c.run_speedup:.2f}x" + (f" ({c.dense_steps} dense)" if c.dense_steps else ""),
               format_size(c.bytes_inside_node_per_step), format_size(c.bytes_leaving_node_per_step),
               f"{c.memory_fraction:.2f}", f"{c.risk['level']} {c.risk['score']:.2f}"]
        if other_layout is not None:
            t = other_layout.get(i - 1)
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
    import textwrap

    g0 = GPUS[DEFAULT_GPU]
    intro = ("Describe the model and the cluster; the simulator predicts the step time of every configuration "
             "(method, l1-pbit levels, bucket size, flat or LionCub's hierarchical layout, momentum-sync schedule); "
             "the fastest within --max-risk is recommended, and --output writes it as a config that "
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
    _model_arguments(p.add_argument_group("model"))
    _cluster_arguments(p.add_argument_group("cluster"))
    _search_arguments(p.add_argument_group("search"))
    _lr_arguments(p.add_argument_group("lr and weight decay (Lion's, or converted from AdamW's)"))
    _pilot_arguments(p.add_argument_group("pilot (imports torch, trains)"))
    p.add_argument("--output", metavar="FILE", help="write the recommended configuration as JSON")
    p.add_argument("--json", action="store_true", help="print the ranked list (and recommendation) as JSON")
    p.set_defaults(func=run)


def _model_arguments(m) -> None:
    """The model: a preset, a built-in model or a parameter count, and what its compute time comes from."""
    m.add_argument("--model", help="preset: " + ", ".join(f"{k} ({v['params'] / 1e6:.1f}M, {v['batch']} "
                                                           f"{v['what']}/rank)" for k, v in PRESETS.items())
                   + "; built-in (trainable by `lioncub train`, pilots): " + ", ".join(BUILTIN))
    m.add_argument("--params", help="instead of --model: number of parameters (1.3B, 350M); compute from "
                                    f"6 x params x tokens (--tokens, default {DEFAULT_TOKENS})")
    m.add_argument("--batch", "--batch-size", dest="batch", type=int,
                   help="samples per rank per step (sequences, images; built-in: batch_size); the risk rule reads it")
    m.add_argument("--seq-len", type=int, help="tokens per sequence (GPT presets: 1024)")
    m.add_argument("--block-size", type=int, help="built-in char models: context length (default 64)")
    m.add_argument("--tokens", help="tokens per rank per step (overrides batch x seq-len)")
    m.add_argument("--compute-seconds", help="measured forward + backward time per step (e.g. 0.2, 180ms)")
    m.add_argument("--model-fn", metavar="MODULE:FUNCTION",
                   help="instead of --model/--params: your model, measured here (imports torch). FUNCTION (in an "
                        "importable module or a file.py) takes no arguments and returns (model, batch) or (model, "
                        "batch, loss_fn(model, batch) -> loss); batch is one rank's (a tensor, a tuple, or a mapping "
                        "such as a Hugging Face batch with labels). Its trainable parameters are counted and "
                        "forward + backward of the batch timed on the GPU if there is one (after warm-up: the median "
                        "of --measure-steps)")
    m.add_argument("--measure-steps", type=int, default=5, help="timed steps of --model-fn, after 2 warm-up steps "
                                                                "(default 5)")
    m.add_argument("--flops", help="achieved FLOP/s per GPU instead of the GPU assumption (e.g. 150T)")
    m.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPUS),
                   help=f"GPU assumption for compute and kernel times (default {DEFAULT_GPU}: "
                        + ", ".join(f"{k}: {v['label']} {v['peak_flops'] / 1e12:.0f} TFLOP/s, "
                                    f"{v['memory_bandwidth'] / 1e12:g} TB/s" for k, v in GPUS.items()) + ")")
    m.add_argument("--memory-bandwidth", help="device memory bandwidth for codec/update kernels (default: the GPU's)")


def _cluster_arguments(c) -> None:
    """The cluster: a preset or its shape, its links and the communication library."""
    c.add_argument("--here", action="store_true",
                   help="nodes like this machine (imports torch): its CUDA devices are the ranks per node and the "
                        "backend nccl; without CUDA one CPU rank per node (torchrun's LOCAL_WORLD_SIZE if set) and "
                        "gloo. --nodes says how many (default 1); explicit --gpus-per-node and --backend win")
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


def _search_arguments(s) -> None:
    """The search space, the planned run and the convergence-risk bound."""
    s.add_argument("--methods", help="comma-separated subset of: " + ", ".join(methods.NAMES))
    s.add_argument("--bucket-mb", help="comma-separated bucket sizes in MiB (default 4,25,100)")
    s.add_argument("--momentum-sync", help="comma-separated schedules to try: none, K, every:K, first:K:M, "
                                           "geometric:K (default: none, every:1..1024, first:1:M, first:8:M "
                                           "with M = steps/10, geometric:2,8,32)")
    s.add_argument("--levels", type=int, help="fix l1-pbit's levels (default: 127 // N and wider fields)")
    s.add_argument("--algorithms", default="backend", choices=["backend", "flat", "all"],
                   help="backend: the algorithms the backend implements (chosen per collective), and with "
                        "several GPUs per node on several nodes each compressed method also in LionCub's "
                        "hierarchical layout and every method on a model sharded inside the node (FSDP2, "
                        "hsdp+...); flat: the flat layout only; all: every algorithm the simulator models, every "
                        "layout (default backend)")
    s.add_argument("--memory-per-rank", metavar="BYTES",
                   help="device memory each rank has for fp32 parameters, gradients and momenta (e.g. 40GiB): "
                        "configurations that need more are not ranked (the sharded layout needs 1/G of a replica's)")
    s.add_argument("--local-steps", default="measured", metavar="measured|none|H[,H...]",
                   help="also search LionCub(local_steps=H): measured (the configurations whose loss has been "
                        "measured; their risk is that loss), none, or intervals H to try with every method and "
                        "layout (their risk: the worst measured local-step loss) (default measured)")
    s.add_argument("--fragments", metavar="F[,F...]",
                   help="with --local-steps H,...: also each H streamed in F fragments (LionCub(fragments=F))")
    s.add_argument("--outer-delay", metavar="D[,D...]",
                   help="with --fragments: each streamed configuration with each outer_delay D (default LionCub's, "
                        "1; a larger D hides more of the exchange and costs loss)")
    s.add_argument("--no-overlap", action="store_true",
                   help="simulate allreduce as LionCub(method='allreduce') runs it, after backward (default: "
                        "overlapped with backward, as DDP does)")
    s.add_argument("--steps", type=int, help="planned run length, for sync rates and risk (default 10000; "
                                             "200 for built-in models, written to the train section)")
    s.add_argument("--max-risk", default="medium",
                   help="low, medium, high (no bound) or a score (default medium)")
    s.add_argument("--min-speedup", type=float, default=1.10,
                   help="a compressed method must beat the best allreduce by this factor to be recommended "
                        "(default 1.10)")
    s.add_argument("--top", type=int, help="show the N fastest configurations (default: the best of each method)")
    s.add_argument("--tuned-lr", type=float, help="the lr the model's allreduce baseline trains best at (default: a "
                                                 "built-in model's default lr; for another model, --lr taken as tuned)")


def _lr_arguments(h) -> None:
    """Lion's lr and weight decay: given, converted from AdamW's by the measured rule, or a built-in's default."""
    rule = ADAMW_TO_LION
    h.add_argument("--lr", type=float, help="Lion's learning rate: the risk rule reads it against --tuned-lr; "
                                           "printed, written to the config and used by pilots (default: a built-in "
                                           "model's tuned one, or converted from --adamw-lr)")
    h.add_argument("--weight-decay", type=float, help="Lion's weight decay (default: a built-in model's 0.1, or "
                                                     "converted from --adamw-weight-decay)")
    h.add_argument("--adamw-lr", type=float,
                   help=f"instead of --lr: the lr your model trains well at with AdamW; Lion's is it / "
                        f"{rule['lr_divisor']:g} (measured: {rule['measured']}; docs/methods.md)")
    h.add_argument("--adamw-weight-decay", type=float,
                   help=f"with --adamw-lr: AdamW's weight decay (default {ADAMW_DEFAULT_WD:g}); Lion's is it x "
                        f"{rule['wd_factor']:g}")


def _pilot_arguments(pl) -> None:
    """Short training runs of the top candidates."""
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


def _check(args) -> None:
    """The flags' own constraints, checked before a long search."""
    if args.top is not None and args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if not args.min_speedup > 0:
        raise ValueError(f"--min-speedup must be positive, got {args.min_speedup}")
    if args.pilot is not None:
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
    if args.output:
        check_writable(args.output, "--output")


@dataclass
class _Setup:
    """What the flags describe: the model, the cluster and its backend, and the search space."""

    model: ModelSpec
    cluster: Cluster
    cluster_desc: str
    backend: str
    profile: BackendProfile
    steps: int
    memory_bandwidth: object
    max_risk: float
    tuned_lr: float | None  # what the risk rule reads --lr against
    methods: list
    buckets: list
    schedules: list | None
    lion: dict | None = None  # Lion's lr and weight decay and where they come from (_lion_hyper), if known
    here: dict | None = None  # --here / --model-fn: the devices read and the compute measured (here.py)


def _lion_hyper(args, model: ModelSpec) -> dict | None:
    """Lion's lr and weight decay, and their basis: --lr / --weight-decay as given, converted from --adamw-lr /
    --adamw-weight-decay by the measured rule (tuned_lr.ADAMW_TO_LION), or a built-in model's defaults."""
    for flag, v in (("--lr", args.lr), ("--tuned-lr", args.tuned_lr), ("--adamw-lr", args.adamw_lr)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} must be > 0, got {v:g}")
    for flag, v in (("--weight-decay", args.weight_decay), ("--adamw-weight-decay", args.adamw_weight_decay)):
        if v is not None and not v >= 0:
            raise ValueError(f"{flag} must be >= 0, got {v:g}")
    if args.adamw_weight_decay is not None and args.adamw_lr is None:
        raise ValueError("--adamw-weight-decay goes with --adamw-lr (AdamW's lr)")
    if args.adamw_lr is not None:
        if args.lr is not None or args.weight_decay is not None:
            raise ValueError("give Lion's --lr / --weight-decay or AdamW's --adamw-lr / --adamw-weight-decay, not both")
        lr, wd = lion_from_adamw(args.adamw_lr, args.adamw_weight_decay)
        awd = ADAMW_DEFAULT_WD if args.adamw_weight_decay is None else args.adamw_weight_decay
        rule = ADAMW_TO_LION
        return dict(lr=lr, weight_decay=wd, adamw=dict(lr=args.adamw_lr, weight_decay=awd),
                    basis=f"from AdamW's lr {args.adamw_lr:g} / {rule['lr_divisor']:g} and weight decay {awd:g}"
                          + (" (assumed: --adamw-weight-decay)" if args.adamw_weight_decay is None else "")
                          + f" x {rule['wd_factor']:g}, as measured ({rule['measured']})")
    default = DEFAULT_LR.get(model.name) if model.builtin else None
    lr = args.lr if args.lr is not None else default
    if lr is None:
        return None if args.weight_decay is None else dict(lr=None, weight_decay=args.weight_decay, basis="given")
    wd = args.weight_decay if args.weight_decay is not None else (0.1 if model.builtin else None)
    basis = "given" if args.lr is not None else f"{model.name}'s tuned default (lioncub train's)"
    return dict(lr=lr, weight_decay=wd, basis=basis)


def _here(args):
    """(ModelSpec or None, Devices or None, here dict or None): --model-fn measured and --here's devices read."""
    if args.model_fn is None and not args.here:
        return None, None, None
    from .here import load_model_fn, measure_here, read_devices

    spec, info = None, {}
    if args.model_fn is not None:
        if args.model is not None or args.params is not None:
            raise ValueError("give --model, --params or --model-fn, not more than one")
        if args.compute_seconds is not None or args.flops is not None:
            raise ValueError("--model-fn measures the compute per step: drop --compute-seconds / --flops")
        import torch

        model, batch, loss_fn = load_model_fn(args.model_fn)
        device = "cuda" if torch.cuda.is_available() else None
        h = measure_here(model, batch, loss_fn, steps=args.measure_steps, device=device)
        spec = ModelSpec(args.model_fn.rpartition(":")[2], h.params, h.compute_seconds, h.compute_basis,
                         batch_size=args.batch)
        info["measured"] = h.to_dict()
        devices = h.devices
    else:
        devices = read_devices()
    info["devices"] = dict(devices.__dict__, description=devices.describe()) if args.here else None
    return spec, devices if args.here else None, info


def _setup(args) -> _Setup:
    if args.measure_steps < 1:
        raise ValueError(f"--measure-steps must be >= 1, got {args.measure_steps}")
    measured, devices, here = _here(args)
    model = measured or model_spec(args.model, args.params, batch=args.batch, seq_len=args.seq_len,
                                   tokens=args.tokens, block_size=args.block_size,
                                   compute_seconds=args.compute_seconds, flops=args.flops, gpu=args.gpu)
    lion = _lion_hyper(args, model)
    gpus, nodes = args.gpus_per_node, args.nodes
    if devices is not None:
        gpus = gpus if gpus is not None else devices.gpus_per_node
        if args.preset is None and args.ranks is None and nodes is None:
            nodes = 1  # --here alone: this machine
    cluster, cdesc = make_cluster(args.preset, ranks=args.ranks, nodes=nodes, gpus_per_node=gpus,
                                  bandwidth=args.bandwidth, latency=args.latency,
                                  intra_bandwidth=args.intra_bandwidth)
    if devices is not None:
        cdesc += f" (--here: {devices.describe()})"
    backend = args.backend or (devices.backend if devices is not None else "gloo" if model.builtin else "nccl")
    if args.calibration:
        profile = BackendProfile.load(args.calibration, base=backend)
    else:
        profile = get_profile(backend)
    return _Setup(
        model=model, cluster=cluster, cluster_desc=cdesc, backend=backend, profile=profile,
        steps=args.steps if args.steps is not None else (200 if model.builtin else 10_000),
        memory_bandwidth=(args.memory_bandwidth if args.memory_bandwidth is not None
                          else GPUS[args.gpu]["memory_bandwidth"]),
        max_risk=parse_max_risk(args.max_risk),
        tuned_lr=args.tuned_lr or (DEFAULT_LR.get(model.name) if model.builtin else _given_lr(args, lion)),
        methods=_csv(args.methods, methods.check, "--methods") or list(methods.NAMES),
        buckets=_csv(args.bucket_mb, _float, "--bucket-mb") or list(DEFAULT_BUCKETS_MB),
        schedules=_csv(args.momentum_sync, normalize_schedule, "--momentum-sync"), lion=lion, here=here)


def _given_lr(args, lion: dict | None) -> float | None:
    """The lr the user gave: --lr, or the one converted from --adamw-lr (what the risk rule reads)."""
    return args.lr if args.lr is not None else lion["lr"] if lion and args.adamw_lr is not None else None


def _search(args, st: _Setup) -> SearchResult:
    return search(st.cluster, st.model.params, st.model.compute_seconds, backend=st.profile, steps=st.steps,
                  methods=st.methods, bucket_mbs=st.buckets, momentum_syncs=st.schedules, levels=args.levels,
                  algorithms=args.algorithms, max_risk=st.max_risk, memory_bandwidth=st.memory_bandwidth,
                  overlap=not args.no_overlap, progress=sys.stderr.isatty() and not args.json,
                  batch_size=args.batch, lr=_given_lr(args, st.lion), tuned_lr=st.tuned_lr,
                  memory_per_rank=args.memory_per_rank,
                  local_steps=_local_steps(args.local_steps), fragments=_csv(args.fragments, _int, "--fragments") or (),
                  outer_delays=_csv(args.outer_delay, _int, "--outer-delay") or ())


def _local_steps(text):
    name = str(text).strip().lower()
    return name if name in ("measured", "none") else _csv(text, _int, "--local-steps")


def _int(t):
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"not an integer: {t!r}") from None


def _report_search(say, args, st: _Setup, result: SearchResult, rec: Candidate | None) -> None:
    """What was searched, the baseline, and the ranked table."""
    model = st.model
    say(f"model    {model.name}: {model.params / 1e6:.4g}M parameters; compute {model.compute_basis}")
    if model.builtin and args.compute_seconds is None and args.flops is None and not args.here:
        say("         (built-in models train on CPU here: pass --compute-seconds, e.g. the compute_seconds "
            "that `lioncub train --json` reports)")
    say(f"cluster  {st.cluster_desc}; backend {st.profile.name}"
        + (f" (calibration {args.calibration})" if args.calibration else ""))
    base = result.baseline
    say(f"baseline allreduce (fp32 DDP, {BASELINE_BUCKET_MB:g} MiB buckets): {format_time(base['step_seconds'])}"
        f"/step, exposed communication {format_time(base['exposed_communication_seconds'])}, "
        f"{format_size(base['bytes_sent_per_rank'])} sent per rank per step: "
        f"{format_size(base['bytes_inside_node_per_rank'])} inside the node, "
        f"{format_size(base['bytes_leaving_node_per_rank'])} leaving it")
    sp = result.space
    say(f"search   {len(sp['methods'])} methods x l1 levels {sp['l1_levels']} x buckets "
        f"{', '.join(f'{b:g}' for b in sp['bucket_mb'])} MiB x layouts {'/'.join(sp['layouts'])} x "
        f"{len(sp['momentum_syncs'])} sync schedules"
        + (f", and {len(sp['local_steps'])} with local steps" if sp.get("local_steps") else "")
        + f" over a {st.steps}-step run: {len(result.candidates)} "
        f"configurations in {result.seconds:.2f} s ({result.collectives_simulated} collectives simulated)")
    levels = dict(RISK_LEVELS)
    name = str(args.max_risk).strip().lower()
    bound = ("none" if math.isinf(st.max_risk) else f"score < {levels[name]:g}" if name in levels
             else f"score <= {st.max_risk:.4g}")
    say(f"risk     bound {args.max_risk} ({bound}): {len(result.ranked)} configurations within it, "
        f"{len(result.candidates) - len(result.ranked)} over it")
    say("")
    rows = result.ranked[: args.top] if args.top else result.best_per_method()
    twins = None
    if not args.top and "hierarchical" in sp["layouts"]:
        other = {"flat": "hierarchical", "hierarchical": "flat", "sharded": "flat"}
        twins = {i: result.twin(c, other[c.layout]) for i, c in enumerate(rows)}
    say(("fastest configurations" if args.top else "fastest configuration of each method") + ", ranked by "
        "predicted mean step over the planned run (step and speedup: after the start; run: the speedup over the "
        "whole run, its dense start steps included; in node / leaves node: bytes sent per rank per step to ranks of "
        "the same node / through the node's NIC, its bytes over its ranks; memory: parameters, gradients "
        "and momenta per rank over an unsharded replica's; layout: flat, LionCub's hierarchical with nodes of "
        f"{sp['node_size']}, or sharded (FSDP2 inside those nodes, the method across them)"
        + ("; other layout: the same configuration's step in the other layout" if twins else "") + "):")
    say(format_table(rows, rec, twins))
    excluded = [m for m in st.methods if m not in {c.method for c in result.ranked}]
    if excluded:
        say(f"  over --max-risk in every configuration: {', '.join(excluded)}")
    say("")


def _pilot(say, args, st: _Setup, result: SearchResult) -> dict:
    """Train the top candidates briefly (the only phase that imports torch)."""
    model = st.model
    pmodel = args.pilot_model or (model.name if model.builtin else "char-tiny")
    pranks = args.pilot_ranks or min(st.cluster.ranks, 4)
    say(f"pilot    {'built-in ' + pmodel if model.builtin and pmodel == model.name else pmodel + ' as a proxy'}"
        f", {args.pilot} steps, {pranks} rank(s) via {args.pilot_on}:")
    cands = pilot_candidates(result.ranked, args.pilot_top, args.pilot)
    pilot = run_pilots(cands, steps=args.pilot, ranks=pranks, model=pmodel,
                       batch_size=model.batch_size if pmodel == model.name else None,
                       block_size=model.block_size if pmodel == model.name else None, lr=_given_lr(args, st.lion),
                       target_loss=args.target_loss, runner=args.pilot_on, cluster=st.cluster, log=say)
    say(format_pilot(pilot))
    return pilot


def _report_recommendation(say, verdict: str, rec: Candidate | None, cfg: dict | None, error=None,
                           lion: dict | None = None) -> None:
    """The verdict and the recommended configuration; with a calibration's `error` band (the profile's
    forecast_error) its step and speedup carry their intervals."""
    from lioncub.simulator.step.model import interval, ratio_interval
    from lioncub.simulator.units import format_speedup

    say(f"verdict: {verdict}")
    if rec is None:
        return
    band = interval(rec.step_seconds, error)
    within = f" ({format_time(band[0])}-{format_time(band[1])})" if band else ""
    say(f"recommended: {rec.label()}: predicted {format_time(rec.step_seconds)}{within}/step "
        f"({format_speedup(rec.speedup, ratio_interval(rec.speedup, error))}), "
        f"{format_size(rec.bytes_per_step)}/step per rank ({format_size(rec.bytes_inside_node_per_step)} inside the "
        f"node, {format_size(rec.bytes_leaving_node_per_step)} leaving it), risk {rec.risk['level']} "
        f"({rec.risk['score']:.2f})")
    hyper = [f"lr={lion['lr']:.3g}" if lion and lion.get("lr") is not None else "lr=..."]
    if lion and lion.get("weight_decay") is not None:
        hyper.append(f"weight_decay={lion['weight_decay']:.3g}")
    say(f"  LionCub(model.parameters(), {', '.join(hyper)}, "
        + ", ".join(f"{k}={v!r}" for k, v in cfg["optimizer"].items()) + ")")
    rule = ADAMW_TO_LION
    if lion and lion.get("lr") is not None:
        say(f"  lr and weight decay: {lion['basis']}")
    else:
        say(f"  lr: Lion's (--lr), or from AdamW's: --adamw-lr LR [--adamw-weight-decay WD] gives lr / "
            f"{rule['lr_divisor']:g} and weight decay x {rule['wd_factor']:g}, as measured ({rule['measured']})")
    if rec.layout == "sharded":
        say(f"  lioncub.attach_fsdp(model, opt, mesh): the model fully_shard'ed on mesh['shard'] of a (nodes, "
            f"{cfg['train']['node_size']}) mesh; memory per rank {rec.memory_fraction:.3f} of a replica's "
            f"({format_size(rec.memory_bytes_per_rank)})")
    env = cfg["collective"]["env"]
    if env:
        say("  env: " + " ".join(f"{k}={v}" for k, v in env.items()))


def _json_summary(args, st: _Setup, result: SearchResult, cfg: dict | None, verdict: str,
                  pilot: dict | None) -> dict:
    out = {"recommended": cfg, "verdict": verdict,
           "ranked": [dict(rank=i, **c.to_dict()) for i, c in enumerate(result.ranked[: args.top] if args.top
                                                                       else result.ranked, 1)],
           "best_per_method": [c.to_dict() for c in result.best_per_method()],
           "baseline": {k: v for k, v in result.baseline.items() if k != "collectives"},
           "model": st.model.to_dict(), "cluster": {**st.cluster.to_dict(), "description": st.cluster_desc,
                                                    "backend": st.profile.name},
           "lion": st.lion, "here": st.here,
           "search": search_info(result)}
    if pilot is not None:
        out["pilot"] = pilot_to_dict(pilot)
    return out


def run(args) -> int:
    """`lioncub autotune`: check the flags, search, recommend (a pilot may overrule the simulator's pick:
    `pilot_verdict`), write the configuration, print."""
    say = (lambda *a: None) if args.json else print
    st = _setup(args)
    _check(args)
    result = _search(args, st)
    rec, verdict = recommend(result, args.min_speedup)
    _report_search(say, args, st, result, rec)

    pilot = None
    if args.pilot is not None and rec is not None:
        pilot = _pilot(say, args, st, result)
        rec, verdict = pilot_verdict(rec, verdict, pilot)
        say("")

    cfg = None
    if rec is not None:
        cfg = build_config(rec, result, st.model, st.cluster, st.cluster_desc, st.profile, verdict, steps=st.steps,
                           lr=_given_lr(args, st.lion), calibration=args.calibration, backend=st.backend, lion=st.lion,
                           here=st.here)
        if pilot is not None:
            cfg["pilot"] = pilot_to_dict(pilot)
    _report_recommendation(say, verdict, rec, cfg, st.profile.forecast_error, st.lion)
    if args.output:
        if cfg is None:
            raise ValueError("nothing to write: no configuration is within --max-risk")
        write_config(cfg, args.output)
        say(f"wrote {args.output}" + ("  (lioncub train --config " + args.output + ")" if st.model.builtin else ""))
    if args.json:
        json.dump(_json_summary(args, st, result, cfg, verdict, pilot), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0
