"""Files named on the command line: read one, check before a long run that one can be written, or write JSON
so that a crash never leaves half a file.

Reading and checking fail with a one-line ValueError (which `lioncub` prints as `lioncub: error: ...`), not a
traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path, what: str):
    """The JSON value in `path`; `what` names the file in the error ("config file", "measurements")."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None


def check_writable(path, flag: str) -> None:
    """Raise now if `path` (given with `flag`) cannot be written: its directory is missing or read-only,
    or it is a directory. Call it before the work whose result goes there."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path}: permission denied")


def write_json(path, value, indent: int | None = 1, newline: bool = False) -> None:
    """Write `value` as JSON to `path` through a temporary file and a rename: readers see the old file or the
    whole new one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=indent)
        if newline:
            f.write("\n")
    os.replace(tmp, path)
