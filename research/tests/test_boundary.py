"""Dependencies point one way: research imports lioncub, and nothing under lioncub/, kernels/ or simulator/ (the
installed package, where research is not) imports research, not even for type checking or by name."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = ("lioncub", "kernels", "simulator")
RESEARCH = re.compile(r"research(\.\w+)*")


def research_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of research in `source`, and every string naming a research module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("research...") and the like
        else:
            continue
        found += [(node.lineno, n) for n in names if RESEARCH.fullmatch(n)]
    return found


def test_the_scanner_finds_each_way_of_importing():
    src = ("import research.cli\nif TYPE_CHECKING:\n    from research import RESULTS\n"
           "def f():\n    importlib.import_module('research.bench')\nfrom .research import x\n")
    assert research_imports(src) == [(1, "research.cli"), (3, "research"), (5, "research.bench")]


def test_the_installed_package_never_imports_research():
    files = [p for d in INSTALLED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    found = [f"{p.relative_to(ROOT)}:{line} {name}" for p in files for line, name in research_imports(p.read_text())]
    assert not found, "the installed package imports research:\n  " + "\n  ".join(found)
