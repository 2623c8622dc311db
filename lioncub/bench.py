"""`lioncub bench {step,kernels,simulator}`: speed targets live here, not in timed tests."""

from __future__ import annotations

import importlib

# subcommand -> module with add_arguments(parser) and run(args)
BENCHES = {
    "step": ("lioncub.bench_step", "optimizer step per method on Gloo ranks vs a local Lion step"),
    "kernels": ("lioncub.kernels.bench", "codec kernels: GB/s and fraction of copy bandwidth"),
    "simulator": ("lioncub.simulator.bench", "simulator wall time on large collectives and steps"),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (speed and memory targets)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (module, help_) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            bp.set_defaults(func=lambda args, m=module: _missing(m))
            continue
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _missing(module: str) -> int:
    raise SystemExit(f"lioncub bench: {module} is not available in this build")
