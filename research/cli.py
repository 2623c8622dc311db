"""`python -m research`: the research tools' commands, run as `lioncub` runs its own (lioncub.cli.main).

Each command's module exposes `register(subparsers)` and is imported only when that command runs.
"""

from __future__ import annotations

from lioncub import cli

# command -> (the module of its CLI, defining register(subparsers); one-line help)
COMMANDS = {
    "risk": ("research.risk.cli", "fit autotune's convergence-risk rule to a map, check it, pre-register"),
    "bench": ("research.bench", "the convergence map and pooled lab runs"),
    "lab": ("research.calibration_validation", "the calibrated simulator checked on the lab (validate)"),
    "corpus": ("research.corpus_cli", "build, show or check the python-src training corpus"),
}
PROG = "python -m research"


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMANDS, PROG, "The research tools beside lioncub: risk rule, convergence map, "
                                          "pooled lab runs, validation, corpus.")
