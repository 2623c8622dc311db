"""The notebooks (notebooks/*.ipynb) execute headless and draw their plots; the committed files carry no outputs.

Each notebook runs in a fresh ipykernel of this interpreter (nbclient) with LIONCUB_NB_QUICK=1, the switch
every notebook reads in its parameters cell to shrink its grids and trainings. A cell that raises fails the
test, and every notebook must produce at least one PNG image.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_bandwidth_tradeoffs", "02_autotune_then_train", "03_kernels"}
CELL_TIMEOUT = 300  # seconds per cell; the slowest quick cell (notebook 2's trainings) takes ~20 s here
KERNEL = "lioncub-notebook-test"


def _ids(path: Path) -> str:
    return path.stem


def test_every_notebook_is_here():
    assert EXPECTED <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_committed_without_outputs(path):
    """notebooks/README.md: notebooks are stored without outputs (clear them before committing)."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them (README.md)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_parameters_cell_reads_the_quick_switch(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "LIONCUB_NB_QUICK" in first.source, f"{path.name}: the first code cell must be the parameters cell"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec for this interpreter (not whatever 'python3' resolves to on the machine), isolated
    IPython and Jupyter runtime directories, the inline matplotlib backend, and the quick switch."""
    kernelspec.write_kernel_spec(tmp_path / "jupyter" / "kernels" / KERNEL,
                                 overrides={"display_name": KERNEL})
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # an Agg backend from the environment would hide the plots
    monkeypatch.setenv("LIONCUB_NB_QUICK", "1")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_executes_and_plots(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError on the first cell that fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, json.dumps(errors, indent=1)[:2000]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
    for o in images:
        assert len(o["data"]["image/png"]) > 1000, "a plot image is suspiciously small"
