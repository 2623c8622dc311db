"""argparse types for the commands' counts and sizes: a number out of range is refused by the parser in one line
("argument --ranks: must be at least 2, got 1") before any rank starts, not by a ZeroDivisionError deep in a run,
and never taken as "the default" because it is 0."""

from __future__ import annotations

import argparse
import math


def at_least(low: int, what: str = ""):
    """An int option's type that refuses values below `low`; `what` says why the bound, if not obvious."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{what}, got {value}")
        return value
    return parse


def positive(text: str) -> float:
    """A float option's type that refuses 0, negative, infinite and NaN values."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value
