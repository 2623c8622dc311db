"""`lioncub bench ...`: one sub-command per benchmark module of this package.

The options are declared here and each handler imports its benchmark's module when it runs, so
`lioncub bench simulator` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib

from lioncub.apps.options import at_least, positive
from lioncub.methods import NAMES as METHODS


def parse_sizes(text: str) -> list[int]:
    """--sizes of `bench kernels` (the kernels benchmark defines the units; imported only when given)."""
    from .kernels import parse_sizes as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _step_arguments(p) -> None:
    p.add_argument("--ranks", type=at_least(2, " (ranks that communicate)"), default=4)
    p.add_argument("--params", type=positive, default=5e6, help="approximate parameter count (default 5e6)")
    p.add_argument("--steps", type=at_least(1), default=6, help="timed steps per round")
    p.add_argument("--rounds", type=at_least(1), default=3, help="interleaved rounds over the methods")
    p.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    p.add_argument("--no-public", action="store_true", help="skip the public majority-vote reference")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=positive, default=None,
                   help="also run each method with buckets of this many MiB (rows method@<size>MiB), e.g. 64: the "
                        "default buckets against one large bucket in the same run")
    p.add_argument("--backward", action="store_true",
                   help="the gradients come through autograd before each step, and LionCub runs with overlap=False: "
                        "step() communicates, and takes the pre-pass backward took (default: gradients set by hand)")
    p.add_argument("--json", action="store_true")


def _kernels_arguments(p) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU (Triton kernels) if there is one, else the CPU (torch twins)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="bucket sizes in elements, e.g. 1M,4M (default 1M,4M,16M,64M,256M on a GPU, 1M,4M,16M on CPU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--world-size", type=at_least(1), default=8,
                   help="N for the vote rows and the p-bit layout (default 8)")
    p.add_argument("--repeat", type=at_least(1), default=None, help="timed runs per measurement")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default 1 on CPU)")
    p.add_argument("--ptx", action="store_true", help="also compile the Triton kernels for sm_90 (no GPU needed) "
                                                       "and report their global memory instructions")
    p.add_argument("--json", action="store_true")


def _simulator_arguments(p) -> None:
    p.add_argument("--ranks", type=at_least(1), default=1024, help="ranks of the collective benchmark")
    p.add_argument("--size", default="256MiB", help="allreduce size")
    p.add_argument("--gpus-per-node", type=at_least(1), default=8)
    p.add_argument("--bandwidth", default="10Gbit")
    p.add_argument("--latency", default="20us")
    p.add_argument("--step-ranks", type=at_least(1), default=256, help="ranks of the training-step benchmark")
    p.add_argument("--params", default="1.3B", help="parameters of the training-step benchmark")
    p.add_argument("--scale-ranks", default="64,256,1000,1024,2048,10000,100000",
                   help="comma-separated ranks of the cluster-scale rows ('' for none): 1 GiB allreduce at "
                        "1 Gbit/s, auto and the binomial tree alone")
    p.add_argument("--scale-step-ranks", type=at_least(0), default=100000,
                   help="ranks of the cluster-scale simulate step (vote-1bit, --scale-params) and autotune rows "
                        "(0: none)")
    p.add_argument("--scale-params", default="70B", help="parameters of the cluster-scale simulate step row")
    p.add_argument("--autotune-params", default="1.3B", help="parameters of the cluster-scale autotune row")
    p.add_argument("--repeat", type=at_least(1), default=1,
                   help="run each cluster-scale row this many times, keep the fastest")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _train_arguments(p) -> None:
    p.add_argument("--bandwidth", default="100Mbit,1Gbit", help="comma-separated link rates")
    from .train import CONFIG_SYNTAX

    p.add_argument("--ranks", type=at_least(1), default=4)
    p.add_argument("--ranks-per-host", type=at_least(1), default=1,
                   help="ranks sharing each host's link (nodes of GPUs; ranks of a host talk over its loopback)")
    p.add_argument("--steps", type=at_least(1), default=100)
    p.add_argument("--model", default="char-small")
    p.add_argument("--configs", help=CONFIG_SYNTAX)
    p.add_argument("--local-steps", dest="local_steps", type=int,
                   help="run every LionCub configuration with H local steps (or give one its own: method+local:H)")
    p.add_argument("--outer", help="the outer optimizer with --local-steps (avg[:LR[:MU]], nesterov, sign)")
    p.add_argument("--ddp-hook", action="store_true",
                   help="also run each LionCub configuration inside torch DDP (lioncub.attach_ddp)")
    p.add_argument("--json", action="store_true")


def _convergence_arguments(p) -> None:
    p.add_argument("--ranks", type=at_least(1), default=4)
    p.add_argument("--steps", type=at_least(1), default=300)
    p.add_argument("--model", default="char-small")
    p.add_argument("--configs", help="comma-separated method[@sync][+warmup:K] (K dense steps first)"
                                     "[+local:H[:outer][+stream:F[:D]]] (H local steps, streamed in F fragments)")
    p.add_argument("--local-steps", dest="local_steps", type=int,
                   help="run every LionCub configuration with H local steps (or give one its own: method+local:H)")
    p.add_argument("--outer", help="the outer optimizer with --local-steps (avg[:LR[:MU]], nesterov, sign)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the loss curves here")
    p.add_argument("--json", action="store_true")


# name -> (options, module of this package, its run function, help)
BENCHES = {
    "step": (_step_arguments, "step", "run", "optimizer step per method on Gloo ranks vs a local Lion step"),
    "kernels": (_kernels_arguments, "kernels", "run", "codec kernels: GB/s and fraction of copy bandwidth"),
    "simulator": (_simulator_arguments, "simulator", "run", "simulator wall time on large collectives and steps"),
    "train": (_train_arguments, "train", "run_train",
              "every method on the lab: speedup, loss, bytes, predicted vs measured (root)"),
    "convergence": (_convergence_arguments, "train", "run_convergence",
                    "every method's loss curve against the baseline on local ranks (PNG + table)"),
}


def _handler(module: str, run: str):
    def handler(args) -> int:
        return getattr(importlib.import_module(f"{__package__}.{module}"), run)(args)

    return handler


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (speed and accuracy targets)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (arguments, module, run, help_) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        arguments(bp)
        bp.set_defaults(func=_handler(module, run))
    p.set_defaults(func=lambda args: p.print_help() or 2)
