"""The notebooks (notebooks/*.ipynb) execute headless and draw their plots; the committed files carry no outputs.

Each notebook runs in a fresh ipykernel of this interpreter (nbclient) with LIONCUB_NB_QUICK=1, the switch
every notebook reads in its parameters cell to shrink its grids and trainings. A cell that raises fails the
test, and every notebook must produce at least one PNG image.

Intervals (issue 27): every speedup a notebook prints carries its interval ("8.13x (7.20-8.90x)") and every
speedup or step curve it draws its shaded band, or the output says "no interval" where the profile has none.
The run keeps every figure it shows (a hook cell in front of the notebook) and reads them back after the last
cell; the printed intervals are checked against simulate_step and autotune for the same inputs, recomputed
here.

Local steps (issue 29): notebook 1's bytes-per-token section, run on its own, is checked against
local_evidence.MEASURED, the convergence map and simulate_step, recomputed here.
"""

from __future__ import annotations

import json
import math
import re
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
FORECASTS = {"01_bandwidth_tradeoffs", "02_autotune_then_train"}  # the notebooks that forecast steps


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


# Run in front of the notebook: keep every figure plt.show() displays (the inline backend closes them after).
KEEP_FIGURES = """
import matplotlib.pyplot as _plt
from matplotlib._pylab_helpers import Gcf as _Gcf

_kept_figures, _show = [], _plt.show


def _keep_and_show(*args, **kwargs):
    _kept_figures.extend(m.canvas.figure for m in _Gcf.get_all_fig_managers())
    return _show(*args, **kwargs)


_plt.show = _keep_and_show
"""

# Run after the notebook: what the kept figures drew, and the notebook's inputs, as one JSON line.
REPORT = """
import json as _json
from matplotlib.collections import PolyCollection as _Poly
from matplotlib.colors import to_hex as _hex


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def _legends(owner):
    lg = [owner.get_legend()] if hasattr(owner, "get_legend") else list(owner.legends)
    return [t.get_text() for g in lg if g is not None for t in g.get_texts()]


def _figure(fig):
    axes = [dict(xlabel=ax.get_xlabel(), ylabel=ax.get_ylabel(), title=ax.get_title(), legend=_legends(ax),
                 texts=[t.get_text() for t in ax.texts],
                 lines=[dict(label=ln.get_label(), color=_hex(ln.get_color()), marker=str(ln.get_marker()),
                             x=[_num(v) for v in ln.get_xdata()], y=[_num(v) for v in ln.get_ydata()])
                        for ln in ax.lines],
                 bands=[dict(color=_hex(c.get_facecolor()[0]), xy=c.get_paths()[0].vertices.tolist())
                        for c in ax.collections if isinstance(c, _Poly) and len(c.get_paths())])
            for ax in fig.axes]
    return dict(axes=axes, legend=_legends(fig))


_g = globals()
_p = _g.get("PROFILE")
print("@@REPORT@@" + _json.dumps(dict(
    figures=[_figure(f) for f in _kept_figures], profile=_p.to_dict() if _p is not None else None,
    inputs={k: _g[k] for k in ("FOCUS_RANKS", "FOCUS_GPUS_PER_NODE", "LATENCY", "BANDWIDTHS_GBIT", "FOCUS_MODEL",
                              "COMPUTE", "STEPS", "MAX_RISK", "RANKS", "RATE") if k in _g},
    params=_g["spec"].params if "spec" in _g and hasattr(_g["spec"], "params") else None), default=str))
"""

SPEEDUP = re.compile(r"(?<![\w.-])(\d+\.\d+)x\b")  # a forecast speedup as the notebooks print it: 8.13x
WITH_INTERVAL = re.compile(r"(?: \(|\n)(\d+\.\d+)-(\d+\.\d+)x\)?")  # what follows it: ' (7.20-8.90x)', '\n7.2-8.9x'
NO_INTERVAL = "no interval"


def _execute(nb, kernel_env) -> tuple[list, dict]:
    """Execute `nb` with the figure-keeping cells around it; (its cells' outputs, the report), the cells removed."""
    cells = list(nb.cells)
    nb.cells = [nbformat.v4.new_code_cell(KEEP_FIGURES)] + cells + [nbformat.v4.new_code_cell(REPORT)]
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError on the first cell that fails
    report = next(json.loads(o["text"].split("@@REPORT@@", 1)[1]) for o in nb.cells[-1].outputs
                  if o.get("output_type") == "stream" and "@@REPORT@@" in o["text"])
    nb.cells = nb.cells[1:-1]
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])], report


def _texts(outputs) -> list[str]:
    """Every printed line and every markdown output ("Reading: ...") of the notebook."""
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            out += o["text"].splitlines()
        else:
            out += [o["data"][k] for k in ("text/markdown", "text/plain") if k in o.get("data", {})]
    return out


def _bare_speedups(text: str) -> list[str]:
    """The speedups in `text` printed without their interval (the baseline's own 1.00x needs none)."""
    bare = []
    for m in SPEEDUP.finditer(text):
        rest = text[m.end():]
        if rest.startswith(" (the baseline"):
            continue
        w = WITH_INTERVAL.match(rest)
        if w is None:
            bare.append(m[0])
        else:
            assert float(w[1]) <= float(m[1]) <= float(w[2]), f"{m[0]} outside its own interval in: {text[:300]}"
    return bare


def check_intervals(outputs, report, name: str) -> int:
    """Every speedup printed or drawn carries its interval, or its output says there is none; with a profile
    that has one, none is missing. Returns the number of speedup and step curves checked."""
    has = bool((report["profile"] or {}).get("forecast_error"))
    for text in _texts(outputs):
        bare = _bare_speedups(text)
        if has:
            assert not bare and NO_INTERVAL not in text, f"{name}: speedups {bare} without their interval: {text[:400]}"
        else:
            assert not bare or NO_INTERVAL in text, f"{name}: speedups {bare} without an interval or a word why: " \
                                                    f"{text[:400]}"
    curves = 0
    for i, fig in enumerate(report["figures"]):
        legend = fig["legend"] + [t for ax in fig["axes"] for t in ax["legend"]]
        says_none = any(NO_INTERVAL in t for t in legend)
        assert not (has and says_none), f"{name}, figure {i}: says 'no interval' though the profile has one"
        shared = next((ax["ylabel"] for ax in fig["axes"] if ax["ylabel"]), "")  # sharey: the first one's label
        for ax in fig["axes"]:
            for t in ax["texts"]:
                assert not _bare_speedups(t) or says_none, f"{name}, figure {i}: label {t!r} without its interval"
            ylabel = (ax["ylabel"] or shared).lower()
            if "speedup" not in ylabel and "step time" not in ylabel:
                continue
            for ln in ax["lines"]:
                if ln["marker"] != "o" or len(ln["x"]) < 2 or ln["label"].startswith("_"):
                    continue  # not a curve of forecasts: a reference line, a legend handle
                if "speedup" in ylabel and all(y == 1.0 for y in ln["y"]):
                    continue  # the baseline's own configuration: its speedup over itself is 1, with no interval
                curves += 1
                band = _band_of(ax, ln)
                assert band or (not has and says_none), \
                    f"{name}, figure {i} ({ax['title']}): curve {ln['label']!r} has no band" + \
                    ("" if has else " and the legend does not say 'no interval'")
    return curves


def _band_of(ax: dict, line: dict) -> list | None:
    """The shaded band of `line` (a fill_between of its colour covering every point): [(x, low, high)]."""
    for b in ax["bands"]:
        if b["color"] != line["color"]:
            continue
        spans = []
        for x, y in zip(line["x"], line["y"]):
            ys = [v for u, v in b["xy"] if math.isclose(u, x, rel_tol=1e-9)]
            if not ys or not (min(ys) <= y <= max(ys)) or min(ys) == max(ys):
                break
            spans.append((x, min(ys), max(ys)))
        else:
            return spans
    return None


def ratio_band(x: float, error) -> tuple[float, float]:
    """A speedup's interval written out here from docs/simulator.md, not imported: each of the two forecasts
    within x (1 + low) .. x (1 + high), their log-widths added in quadrature around the ratio."""
    half = math.sqrt(2) * (math.log(1 + error[1]) - math.log(1 + error[0])) / 2
    return x * math.exp(-half), x * math.exp(half)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_executes_and_plots(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    outputs, report = _execute(nb, kernel_env)
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, json.dumps(errors, indent=1)[:2000]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no plot"
    for o in images:
        assert len(o["data"]["image/png"]) > 1000, "a plot image is suspiciously small"
    if path.stem not in FORECASTS:
        return
    curves = check_intervals(outputs, report, path.name)
    if path.stem == "01_bandwidth_tradeoffs":
        assert curves >= 20, f"{path.name}: only {curves} speedup and step curves found; did the plots change?"
    else:
        check_autotune_intervals(outputs, report)


def check_autotune_intervals(outputs, report):
    """Notebook 2's recommendation: its speedup and interval as autotune gives them for the notebook's inputs
    (the host-calibrated profile it printed, the compute it measured), recomputed here."""
    from lioncub.simulator import BackendProfile, Cluster

    from lioncub.apps import autotune

    err = report["profile"]["forecast_error"]
    assert err, "notebook 2's host calibration left no forecast_error"
    inp = report["inputs"]
    profile = BackendProfile.from_dict(report["profile"])
    target = Cluster.for_ranks(inp["RANKS"], 1, bandwidth=float(inp["RATE"]), latency=0.0)
    result = autotune.search(target, report["params"], inp["COMPUTE"], backend=profile, steps=inp["STEPS"],
                             max_risk=autotune.parse_max_risk(inp["MAX_RISK"]))
    best, _ = autotune.recommend(result)
    line = next(t for t in _texts(outputs) if t.startswith("recommended:"))
    m = re.search(r", (\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)x\) the default allreduce step", line)
    assert m, line
    lo, hi = ratio_band(best.speedup, err)
    assert list(m.groups()) == [f"{v:.2f}" for v in (best.speedup, lo, hi)], (line, best)
    assert any(f"forecast interval {err[0]:+.2%} .. {err[1]:+.2%}" in t for t in _texts(outputs))


# Notebook 1's backend with an error band, for the run with intervals: the built-in nccl profile has none, and
# the test machine's host calibration would be a CPU's. The figures are made up; only the arithmetic is checked.
TEST_BAND = [-0.1, 0.12]
BANDED_BACKEND = ('BACKEND = __import__("lioncub.simulator", fromlist=["BackendProfile"]).BackendProfile.from_dict('
                  f'{{"name": "nccl+test-band", "forecast_error": {TEST_BAND}}}, base="nccl")')


@pytest.mark.slow
def test_bandwidth_notebook_draws_its_intervals(kernel_env):
    """Notebook 1 with a profile that has a forecast_error: every speedup curve has its band, every printed
    speedup its interval, and the focus model's headline speedup and band are simulate_step's for its inputs."""
    from lioncub.simulator import BackendProfile, Cluster, simulate_step

    from lioncub.apps.autotune import model_spec
    from lioncub.comm.wire import auto_bucket_mb

    path = NOTEBOOK_DIR / "01_bandwidth_tradeoffs.ipynb"
    nb = nbformat.read(path, as_version=4)
    params = next(c for c in nb.cells if c.cell_type == "code")
    assert 'BACKEND = "nccl"' in params.source, "the parameters cell no longer sets BACKEND = \"nccl\""
    params.source = params.source.replace('BACKEND = "nccl"', BANDED_BACKEND)
    outputs, report = _execute(nb, kernel_env)
    assert report["profile"]["forecast_error"] == TEST_BAND
    assert check_intervals(outputs, report, path.name) >= 20

    inp = report["inputs"]
    model, ranks, bw = inp["FOCUS_MODEL"], inp["FOCUS_RANKS"], inp["BANDWIDTHS_GBIT"][0]
    reading = next(t for t in _texts(outputs) if "compression pays" in t)
    m = re.search(re.escape(model) + r": compression pays [^;]*?\((\S+) (\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)x\) at",
                  reading)
    assert m, reading
    method = m[1]
    spec = model_spec(model)
    profile = BackendProfile.from_dict({"forecast_error": TEST_BAND}, base="nccl")
    cluster = Cluster.for_ranks(ranks, min(inp["FOCUS_GPUS_PER_NODE"], ranks), bandwidth=bw * 1e9,
                                latency=inp["LATENCY"])
    r = simulate_step(cluster, method, spec.params, bucket_mb=auto_bucket_mb(4 * spec.params),
                      compute_seconds=spec.compute_seconds, backend=profile)
    lo, hi = ratio_band(r.speedup, TEST_BAND)
    assert r.speedup_interval == pytest.approx((lo, hi), rel=1e-9)
    assert list(m.groups()[1:]) == [f"{v:.2f}" for v in (r.speedup, lo, hi)], (reading, r)
    # and the band drawn around that curve, at that bandwidth, is the same interval
    fig = report["figures"][0]
    ax = next(a for a in fig["axes"] if a["title"].startswith(model))
    line = next(ln for ln in ax["lines"] if ln["label"] == method)
    band = _band_of(ax, line)
    assert band and band[0][0] == bw and band[0][1:] == pytest.approx((lo, hi), rel=1e-9), band


def _section(nb, heading: str) -> list:
    """The parameters and helpers cells (the first two code cells), then the section whose markdown starts
    with `heading` and the code cell after it: that section run on its own."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    i = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith(heading))
    assert nb.cells[i + 1].cell_type == "code", f"no code cell after {heading!r}"
    return code[:2] + nb.cells[i:i + 2]


# Issue 29's regime and targets, written out here: char-tiny (its runs' "params"), 4 ranks, batch 16 x 64 per rank
TINY_PARAMS, TINY_TOKENS, TINY_LR = 431_360, 16 * 64, 5e-4
CLOSER = REPO / "research" / "notebook" / "results" / "local-steps" / "closer"


def _tiny_bytes_per_token(method: str, hierarchical: bool = False, **kw) -> float:
    """Bytes per token each rank sends in that regime (node layout: leaving the node, per rank), from
    simulate_step directly."""
    from lioncub.simulator import Cluster, simulate_step

    from lioncub.comm.wire import auto_bucket_mb

    cluster = Cluster(nodes=2, gpus_per_node=2, bandwidth=1e9) if hierarchical else Cluster(nodes=4, bandwidth=1e9)
    bucket = 0.25 if kw.get("fragments") else auto_bucket_mb(4 * TINY_PARAMS)  # the streamed runs' --bucket-mb
    r = simulate_step(cluster, method, TINY_PARAMS, bucket_mb=bucket, compute_seconds=0.1, backend="gloo",
                      hierarchical=hierarchical, **kw)
    return (r.nic_bytes_per_node / 2 if hierarchical else r.bytes_sent_per_rank) / TINY_TOKENS


@pytest.mark.slow
def test_bandwidth_notebook_draws_bytes_per_token_against_loss(kernel_env):
    """Notebook 1's local-step section (issue 29), run on its own: its table and its figure hold every
    configuration of local_evidence.MEASURED and the convergence map's every-step methods at that regime, at the
    bytes per token simulate_step gives and the loss measured, recomputed here; the targets are drawn; the
    reading says whether any point reaches both; the simulated bytes are within 2% of the runs' own."""
    from lioncub.apps.autotune.local_evidence import MEASURED, REGIME

    assert "4 ranks, batch 16 x 64" in REGIME and "lr 5e-4" in REGIME, REGIME
    nb = nbformat.read(NOTEBOOK_DIR / "01_bandwidth_tradeoffs.ipynb", as_version=4)
    nb.cells = _section(nb, "## Bytes per token against loss")
    outputs, report = _execute(nb, kernel_env)
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, json.dumps(errors, indent=1)[:2000]
    printed = "".join(o["text"] for o in outputs if o.get("output_type") == "stream").splitlines()
    rows = {f[0]: f for f in (tuple(v.strip() for v in ln.split(" | ")) for ln in printed) if len(f) == 8}
    rows.pop("configuration")  # the header
    axes = [a for f in report["figures"] for a in f["axes"] if a["xlabel"].startswith("bytes per token")]
    assert len(axes) == 1, "the bytes-per-token figure is missing"
    ax = axes[0]
    assert "loss" in ax["ylabel"] and "%" in ax["ylabel"]
    points = [(ln["x"][0], ln["y"][0]) for ln in ax["lines"] if len(ln["x"]) == 1 and ln["marker"] in ("s", "D", "o")]

    expected = {}  # configuration: (bytes per token, loss %, SE % or None, seeds)
    for (method, layout, H, F, D), (excess, se, seeds) in MEASURED.items():
        hier = layout == "hierarchical"
        name = f"{method}, H={H}" + (", nodes of 2" if hier else "") + (f", F={F}" + (f", D={D}" if D != 1 else "")
                                                                       if F else "")
        x = _tiny_bytes_per_token(method, hier, local_steps=H, fragments=F, outer_delay=D)
        expected[name] = (x, 100 * excess, 100 * se if se is not None and seeds > 1 else None, seeds)
    cmap = json.loads((REPO / "research" / "notebook" / "results" / "convergence-map.json").read_text())
    here = [c for c in cmap["cells"] if (c["ranks"], c["batch_size"]) == (4, 16) and math.isclose(c["lr"], TINY_LR)]
    assert {c["config"] for c in here} >= {"allreduce", "vote-1bit"}
    for c in here:
        method, _, sync = c["config"].partition("@")
        K = int(sync.split(":")[1]) if sync.startswith("every:") else None
        se = 100 * c["se"] if c["config"] != "allreduce" else None
        expected[c["config"]] = (_tiny_bytes_per_token(method, momentum_sync=K), 100 * (c["ratio"] - 1), se,
                                 len(c["seeds"]))
    assert set(rows) == set(expected), (sorted(rows), sorted(expected))
    for name, (x, loss, se, seeds) in expected.items():
        row = rows[name]
        assert float(row[3]) == pytest.approx(x, abs=5e-4), (name, row, x)
        assert (row[5], row[6], int(row[7])) == (f"{loss:+.2f}", "-" if se is None else f"{se:.2f}", seeds), row
        assert any(px == pytest.approx(x, rel=1e-9) and py == pytest.approx(loss, abs=1e-9) for px, py in points), \
            f"{name}: no point drawn at ({x}, {loss})"
    assert len(points) == len(expected)
    labels = [t for t in ax["texts"] if "H=" in t]
    assert len(labels) == len(MEASURED) and sum("nodes of 2" in t for t in labels) == \
        sum(k[1] == "hierarchical" for k in MEASURED), ax["texts"]
    assert expected["allreduce"][:2] == (pytest.approx(1.5 * 4 * TINY_PARAMS / TINY_TOKENS), 0.0)  # ring, fp32

    # the targets: 1/500 of ddp+lion's bytes (torch DDP's fp32 ring allreduce) and 2% in loss
    x_target = 1.5 * 4 * TINY_PARAMS / 500 / TINY_TOKENS
    assert any(ln["x"] == [pytest.approx(x_target)] * 2 and ln["label"].startswith("target") for ln in ax["lines"])
    assert any(ln["y"] == [2.0, 2.0] and ln["label"].startswith("target") for ln in ax["lines"])
    both = sorted(n for n, (x, loss, _, _) in expected.items() if x <= x_target and loss <= 2.0)
    reading = next(t for t in _texts(outputs) if "1/500 of ddp+lion's bytes" in t)
    if both:
        assert "Both targets: " + ", ".join(both) in reading, reading
    else:
        assert "No measured configuration reaches both targets yet" in reading, reading

    # the simulated bytes against the runs' own (rank 0's, beyond its node), as the markdown says
    checked = 0
    for path in sorted(CLOSER.glob("*_s0.json")):
        run = json.loads(path.read_text())
        hier = "hierarchical" in path.name
        sim = _tiny_bytes_per_token(run["method"], hier, local_steps=run["local_steps"]) * TINY_TOKENS
        measured = run["bytes_per_step"] - run["node_bytes_per_step"]
        assert measured == pytest.approx(sim * (2 if hier else 1), rel=0.02), path.name  # the voter sends 2 ranks'
        checked += 1
    assert checked >= 4
    assert any(ln.startswith("  vote-1bit, H=25 ") and "measured" in ln for ln in printed), printed
