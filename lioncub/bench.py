"""`lioncub bench ...`: speed and accuracy targets live here, not in timed tests."""

from __future__ import annotations

import importlib

# name -> (module, its add-arguments function, its run function, help)
BENCHES = {
    "step": ("lioncub.bench_step", "add_arguments", "run",
             "optimizer step per method on Gloo ranks vs a local Lion step"),
    "kernels": ("lioncub.kernels.bench", "add_arguments", "run",
                "codec kernels: GB/s and fraction of copy bandwidth"),
    "simulator": ("lioncub.simulator.bench", "add_arguments", "run",
                  "simulator wall time on large collectives and steps"),
    "train": ("lioncub.bench_train", "add_train_arguments", "run_train",
              "every method on the lab: speedup, loss, bytes, predicted vs measured (root)"),
    "convergence": ("lioncub.bench_train", "add_convergence_arguments", "run_convergence",
                    "every method's loss curve against the baseline on local ranks (PNG + table)"),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (speed and accuracy targets)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    from lioncub.cli import current_argv

    wanted = next((a for a in current_argv() if a in BENCHES), None)  # import only the bench being run
    for name, (module, add, run, help_) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        if name == wanted:
            mod = importlib.import_module(module)
            getattr(mod, add)(bp)
            bp.set_defaults(func=getattr(mod, run))
    p.set_defaults(func=lambda args: p.print_help() or 2)
