"""MkDocs hook: let mkdocstrings document lioncub's public names where users import them.

1. `lioncub.LionCub`, `lioncub.attach_ddp`, ... are lazy (`lioncub.__getattr__`), which griffe's static
   analysis cannot follow: each `::: lioncub.NAME` line is rewritten to the object's defining module, found by
   importing it (so a module that is renamed needs no change here), with the public name as its heading.
2. `lioncub.simulator` and `lioncub.kernels` live in top-level folders (pyproject's `package-dir`), which
   griffe cannot map: the handler searches a temporary tree laid out as the installed package.
"""

from __future__ import annotations

import atexit
import importlib
import os
import re
import shutil
import tempfile

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mkdocs.plugins import event_priority

_DIRECTIVE = re.compile(r"^::: (lioncub(?:\.\w+)+)[ \t]*$", re.M)
_TREE: list[str] = []


def _package_tree(root: str) -> str:
    """A temporary folder holding `lioncub/` with every package-dir mapping of pyproject.toml as a symlink."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top = tempfile.mkdtemp(prefix="lioncub-docs-")
    atexit.register(shutil.rmtree, top, ignore_errors=True)
    pkg = os.path.join(top, "lioncub")
    os.mkdir(pkg)
    base = os.path.join(root, mapping["lioncub"])
    mapped = {name.split(".", 1)[1]: path for name, path in mapping.items() if name.startswith("lioncub.")}
    for entry in os.listdir(base):
        if entry not in mapped:
            os.symlink(os.path.join(base, entry), os.path.join(pkg, entry))
    for sub, path in mapped.items():
        os.symlink(os.path.join(root, path), os.path.join(pkg, sub))
    return top


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config, **kwargs):
    root = os.path.dirname(config.config_file_path)
    if not _TREE:
        _TREE.append(_package_tree(root))
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [_TREE[0]]
    return config


def _resolve(public: str):
    """The object a dotted public name gives, imported as a user would: the longest importable module, then
    attributes (lazy ones included)."""
    parts = public.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(public)


def _defining_path(public: str) -> str:
    obj = _resolve(public)
    if hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
        return f"{obj.__module__}.{obj.__qualname__}"
    return getattr(obj, "__name__", public)  # a module


def on_page_markdown(markdown, page, config, files, **kwargs):
    def rewrite(m):
        public = m.group(1)
        target = _defining_path(public)
        if target == public:
            return m.group(0)
        return f"::: {target}\n    options:\n      heading: \"{public}\"\n      toc_label: \"{public}\""

    return _DIRECTIVE.sub(rewrite, markdown)
