"""The `lioncub` console script.

Each command lives in its own module, which exposes `register(subparsers)`. Only the module of the
command being run is imported, so `lioncub simulate ...` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command -> (the module of its CLI, defining register(subparsers); one-line help)
COMMANDS = {
    "simulate": ("lioncub.simulator.cli", "predict collective and training-step times (no GPU needed)"),
    "autotune": ("lioncub.apps.autotune.cli", "search method, collective, buckets and sync interval for a cluster"),
    "advise": ("lioncub.apps.advice", "which method to use, by link speed and compute per step (the simulator's)"),
    "train": ("lioncub.apps.train.cli", "train a built-in model with any method/config"),
    "lab": ("lioncub.apps.lab.cli", "emulated Ethernet cluster on this machine (network namespaces + tbf)"),
    "calibrate": ("lioncub.apps.calibrate.cli", "fit the simulator's backend profile to measurements"),
    "host": ("lioncub.apps.train.host_cli", "measure this machine's shared cores for the step model (about 40 s)"),
    "bench": ("lioncub.apps.benchmarks.cli", "benchmarks (speed and memory targets)"),
    "demo": ("lioncub.apps.demo", "simulate, autotune and train the default scenario (make demo)"),
}
DESCRIPTION = "Communication-efficient distributed Lion: simulate, autotune, train."


def build_parser(command: str | None = None, commands: dict = COMMANDS, prog: str = "lioncub",
                 description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The parser with every command listed and only `command`'s module imported to register its options."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in commands.items():
        if name == command:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None, commands: dict = COMMANDS, prog: str = "lioncub",
         description: str = DESCRIPTION) -> int:
    """Run one command of `commands` (the research tools' CLI, outside the package, runs its own through here)."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in commands else None, commands, prog, description)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        (parser.parse_args([args.command, "--help"]) if args.command else parser.print_help())
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad input: a clear message, not a traceback
        if os.environ.get("LIONCUB_DEBUG"):
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":  # python -m lioncub.cli: run the module's importable copy (commands read its argv)
    from lioncub.cli import main as _main

    sys.exit(_main())
