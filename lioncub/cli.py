"""The `lioncub` console script.

Each subcommand lives in its own module, which exposes `register(subparsers)`; this file only wires
them together. Registration must stay cheap (no torch import at module level in those modules) so
that `lioncub simulate ...` starts in well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) pairs; each module defines register(subparsers).
COMMANDS = [
    "lioncub.simulator.cli",
    "lioncub.bench",
    "lioncub.lab.cli",
    "lioncub.calibrate",
    "lioncub.autotune",
    "lioncub.train.cli",
    "lioncub.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lioncub",
        description="Communication-efficient distributed Lion: simulate, autotune, train.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a subsystem not built yet
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad input: a clear message, no traceback
        print(f"lioncub: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
