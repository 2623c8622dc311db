"""The optional dependencies: progress bars (tqdm) and plots (matplotlib).

A user of the optimizer alone installs `lioncub` with torch and numpy; the tools that draw bars and figures
ask for them here, so that a missing package costs a bar (nothing is drawn) or one clear line (a plot was
asked for), never an ImportError from deep inside a command. `pip install 'lioncub[tools]'` brings both.
"""

from __future__ import annotations

import importlib

EXTRA = "tools"


class _NoBar:
    """What `progress_bar` returns without tqdm: accepts the calls the tools make and draws nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(**kwargs):
    """A tqdm progress bar with `kwargs` (total, desc, unit, ...), or an object that draws nothing when tqdm
    is not installed.

    Args:
        **kwargs: passed to `tqdm.tqdm`.

    Returns:
        The bar: it has `update(n)`, `set_postfix(...)` and `close()`.

    Example:
        >>> bar = progress_bar(total=3, disable=True)
        >>> bar.update(1); bar.close()
    """
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return _NoBar()
    return tqdm(**kwargs)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display).

    Returns:
        The `matplotlib.pyplot` module.

    Raises:
        ValueError: matplotlib is not installed (one line, naming the extra that brings it).
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ValueError(f"plots need matplotlib: pip install 'lioncub[{EXTRA}]' (or matplotlib)") from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
