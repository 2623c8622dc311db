"""README.md and the docs site (docs/**/*.md, mkdocs.yml): every code block runs, and the site builds strictly.

Every fenced block of README.md and docs/**/*.md is handled by its language, and a language not listed here fails:

* ```python: executed, the page's blocks in order, each in a fresh namespace, in one subprocess per page at world
  size 1 on CPU. A block after `<!-- docs-test: ranks=N -->` runs on N local Gloo ranks under torchrun's
  environment; one after `<!-- docs-test: root -->` needs root (the lab) and is skipped, with that reason, without
  it. A block that only includes a file (`--8<-- "examples/x.py"`, shown by pymdownx.snippets) names a file that
  exists and that a test under tests/ runs.
* ```console / ```bash: each command line must run as written: `lioncub ...` is parsed by lioncub's own parser (a
  flag that does not exist fails), `make X` names a Makefile target, `torchrun` / `python` / `srun` a script that
  exists and flags its parser defines, `pytest` paths that exist and markers pyproject registers, `bash` a script
  that exists.
* ```json / ```yaml / ```toml: parsed.
* ```text: program output, formulas or layouts, with nothing to run (ALLOWED).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
RUN, SHELL, DATA = {"python"}, {"console", "bash"}, {"json", "yaml", "toml"}
ALLOWED = {"text": "program output, formulas or layouts: nothing to run",
           "diff": "a patch included from a file (--8<--), which a test applies and runs"}
README_LIMIT = 12 * 1024
LOOP_BY_LINE = 40
ADVISE_BEGIN, ADVISE_END = "<!-- lioncub advise --markdown: begin -->", "<!-- lioncub advise --markdown: end -->"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<mark>[^>]*?)\s*-->\s*\Z")
_SNIPPET = re.compile(r'^--8<--\s+"(?P<path>[^"]+)"\s*$')
# torchrun's variables, removed so that a single-process block runs at world size 1
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    body: str
    mark: str  # "", "ranks=N" or "root"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def snippets(self) -> list[str] | None:
        """The files a block includes, if it is nothing but pymdownx.snippets lines."""
        lines = [x.strip() for x in self.body.splitlines() if x.strip()]
        found = [_SNIPPET.match(x) for x in lines]
        return [m["path"] for m in found] if lines and all(found) else None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        mark = _MARK.search(text[:m.start()])
        body = "\n".join(x[len(m["indent"]):] for x in m["body"].splitlines())
        out.append(Block(page, text.count("\n", 0, m.start()) + 1, m["lang"].lower(), body,
                         mark["mark"] if mark else ""))
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def _id(b: Block) -> str:
    return b.where


# ---------------------------------------------------------------------------------------------------------
# every block is one the tests know what to do with
# ---------------------------------------------------------------------------------------------------------
def test_every_block_has_a_known_language():
    unknown = [f"{b.where}: ```{b.lang or '(none)'}" for b in ALL if b.lang not in RUN | SHELL | DATA | set(ALLOWED)]
    assert not unknown, ("blocks in a language the docs tests neither run nor allow (add it to ALLOWED with a "
                         "reason, or write the block as python / console / text):\n" + "\n".join(unknown))
    marks = [f"{b.where}: {b.mark}" for b in ALL if b.mark and not (b.lang in RUN and _mark_ok(b.mark))]
    assert not marks, "docs-test marks on blocks they do not apply to:\n" + "\n".join(marks)


def _mark_ok(mark: str) -> bool:
    return mark == "root" or re.fullmatch(r"ranks=[2-8]", mark) is not None


def test_the_pages_have_blocks():
    assert len(ALL) > 20 and {b.lang for b in ALL} >= {"python", "console"}


# ---------------------------------------------------------------------------------------------------------
# python
# ---------------------------------------------------------------------------------------------------------
_DRIVER = """
import runpy, sys, traceback
for path, where in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"DOCS-BLOCK-FAILED {where}: exit {exc.code}", file=sys.stderr)
            raise
    except BaseException:
        print(f"DOCS-BLOCK-FAILED {where}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    print(f"DOCS-BLOCK-OK {where}", flush=True)
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", LIONCUB_KERNELS="torch", PYTHONPATH=str(ROOT), **extra)
    return env


def _write(tmp_path: Path, bs: list[Block]) -> list[str]:
    argv = []
    for i, b in enumerate(bs):
        f = tmp_path / f"block{i:02d}_line{b.line}.py"
        f.write_text(b.body + "\n")
        argv += [str(f), b.where]
    return argv


def _runnable(b: Block) -> bool:
    return b.lang in RUN and b.snippets is None


SINGLE = {}
for _b in ALL:
    if _runnable(_b) and not _b.mark:
        SINGLE.setdefault(_b.page, []).append(_b)


@pytest.mark.parametrize("page", sorted(SINGLE), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path):
    """The page's python blocks, in order, at world size 1 (one subprocess; each block in a fresh namespace)."""
    bs = SINGLE[page]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *_write(tmp_path, bs)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    ok = proc.stdout.count("DOCS-BLOCK-OK")
    assert proc.returncode == 0, (f"{ok} of {len(bs)} blocks of {page.name} ran; then\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert ok == len(bs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("block", [b for b in ALL if _runnable(b) and b.mark.startswith("ranks=")], ids=_id)
def test_python_blocks_on_ranks(block, tmp_path):
    """A block marked ranks=N, on N local processes with torchrun's environment (Gloo on CPU)."""
    n, port = int(block.mark.split("=")[1]), _free_port()
    argv = _write(tmp_path, [block])
    procs = [subprocess.Popen([sys.executable, "-c", _DRIVER, *argv], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(n)]
    outs = []
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(r, o, e) for r, (p, (o, e)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not bad, "\n".join(f"rank {r}:\n{o[-2000:]}\n{e[-4000:]}" for r, o, e in bad)


@pytest.mark.parametrize("block", [b for b in ALL if _runnable(b) and b.mark == "root"], ids=_id)
def test_python_blocks_as_root(block, tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"{block.where} uses the lab, which needs root")
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *_write(tmp_path, [block])], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _tested_files() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in RUN | {"diff"} and b.snippets is not None],
                         ids=_id)
def test_included_files_exist_and_run_in_the_tests(block):
    tests = _tested_files()
    for path in block.snippets:
        assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"
        assert Path(path).name in tests, f"{block.where}: no test under tests/ runs {path}"


# ---------------------------------------------------------------------------------------------------------
# console
# ---------------------------------------------------------------------------------------------------------
def command_lines(body: str) -> list[str]:
    """The commands of a console block: continuations joined, comments and a `$ ` prompt dropped."""
    out, cur = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        line = (cur + line).strip()
        cur = ""
        line = line[2:] if line.startswith("$ ") else line
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def _markers() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return {m.split(":")[0].strip() for m in cfg}


def _check_lioncub(argv: list[str]) -> None:
    from lioncub.cli import build_parser

    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"lioncub's parser refused it (exit {exc.code})") from None
    assert getattr(args, "func", None) is not None, "not a complete lioncub command"


def _check_module(argv: list[str]) -> None:
    """`python -m research ...` (the research tools' commands, parsed by their parser) or `python -m lioncub.cli`."""
    assert len(argv) >= 2, "python -m without a module"
    module, rest = argv[1], argv[2:]
    if module == "lioncub.cli":
        _check_lioncub(rest)
        return
    assert module == "research", f"no check for python -m {module}"
    from lioncub.cli import build_parser
    from research.cli import COMMANDS, PROG

    command = next((a for a in rest if not a.startswith("-")), None)
    try:
        args = build_parser(command, COMMANDS, PROG).parse_args(rest)
    except SystemExit as exc:
        raise AssertionError(f"{PROG}'s parser refused it (exit {exc.code})") from None
    assert getattr(args, "func", None) is not None, f"not a complete {PROG} command"


def _check_script(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        _check_module(argv)
        return
    script = next((a for a in argv if a.endswith(".py")), None)
    assert script is not None, "no script named"
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    source = path.read_text()
    flags = [a.split("=")[0] for a in argv[argv.index(script) + 1:] if a.startswith("--")]
    missing = [f for f in flags if f'"{f}"' not in source]
    assert not missing, f"{script} defines no {', '.join(missing)}"


def check_command(line: str) -> None:
    line = re.sub(r"\$\([^)]*\)", "x.json", line)  # a shell substitution stands for a file argument
    argv = shlex.split(line)
    while argv and (argv[0] == "sudo" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0])):
        argv = argv[1:]
    prog, rest = argv[0], argv[1:]
    if prog == "lioncub":
        _check_lioncub(rest)
    elif prog == "make":
        targets = [a for a in rest if "=" not in a and not a.startswith("-")]
        assert targets, "make without a target"
        unknown = set(targets) - _makefile_targets()
        assert not unknown, f"the Makefile has no target {', '.join(sorted(unknown))}"
    elif prog in ("torchrun", "python", "python3", "srun"):
        _check_script(rest)
    elif prog == "pytest":
        for i, a in enumerate(rest):
            if a == "-m":
                assert rest[i + 1] in _markers(), f"pytest marker {rest[i + 1]!r} is not registered"
            elif not a.startswith("-") and (i == 0 or rest[i - 1] != "-m"):
                assert (ROOT / a.split("::")[0]).exists(), f"{a} does not exist"
    elif prog == "bash":
        assert (ROOT / rest[0]).is_file(), f"{rest[0]} does not exist"
    elif prog == "pip":
        assert rest and rest[0] == "install", "only `pip install` is documented"
    else:
        raise AssertionError(f"no check for the program {prog!r}: add one to tests/test_docs.py")


SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_id)
def test_console_commands_exist(block):
    lines = command_lines(block.body)
    assert lines, f"{block.where}: an empty console block"
    failures = []
    for line in lines:
        try:
            check_command(line)
        except AssertionError as exc:
            failures.append(f"{line}\n    -> {exc}")
    assert not failures, f"{block.where}:\n" + "\n".join(failures)


def test_command_checks_catch_mistakes():
    for bad in ("lioncub simulate step --ranks 4 --params 1M --no-such-flag", "make no-such-target",
                "torchrun --nproc_per_node 2 examples/torchrun_minimal.py --no-such-flag", "curl example.com"):
        with pytest.raises(AssertionError):
            check_command(bad)
    check_command("python -m research bench pool $(cat files.txt) --plot x.png")
    check_command("sudo lioncub lab bench --op allreduce --ranks 2 --size 1MiB")


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [b for b in ALL if b.lang in DATA], ids=_id)
def test_data_blocks_parse(block):
    if block.lang == "json":
        json.loads(block.body)
    elif block.lang == "toml":
        tomllib.loads(block.body)
    else:
        import yaml

        yaml.safe_load(block.body)


# ---------------------------------------------------------------------------------------------------------
# README.md
# ---------------------------------------------------------------------------------------------------------
def test_readme_is_short_and_the_loop_comes_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes (at most {README_LIMIT})"
    first = next(b for b in blocks(ROOT / "README.md") if b.lang == "python")
    assert first.line <= LOOP_BY_LINE and "lioncub.LionCub(" in first.body, (
        f"the loop to copy starts at line {first.line} (at most {LOOP_BY_LINE})")


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_readme_advice_is_the_simulators():
    """README's "Which method?" table is exactly what `lioncub advise --markdown` prints."""
    from lioncub.apps import advice
    from lioncub.cli import build_parser

    text = (ROOT / "README.md").read_text()
    assert ADVISE_BEGIN in text and ADVISE_END in text
    shown = text.split(ADVISE_BEGIN, 1)[1].split(ADVISE_END, 1)[0].strip()
    args = build_parser("advise").parse_args(["advise", "--markdown"])
    assert shown == advice.render(args).strip(), ("README.md's table is not `lioncub advise --markdown`'s: "
                                                   "paste its output between the markers")


# ---------------------------------------------------------------------------------------------------------
# the site
# ---------------------------------------------------------------------------------------------------------
def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (as `make docs`): no warning, no broken link, every API reference found."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    log = proc.stdout + proc.stderr
    warnings = [x for x in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", x)]
    assert proc.returncode == 0 and not warnings, "\n".join(warnings) or log[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("lioncub.LionCub", "lioncub.attach_ddp", "lioncub.attach_fsdp", "lioncub.GradScaler",
                 "lioncub.checkpoint.save", "lioncub.simulator.simulate_step", "lioncub.apps.autotune.search"):
        assert name in api, f"the API reference has no {name}"
