"""`python -m research bench {convergence-map,pool}`: the benchmarks that build the lab notebook's evidence.

`lioncub bench` keeps what a user measures (step, kernels, simulator, train, convergence curves); these two
turn many runs into one result: the convergence map the risk rule is fitted on, and lab runs pooled row by row.
"""

from __future__ import annotations

from lioncub.apps.options import at_least, positive


def _convergence_map_arguments(p) -> None:
    p.add_argument("--ranks", type=at_least(1), default=4)
    p.add_argument("--steps", type=at_least(1), help="default 200")
    p.add_argument("--model", help="default char-tiny")
    p.add_argument("--configs", help="comma-separated method[@sync][+warmup:K] (K dense steps first)"
                                     "[+local:H[:outer][+stream:F[:D]]] (H local steps, streamed in F fragments)")
    p.add_argument("--plot", default=None, metavar="PNG", help="--merge: write the heat map here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--part", metavar="I/N", help="run the I-th of N contiguous slices of the runs")
    p.add_argument("--output", metavar="JSON", help="write (and resume) the runs here; --merge: the map")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join part files into the map (table, --plot)")
    p.add_argument("--worlds", help="world sizes (default 2,4)")
    p.add_argument("--batches", help="per-rank batches (default 8,16)")
    p.add_argument("--lr", type=positive, help="the lr the factors multiply (default: the model's default lr)")
    p.add_argument("--lr-factors", dest="lr_factors", help="lrs as multiples of --lr (default 1,2)")
    p.add_argument("--seeds", help="seeds (default 0,1)")
    p.add_argument("--device", help="cpu (default), cuda, ...: where every rank trains (ranks share it)")
    p.add_argument("--data", choices=("pydoc-topics", "python-src"), help="the text (default: the model's)")
    p.add_argument("--block-size", dest="block_size", type=at_least(2), help="default the model's (64, byte-*: 256)")
    p.add_argument("--amp", choices=("none", "bf16"), help="bf16 autocast for the forward pass")
    p.add_argument("--eval-batches", dest="eval_batches", type=at_least(1), help="validation batches (default 8)")
    p.add_argument("--deadline", type=float, metavar="EPOCH",
                   help="start no run predicted (from a finished run of its kind) to end after this time")


def _pool_arguments(p) -> None:
    p.add_argument("files", nargs="+", metavar="RUN.json", help="`lioncub bench train --json` outputs")
    p.add_argument("--model", help="only this model's rows")
    p.add_argument("--plot", metavar="PNG", help="write each configuration's speedup against compute per step here")
    p.add_argument("--configs", help="--plot: only these methods (comma-separated, e.g. vote-1bit,l1-pbit)")
    p.add_argument("--json", action="store_true")


def _run_convergence_map(args) -> int:
    from research import convergence_map

    return convergence_map.run(args)


def _run_pool(args) -> int:
    from research import pooling

    return pooling.run(args)


# name -> (options, handler, help)
BENCHES = {
    "convergence-map": (_convergence_map_arguments, _run_convergence_map,
                        "the convergence map: regimes (ranks x per-rank batch x lr) x seeds x configurations"),
    "pool": (_pool_arguments, _run_pool,
             "several `lioncub bench train` runs pooled: each row's median and range, with the compute per step"),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="the convergence map and pooled lab runs")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (arguments, handler, help_) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        arguments(bp)
        bp.set_defaults(func=handler)
    p.set_defaults(func=lambda args: p.print_help() or 2)
