"""The import graph: no cycles anywhere in lioncub, and the pure-Python parts import no torch.

The graph is read statically (ast) from the source of every module of the installed lioncub packages
(lioncub, lioncub.kernels, lioncub.simulator, ...: wherever the installation maps them), from their
`import` and `from ... import` statements, relative ones resolved. Two graphs: the imports that run
when a module is imported (module level, including `if`/`try` blocks and class bodies), and those plus
the deferred ones inside functions (how a command imports its heavy parts only when it runs). Neither
may have a cycle: a deferred cycle is still two modules that need each other. Importing `a.b.c` also
runs `a` and `a.b`, so it depends on them too, except on the packages that contain the importing module
(those are already being imported when it runs). Imports under `if TYPE_CHECKING:` count too: they never run, but
two modules whose annotations name each other's types still need each other (and a checker must resolve both).
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = "lioncub"
# packages the installation maps elsewhere than below lioncub/ (pyproject.toml: package-dir)
MAPPED = ("lioncub.kernels", "lioncub.simulator")


def _walk(name: str, location: Path, out: dict[str, Path]) -> None:
    out[name] = location / "__init__.py"
    for info in pkgutil.iter_modules([str(location)]):
        full = f"{name}.{info.name}"
        if info.ispkg:
            _walk(full, location / info.name, out)
        else:
            out[full] = location / f"{info.name}.py"


def lioncub_modules() -> dict[str, Path]:
    """Every module of the installed lioncub packages -> its source file (nothing is imported)."""
    out: dict[str, Path] = {}
    for name in (ROOT, *MAPPED):
        if name in out:
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed as a package"
        _walk(name, Path(list(spec.submodule_search_locations)[0]), out)
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _import_nodes(tree: ast.Module, deferred: bool):
    """Import statements at module level (in `if`/`try` blocks and class bodies, `if TYPE_CHECKING:` included),
    and with `deferred`, those in functions too."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        else:
            stack.extend(ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name: str, path: Path, modules: dict[str, Path], deferred: bool = False) -> set[str]:
    """The lioncub modules that importing `name` runs directly (with `deferred`: or its functions import)."""
    package = name if _is_package(path) else name.rpartition(".")[0]
    targets = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), deferred):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module
        submodules = [f"{src}.{alias.name}" for alias in node.names if f"{src}.{alias.name}" in modules]
        targets += submodules
        if len(submodules) < len(node.names):  # names defined by `src` itself: it must have run
            targets.append(src)
    deps = set()
    own = set(_ancestors(name))
    for t in targets:
        while t and t not in modules:  # `import a.b.attr` style: the longest prefix that is a module
            t = t.rpartition(".")[0]
        if not t:
            continue
        deps.add(t)
        deps.update(a for a in _ancestors(t) if a in modules and a not in own)  # implied: a.b for a.b.c
    deps.discard(name)
    return deps


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    modules = lioncub_modules()
    return {name: imports_of(name, path, modules, deferred) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> b -> ... -> a) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in sccs:  # a shortest way around the component, from its first module back to it
        members, start = set(comp), comp[0]
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        out.append(found)
    return out


def test_every_installed_package_is_walked():
    modules = lioncub_modules()
    for name in ("lioncub.cli", "lioncub.comm.wire", "lioncub.kernels.reference",
                 "lioncub.simulator.collectives.simulate", "lioncub.apps.benchmarks.cli", "lioncub.apps.lab.probes",
                 "lioncub.apps.calibrate.cli", "lioncub.apps.autotune.cli"):
        assert name in modules, name
    assert all(path.is_file() for path in modules.values())


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_relative_imports_are_resolved():
    graph = import_graph()
    assert "lioncub.apps.lab.netns" in graph["lioncub.apps.lab.lab"]  # from . import netns
    assert "lioncub.apps.lab.launch" in graph["lioncub.apps.lab.lab"]  # from .launch import ...
    assert "lioncub.simulator.units" in graph["lioncub.apps.lab.lab"]  # from lioncub.simulator.units import ...
    assert "lioncub.simulator" in graph["lioncub.apps.lab.lab"]  # ... which runs lioncub.simulator's __init__
    assert "lioncub.apps.calibrate" in graph["lioncub.apps.calibrate.cli"]  # from . import calibrate_lab


def test_deferred_imports_are_seen():
    assert "lioncub.apps.benchmarks.kernels" not in import_graph()["lioncub.apps.benchmarks.cli"]
    # `bench kernels --sizes` parsed by the kernels benchmark, imported when the option is given
    assert "lioncub.apps.benchmarks.kernels" in import_graph(deferred=True)["lioncub.apps.benchmarks.cli"]


def test_type_checking_imports_are_seen():
    # network.py names BackendProfile in annotations only, imported under `if TYPE_CHECKING:`
    assert "lioncub.simulator.profiles" in import_graph()["lioncub.simulator.net.network"]


def test_no_import_cycles():
    for deferred in (False, True):
        found = cycles(import_graph(deferred))
        assert not found, f"import cycles{' (with deferred imports)' if deferred else ''}:\n" + "\n".join(
            "  " + " -> ".join(c) for c in found)


def package_of(module: str, modules: dict) -> str:
    """The package a module belongs to (a package is its own)."""
    return module if _is_package(modules[module]) else module.rpartition(".")[0]


def package_graph() -> dict[str, set[str]]:
    """Which packages import which, deferred imports included (a package's parents are not counted: importing
    lioncub.apps.lab runs lioncub and lioncub.apps, which is nesting, not a dependency between layers)."""
    modules = lioncub_modules()
    graph: dict[str, set[str]] = {}
    for name, deps in import_graph(deferred=True).items():
        mine = package_of(name, modules)
        targets = {package_of(d, modules) for d in deps}
        graph.setdefault(mine, set()).update(t for t in targets if t != mine and not mine.startswith(t + "."))
    return graph


def test_no_package_cycles_even_through_deferred_imports():
    graph = package_graph()
    assert "lioncub.apps.lab" in graph["lioncub.apps.calibrate"]  # calibration uses the lab ...
    found = cycles(graph)  # ... and nothing leads back
    assert not found, "package cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_the_layers_point_one_way():
    """core (kernels, comm, methods, optim) <- integrations <- applications; the simulator uses only the
    pure-Python core (the wire format and the methods' arithmetic)."""
    graph = package_graph()
    core = ("lioncub.kernels", "lioncub.comm", "lioncub.methods", "lioncub.optim")
    above = ("lioncub.integrations", "lioncub.apps", "lioncub.simulator")
    for pkg, deps in graph.items():
        if pkg.startswith(core):
            assert not [d for d in deps if d.startswith(above)], (pkg, deps)
        if pkg.startswith("lioncub.integrations"):
            assert not [d for d in deps if d.startswith(("lioncub.apps", "lioncub.simulator"))], (pkg, deps)
    assert not [d for d in graph["lioncub.simulator"] if d.startswith(("lioncub.optim", "lioncub.integrations"))]


def test_calibration_uses_the_lab_and_the_lab_knows_no_probes():
    graph = import_graph(deferred=True)
    lab = [m for m in graph if m == "lioncub.apps.lab" or m.startswith("lioncub.apps.lab.")]
    assert not {(m, d) for m in lab for d in graph[m] if d.startswith("lioncub.apps.calibrate")}
    assert "lioncub.apps.lab.probes" not in graph["lioncub.apps.lab.lab"]


NO_TORCH = r"""
import argparse, contextlib, io, pkgutil, sys
import lioncub.simulator, lioncub.comm.wire, lioncub.apps.benchmarks, lioncub.apps.benchmarks.cli
import lioncub.apps.benchmarks.simulator, lioncub.apps.lab, lioncub.apps.lab.cli, lioncub.apps.lab.probes
import lioncub.apps.calibrate.fit, lioncub.apps.autotune.cli, lioncub.optim.schedules
for m in pkgutil.walk_packages(lioncub.simulator.__path__, "lioncub.simulator."):
    __import__(m.name)
from lioncub import cli
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(["simulate", "step", "--method", "vote-1bit", "--params", "1M", "--compute-seconds", "0.1",
                     "--ranks", "4", "--json"]) == 0
    assert cli.main(["bench", "simulator", "--ranks", "16", "--size", "1MiB", "--step-ranks", "8",
                     "--params", "1M", "--scale-ranks", "", "--scale-step-ranks", "0", "--json"]) == 0
    for argv in (["bench", "--help"], ["bench", "step", "--help"], ["bench", "kernels", "--help"],
                 ["lab", "--help"], ["calibrate", "--help"], ["autotune", "--help"]):
        try:
            cli.main(argv)
        except SystemExit:
            pass
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "triton")
assert not bad, bad
print("ok")
"""


def test_pure_python_parts_import_no_torch():
    """lioncub.simulator, lioncub.comm.wire, the lab's launcher side, the calibration fit, autotune's search and
    every command's --help (and `simulate`, `bench simulator`) run without importing torch."""
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
