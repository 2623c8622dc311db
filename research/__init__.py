"""The research tools beside lioncub, and the lab notebook they write: not installed with the package.

    python -m research --help

Each tool answers a question about lioncub rather than being something a user of it runs: the convergence map
and the risk rule fitted to it (risk/), pre-registered checks of that rule, the learning-rate sweep's pick,
pooling of lab runs, the calibrated simulator's validation on the lab, and the training corpus's build and check
for carrying to a GPU machine. Dependencies point one way: this imports lioncub, lioncub never imports this.
notebook/ holds the dated history (BENCHMARKS.md, VALIDATION.md) and its raw results and figures.
"""

from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent / "notebook"
RESULTS = NOTEBOOK / "results"
