"""Python's conventions for the public API (issue 51 item 4): every `lioncub.xxx` the docs name resolves, and
every module among them imports as a module (`import lioncub.checkpoint`, `from lioncub.checkpoint import save`);
a spelling the docs used before keeps working with a DeprecationWarning naming the new one; `dir()` and tab
completion list the lazy exports."""

from __future__ import annotations

import importlib
import re
import rlcompleter
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lioncub

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
_NAME = re.compile(r"(?<![\w.])lioncub(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def documented_names() -> dict[str, str]:
    """Every dotted `lioncub.x.y` in README.md and docs/**/*.md -> where it first appears."""
    found = {}
    for page in PAGES:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for m in _NAME.finditer(line):
                found.setdefault(m.group(0).rstrip("."), f"{page.relative_to(ROOT)}:{i}")
    return found


NAMES = documented_names()


def test_the_docs_name_modules_and_attributes():
    assert {"lioncub.checkpoint", "lioncub.checkpoint.save", "lioncub.simulator", "lioncub.GradScaler"} <= set(NAMES)


def resolve(name: str):
    """(the object `name` is, the dotted prefixes that are modules): each prefix imported as a module where it is
    one (`import lioncub.simulator`), else reached as an attribute (`lioncub.LionCub`); an attribute that is a
    module but does not import as one (what `lioncub.checkpoint` was) fails."""
    obj, modules = lioncub, ["lioncub"]
    parts = name.split(".")
    for i in range(2, len(parts) + 1):
        prefix = ".".join(parts[:i])
        try:
            obj = importlib.import_module(prefix)
            modules.append(prefix)
            continue
        except ModuleNotFoundError as exc:
            if exc.name != prefix:
                raise
        obj = getattr(obj, parts[i - 1])
        assert not isinstance(obj, types.ModuleType), f"{prefix} is a module object that does not import as a module"
    return obj, modules


@pytest.mark.parametrize("name", sorted(NAMES), ids=str)
def test_every_documented_name_resolves_and_its_modules_import(name):
    obj, modules = resolve(name)
    assert obj is not None, NAMES[name]
    for module in modules[1:]:  # the attribute and the module are one object (`lioncub.checkpoint`)
        parent, _, child = module.rpartition(".")
        assert getattr(sys.modules[parent], child) is sys.modules[module], f"{NAMES[name]}: {module}"


def test_the_documented_modules_import_in_a_fresh_interpreter():
    """The count the issue asks for (documented modules that import as modules), each in a clean `python -c`:
    the lazy attribute must not be what makes it work."""
    modules = sorted({m for name in NAMES for m in resolve(name)[1]})
    assert {"lioncub.checkpoint", "lioncub.simulator", "lioncub.integrations", "lioncub.comm.transport"} <= set(modules)
    code = "; ".join(f"import {m}" for m in modules) + "; from lioncub.checkpoint import save, load"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_old_spellings_keep_working():
    from lioncub.checkpoint import load, save
    from lioncub.integrations import checkpoint

    assert save is checkpoint.save and load is checkpoint.load and lioncub.checkpoint.save is save
    with pytest.deprecated_call(match="use lioncub.GradScaler"):
        from lioncub.amp import GradScaler
    assert GradScaler is lioncub.GradScaler
    with pytest.deprecated_call(match="use lioncub.GradScaler"):
        assert lioncub.amp.GradScaler is lioncub.GradScaler


def test_dir_and_tab_completion_list_the_exports():
    listed = dir(lioncub)
    for name in ("LionCub", "LocalSteps", "GradScaler", "attach_ddp", "init_distributed", "checkpoint", "amp"):
        assert name in listed, name
    assert set(lioncub.__all__) <= set(listed)
    completer = rlcompleter.Completer({"lioncub": lioncub})
    options = [completer.complete("lioncub.Li", i) for i in range(4)]
    assert "lioncub.LionCub(" in options or "lioncub.LionCub" in options, options
    assert completer.complete("lioncub.checkp", 0) == "lioncub.checkpoint"
    import lioncub.integrations as integrations

    assert {"attach_ddp", "replace_grad_scaler", "lightning_callback"} <= set(dir(integrations))


def test_an_unknown_name_says_so():
    with pytest.raises(AttributeError, match="no attribute 'LionCubb'"):
        lioncub.LionCubb  # noqa: B018
