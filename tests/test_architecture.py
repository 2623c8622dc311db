"""The shape of the code: no object's private state used from outside its module, method names only in the
registry (issue 26), and sizes that follow the job (issue 49: a module holds one responsibility, up to about 800
lines; a function may follow numbered phases, up to 120; the caps catch a module or function that grew two jobs).
Read statically (ast) from the installed packages' sources (tests/test_imports.py walks them; import cycles are
checked there)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_imports import lioncub_modules

from lioncub import methods

MODULES = lioncub_modules()
ROOT = Path(MODULES["lioncub"]).parent.parent
CORE = ("lioncub.optim", "lioncub.methods", "lioncub.comm")
MAX_FUNCTION_LINES = 120
MAX_CORE_MODULE_LINES = 800
MAX_NAME_BRANCHES = 5

# other libraries' private members that have no public equivalent, each at the one place that needs it
FOREIGN_PRIVATE = {
    ("lioncub.optim.buckets", "t._version"): "torch's version counter of a tensor (autograd's own check)",
    ("lioncub.optim.backward", "torch.autograd.Variable._execution_engine"):
        "queue a callback at the end of backward, as torch DDP does",
    ("lioncub.apps.train.lab", "os._exit"): "leave a forked child without running the parent's atexit",
    ("lioncub.comm.clean_exit", "t._use_count"): "whether Gloo's worker still holds a collective's tensor (no "
                                                 "public way; the exit waits until it does not)",
    ("lioncub.integrations.checkpoint", "dist.distributed_c10d._get_default_store"):
        "torch.distributed's store, where each rank says it called save/load before any enters DCP's collectives "
        "(a rank-0-only call is refused in one line instead of hanging)",
    ("lioncub.kernels.triton_interpreter", "interp._patch_lang_tensor"):
        "teach the Triton interpreter (tests on CPU) what the compiler does; docs/KERNELS.md",
}
# modules whose job is to hold another library's internals, behind a pin and a test of what they rely on
FOREIGN_PRIVATE_MODULES = {
    "lioncub.simulator.net.engine": "SimPy's event queue and clock: simpy pinned in pyproject, "
                                "tests/simulator/test_simulator_engine.py, docs/SIMULATOR.md",
}


def _trees():
    for name, path in sorted(MODULES.items()):
        yield name, path, ast.parse(path.read_text(), str(path))


def _where(name, node) -> str:
    return f"{name}:{node.lineno}"


def private_uses() -> list[str]:
    """`x._name` for any x but self/cls, and `from module import _name` of another lioncub module."""
    found = []
    for name, _, tree in _trees():
        if name in FOREIGN_PRIVATE_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if (name, ast.unparse(node)) not in FOREIGN_PRIVATE:
                    found.append(f"{_where(name, node)} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lioncub"):
                found += [f"{_where(name, node)} from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def _is_kernel(fn) -> bool:
    """A Triton kernel or device function (its length is the algorithm's, not a design choice)."""
    return any("jit" in ast.unparse(d) or "device_fn" in ast.unparse(d) for d in fn.decorator_list)


def long_functions() -> list[str]:
    return [f"{_where(name, fn)} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)" for name, _, tree in _trees()
            for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES and not _is_kernel(fn)]


METHOD_NAMES = set(methods.NAMES) | {"ddp+lion"}


def _names_a_method(node) -> bool:
    """A method's name spelled out (or a tuple of them): code that means the baseline says methods.BASELINE,
    code that means a kind of method asks its capabilities."""
    if isinstance(node, ast.Constant):
        return node.value in METHOD_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_method(e) for e in node.elts)
    return False


def _is_collective_op(node) -> bool:
    """A collective's op ("allreduce", "allgather", ...: the baseline method shares the all-reduce's name)."""
    return any(isinstance(n, (ast.Name, ast.Attribute)) and (n.attr if isinstance(n, ast.Attribute) else n.id)
               in ("op", "ops") for n in ast.walk(node))


def name_branches() -> list[str]:
    """Comparisons (==, !=, in, not in) of a method's name, outside lioncub.methods (not of a collective's op)."""
    found = []
    for name, _, tree in _trees():
        if name.startswith("lioncub.methods"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                operands = [node.left, *node.comparators]
                if any(_names_a_method(x) for x in operands) and not any(_is_collective_op(x) for x in operands):
                    found.append(f"{_where(name, node)} {ast.unparse(node)}")
    return found


def test_no_private_state_of_another_object_is_used():
    found = private_uses()
    assert not found, "private members used from outside their owner:\n  " + "\n  ".join(found)


def test_no_function_is_longer_than_120_lines():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(found)


def test_core_modules_are_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()
             if name.startswith(CORE)}
    assert sizes and max(sizes.values()) <= MAX_CORE_MODULE_LINES, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_method_names_stay_in_the_registry():
    found = name_branches()
    assert len(found) <= MAX_NAME_BRANCHES, f"{len(found)} sites branch on a method's name:\n  " + "\n  ".join(found)


def test_the_scanners_find_what_they_look_for():
    tree = ast.parse("a = opt._buckets\nb = self._x\nif cfg.method == 'allreduce': pass\n"
                     "if x in ('vote-1bit',): pass\nif m == methods.BASELINE: pass\nif op == 'allreduce': pass")
    attrs = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")]
    assert [ast.unparse(a) for a in attrs if not (isinstance(a.value, ast.Name) and a.value.id == "self")] == [
        "opt._buckets"]
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    found = [any(_names_a_method(x) for x in [c.left, *c.comparators])
             and not any(_is_collective_op(x) for x in [c.left, *c.comparators]) for c in compares]
    assert found == [True, True, False, False]
