"""`lioncub train`: a built-in model on bundled data, under torchrun, on local ranks, or on the lab."""

from __future__ import annotations

import json
import sys

from lioncub.apps.options import at_least
from lioncub.apps.train import configs
from lioncub.files import check_writable, read_json

MODEL_CHOICES = ("char-tiny", "char-small", "char-medium", "byte-30m", "byte-gpt2-small", "mlp")
DATA_CHOICES = ("pydoc-topics", "python-src")  # lioncub.apps.train.data.TEXT_DATASETS (no torch imported here)


def register(sub) -> None:
    p = sub.add_parser("train", help="train a built-in model with any method/config",
                       description="Train a transformer on Python's own docs (char-*: pydoc-topics, characters) or "
                                   "sources (byte-*: python-src, bytes; built offline on first use), or an MLP. "
                                   "Under torchrun each process is a rank; otherwise --ranks N spawns N local "
                                   "Gloo ranks; --lab runs them on the emulated Ethernet lab.")
    p.add_argument("--config", help="JSON config (from `lioncub autotune --output`); flags override it")
    p.add_argument("--model", choices=MODEL_CHOICES)
    p.add_argument("--data", choices=DATA_CHOICES,
                   help="the text to train on (default: the model's: pydoc-topics for char-*, python-src for byte-*)")
    p.add_argument("--amp", choices=("none", "bf16"), help="bf16: the forward pass under bf16 autocast (default none)")
    p.add_argument("--method", choices=configs.NAMES,
                   help=f"a LionCub method, or {configs.DDP_LION.name} (torch DDP + plain Lion, the usual baseline)")
    p.add_argument("--levels", type=int, help="L1 levels for l1-pbit (default 127 // ranks)")
    p.add_argument("--momentum-sync", dest="momentum_sync",
                   help="none, K, every:K, first:K:M, geometric:K or adaptive[:T[:B[:S]]] (the guard: S dense "
                        "steps, by default until the momentum leads, then momentum syncs when the ranks' agreement "
                        "is below T, all within B x the method's bytes; default none)")
    p.add_argument("--lr", type=float)
    p.add_argument("--weight-decay", dest="weight_decay", type=float)
    p.add_argument("--warmup", type=int, help="steps of linear learning-rate warm-up before the cosine decay")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int, help="per rank")
    p.add_argument("--block-size", dest="block_size", type=int)
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float)
    p.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="communicate inside step() instead of during backward")
    p.add_argument("--dense-warmup", dest="dense_warmup", type=int,
                   help="run the first K steps with the allreduce method, then --method (default 0)")
    p.add_argument("--local-steps", dest="local_steps", type=int,
                   help="H local Lion steps per outer step, whose pseudo-gradients the ranks agree on through "
                        "--method's codec with error feedback (allreduce: DiLoCo's dense outer all-reduce)")
    p.add_argument("--outer", help="the outer optimizer with --local-steps: avg[:LR[:MU]] (default 1:0), "
                                   "nesterov[:LR[:MU]] (DiLoCo's, 0.7:0.9) or sign[:LR[:MU]]")
    p.add_argument("--fragments", type=int,
                   help="with --local-steps: stream the outer steps, the model in F fragments whose exchanges are "
                        "staggered over the H steps and overlap the next inner steps")
    p.add_argument("--outer-delay", dest="outer_delay", type=int,
                   help="with --fragments: inner steps each exchange overlaps before it is applied (default 1)")
    p.add_argument("--hierarchical", action="store_true", default=None,
                   help="LionCub's hierarchical layout: inside each node a reduce-scatter of the gradients and an "
                        "all-gather of the codes, across nodes the vote on shards (compressed methods only)")
    p.add_argument("--node-size", dest="node_size", type=int,
                   help="ranks per node for --hierarchical and hsdp+... (default: torchrun's LOCAL_WORLD_SIZE; on "
                        "the lab, --ranks-per-host)")
    p.add_argument("--seed", type=int)
    p.add_argument("--timing", action="store_true", default=None,
                   help="time every collective by name (rank 0's ms per step in the summary; exact phase times "
                        "on CUDA)")
    p.add_argument("--device", help="cpu (default), cuda, cuda:1, ...: where model, data and optimizer live")
    p.add_argument("--ranks", type=at_least(1), default=1, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--lab", action="store_true", help="run the ranks on the emulated Ethernet lab (root)")
    p.add_argument("--bandwidth", default="1Gbit", help="lab link rate (with --lab)")
    p.add_argument("--ranks-per-host", type=at_least(1), default=1, help="lab: ranks sharing one host's link")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int)
    p.add_argument("--resume", action="store_true", default=None, help="continue from the newest checkpoint")
    p.add_argument("--log", help="write per-step records (JSON lines) here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def config_from_args(args):
    from lioncub.apps.train.loop import TrainConfig

    base = {}
    if args.config:
        base = read_json(args.config, "config file")
        if not isinstance(base, dict):
            raise ValueError(f"config file {args.config}: expected a JSON object (from `lioncub autotune --output`)")
        base = base.get("train", base)  # autotune files nest the training options
    for key in ("model", "data", "amp", "method", "levels", "momentum_sync", "local_steps", "outer", "fragments",
                "outer_delay", "lr",
                "weight_decay", "warmup", "steps", "batch_size", "block_size", "bucket_mb", "overlap", "dense_warmup",
                "hierarchical", "node_size", "seed", "device", "timing", "checkpoint_dir", "checkpoint_every",
                "resume"):
        value = getattr(args, key, None)
        if value is not None:
            base[key] = value
    return TrainConfig.from_dict(base)


def _launched() -> bool:
    """Whether a launcher (torchrun, SLURM's srun, mpirun) started this process as one rank of several."""
    from lioncub.comm.launch import launch_env

    where = launch_env()
    return where is not None and (where.launcher == "torchrun" or where.world_size > 1)


def run(args) -> int:
    from lioncub.apps.train.loop import dumps, train, train_local

    cfg = config_from_args(args)
    if args.log:
        check_writable(args.log, "--log")
    progress = sys.stderr.isatty() or not args.json
    launched = _launched()
    sharded = cfg.configuration.wrapper.fsdp
    if (cfg.hierarchical or sharded) and cfg.node_size is None and not (launched or args.lab):
        raise ValueError(f"{'--hierarchical' if cfg.hierarchical else cfg.method} on local ranks needs --node-size "
                         "(under torchrun it is LOCAL_WORLD_SIZE, on the lab --ranks-per-host)")
    if sharded and not launched:
        from lioncub.apps.train.sharding import check

        check(cfg, args.ranks, cfg.node_size or args.ranks_per_host)
    if launched:  # under torchrun, srun or mpirun: this process is one rank
        from lioncub.comm.distributed import finish, init_distributed

        rank, _ = init_distributed()
        summary = train(cfg, progress=progress and rank == 0)
        finish()
        if rank:
            return 0
    elif args.lab:
        from lioncub.apps.train.lab import train_on_lab

        summary = train_on_lab(cfg, ranks=args.ranks, bandwidth=args.bandwidth,
                               ranks_per_host=args.ranks_per_host, progress=progress)
    else:
        summary = train_local(cfg, args.ranks, progress=progress)
    if args.log:
        with open(args.log, "w") as f:
            for r in summary.get("records", []):
                f.write(json.dumps(r) + "\n")
    if args.json:
        print(dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def format_summary(s: dict) -> str:
    lines = [f"{s['model']} ({s['params'] / 1e6:.2f}M params), {s['method']} on {s['ranks']} rank(s), "
             f"{s['steps']} steps",
             f"  final eval loss {s['final_loss']:.4f}   train loss {s['train_loss']:.4f}",
             f"  step {1e3 * s['step_seconds']:.1f} ms = compute {1e3 * s['compute_seconds']:.1f} + codec "
             f"{1e3 * s['codec_seconds']:.1f} + comm {1e3 * s['comm_seconds']:.1f} (medians); mean step "
             f"{1e3 * s['mean_step_seconds']:.1f} ms",
             f"  {s['bytes_per_step'] / 1e6:.3f} MB sent per rank per step"]
    if s.get("agreement") is not None:
        lines.append(f"  rank agreement {s['agreement']:.3f} (mean), {s['final_agreement']:.3f} (last tenth); "
                     f"{s.get('momentum_syncs', 0)} momentum sync(s)")
    if s.get("link_bytes_per_step") is not None:
        lines.append(f"  {s['link_bytes_per_step'] / 1e6:.3f} MB through each host's link per step (tx + rx, "
                     f"Ethernet frames; mean of {len(s['link_hosts'])} hosts, {s['link_window_steps']} steps)")
    if s.get("forecast"):
        from lioncub.apps.train.forecast import format_comparison

        lines.append(format_comparison(s["forecast"]))
    elif s.get("predicted_step_seconds"):
        lines.append(f"  predicted step {1e3 * s['predicted_step_seconds']:.1f} ms")
    for name, ms in (s.get("collective_ms_per_step") or {}).items():
        lines.append(f"  {ms:8.1f} ms/step in {name}")
    if s.get("skipped_steps"):
        lines.append(f"  {s['skipped_steps']} step(s) skipped for non-finite gradients")
    return "\n".join(lines)
