"""What `pip install lioncub` gets: every package directory is listed for setuptools, and the optimizer's loop
runs with only its own dependencies (torch, numpy) importable."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# installed name -> source directory (pyproject's package-dir)
SOURCES = {"lioncub": "lioncub", "lioncub.kernels": "kernels", "lioncub.simulator": "simulator"}


def _packages_on_disk() -> set[str]:
    found = set()
    for name, src in SOURCES.items():
        base = ROOT / src
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if "__pycache__" not in rel and "tests" not in rel:
                found.add(".".join((name, *rel)))
    return found


def test_every_package_directory_is_listed_for_setuptools():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    missing = _packages_on_disk() - listed
    assert not missing, f"packages that `pip install` would leave out (add them to pyproject.toml): {sorted(missing)}"
    assert not listed - _packages_on_disk(), sorted(listed - _packages_on_disk())


def test_the_base_dependencies_are_torch_numpy_and_simpy():
    names = {d.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip() for d in
             PYPROJECT["project"]["dependencies"]}
    assert names == {"torch", "numpy", "simpy"}


def _closure(names: list[str]) -> set:
    """The installed distributions `names` need, transitively (extras and other platforms' markers left out)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen, todo = {}, list(names)
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-less requirement this platform does not have installed
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return set(seen.values())


def clean_site(tmp_path, names=("torch", "numpy")) -> Path:
    """A folder holding only `names` and what they need, linked from this environment's site-packages: what a
    clean venv gets from `pip install lioncub` (lioncub itself comes from the source tree)."""
    site = tmp_path / "site"
    site.mkdir()
    for dist in _closure(list(names)):
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            src = Path(dist.locate_file(top))
            dst = site / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
    return site


def install_lioncub(tmp_path, site: Path) -> None:
    """`pip install lioncub` into `site` as a wheel is built: from a copy of what the wheel is made of, so the
    build leaves nothing in the tree and what pyproject leaves out is missing."""
    src = tmp_path / "src"
    for part in ("lioncub", "kernels", "simulator"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def run_clean(tmp_path, code: str) -> subprocess.CompletedProcess:
    """`code` in a Python without site-packages (-S), seeing only torch, numpy, what they need, and lioncub as
    pip installs it."""
    site = clean_site(tmp_path)
    install_lioncub(tmp_path, site)
    prelude = f"import sys; sys.path[:0] = [{str(site)!r}]\n"
    return subprocess.run([sys.executable, "-S", "-c", prelude + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


def test_the_optimizer_trains_with_only_torch_and_numpy(tmp_path):
    out = run_clean(tmp_path, """
        import torch, lioncub
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = lioncub.LionCub(model.parameters(), lr=1e-3, method="vote-1bit")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
        for extra in ("tqdm", "matplotlib", "triton", "simpy", "transformers"):
            try:
                __import__(extra)
                raise SystemExit(f"{extra} is importable: the test's site is not clean")
            except ImportError:
                pass
        from lioncub.optional import progress_bar
        bar = progress_bar(total=3)  # no tqdm: a bar that draws nothing
        bar.update(1); bar.close()
        print("steps", opt.stats.steps)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["steps", "3"]


def test_the_readme_loop_runs_with_only_torch_and_numpy(tmp_path):
    from test_docs import blocks

    loop = next(b for b in blocks(ROOT / "README.md") if b.lang == "python")
    out = run_clean(tmp_path, loop.body + "\nprint('trained', opt.stats.steps)\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["trained", "20"]


def test_a_plot_without_matplotlib_is_one_line(tmp_path):
    out = run_clean(tmp_path, """
        from lioncub.optional import pyplot
        try:
            pyplot()
        except ValueError as exc:
            print(exc)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "plots need matplotlib: pip install 'lioncub[tools]' (or matplotlib)"
