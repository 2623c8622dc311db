"""research/adamw_to_lion.py (coming from AdamW, issue 51): the sweep at tiny sizes, its guidance, and the
conversion autotune proposes (lioncub.apps.tuned_lr.ADAMW_TO_LION) against the committed result."""

import io
import json
import math

import pytest
import torch

from lioncub.apps.train.loop import TrainConfig, _lr
from lioncub.apps.tuned_lr import ADAMW_TO_LION, lion_from_adamw
from research import RESULTS
from research import adamw_to_lion as a2l

RESULT_DIR = RESULTS / "adamw-to-lion"


def test_the_schedule_is_lioncub_trains():
    cfg = TrainConfig(lr=1e-3, steps=50, warmup=5)
    assert all(a2l._schedule(1e-3, s, 50, 5) == pytest.approx(_lr(cfg, s)) for s in range(1, 51))


def test_a_tiny_sweep(monkeypatch):
    torch.set_num_threads(1)
    parts = []
    log = io.StringIO()
    res = a2l.sweep("char-tiny", steps=3, seeds=2, batch=2, warmup=1, log=log, adamw_lrs=(1e-3, 3e-3),
                    lr_divisors=(1, 3), wd_factors=(1, 10), eval_batches=1, checkpoint=parts.append)
    assert res["complete"] and not parts[-1]["complete"] and len(parts) == len(res["adamw"]) + 4
    # AdamW: a two-point grid has its best on an edge, so it is widened by 3x (at most MAX_WIDEN times)
    lrs = [r["lr"] for r in res["adamw"]]
    assert lrs == sorted(lrs) and 2 < len(lrs) <= 2 + a2l.MAX_WIDEN and res["adamw_widened"] == len(lrs) - 2
    best = min(res["adamw"], key=lambda r: r["eval_loss"])
    assert res["adamw_lr"] == best["lr"] and res["adamw_eval_loss"] == best["eval_loss"]
    assert res["adamw_widened"] == a2l.MAX_WIDEN or best["lr"] not in (lrs[0], lrs[-1])
    # Lion: every cell, each seed's run, and the paired difference to AdamW's run of the same seed
    assert [(r["lr_divisor"], r["wd_factor"]) for r in res["lion"]] == [(1, 1), (1, 10), (3, 1), (3, 10)]
    adamw = {r["seed"]: r["eval_loss"] for r in res["runs"] if r["optimizer"] == "adamw" and r["lr"] == res["adamw_lr"]}
    for cell in res["lion"]:
        assert cell["lr"] == pytest.approx(res["adamw_lr"] / cell["lr_divisor"])
        assert cell["weight_decay"] == pytest.approx(0.1 * cell["wd_factor"])
        runs = [r for r in res["runs"] if r["optimizer"] == "lion" and r["lr"] == cell["lr"]
                and r["weight_decay"] == cell["weight_decay"]]
        assert sorted(r["seed"] for r in runs) == [0, 1]
        diffs = [r["eval_loss"] - adamw[r["seed"]] for r in runs]
        assert cell["paired_vs_adamw"] == pytest.approx(sum(diffs) / 2)
        assert all(math.isfinite(r["eval_loss"]) for r in runs)
    g = res["guidance"]
    assert g["eval_loss"] == min(c["eval_loss"] for c in res["lion"]) and g["lr_at_edge"] and g["wd_at_edge"]
    assert {"lr_divisor": g["lr_divisor"], "wd_factor": g["wd_factor"]} in g["within_noise"]
    assert "lion  lr" in log.getvalue()
    # the same seed is the same run: a repeated cell reproduces its losses
    again = a2l.run("char-tiny", "adamw", res["adamw_lr"], 0.1, 0, 3, 2, 1, eval_batches=1)
    assert again["eval_loss"] == adamw[0]


def test_guidance_picks_the_best_cell_and_the_ones_within_noise():
    cell = lambda d, w, m, s: dict(lr_divisor=d, wd_factor=w, eval_loss=m, eval_sd=s, paired_vs_adamw=0.0,
                                   paired_sd=0.0, finite=True)
    table = [cell(1, 1, 2.5, 0.1), cell(3, 3, 2.0, 0.02), cell(10, 3, 2.05, 0.06), cell(30, 10, 1.0, 0.0)]
    table[-1]["finite"] = False  # a diverged cell never wins
    g = a2l.guidance(table, (1, 3, 10, 30), (1, 3, 10))
    assert (g["lr_divisor"], g["wd_factor"], g["lr_at_edge"], g["wd_at_edge"]) == (3, 3, False, False)
    assert g["within_noise"] == [{"lr_divisor": 3, "wd_factor": 3}, {"lr_divisor": 10, "wd_factor": 3}]


def test_bad_input():
    with pytest.raises(ValueError, match="built-in transformer"):
        a2l.run("mlp", "adamw", 1e-3, 0.1, 0, 1, 1, 0)
    with pytest.raises(ValueError, match="adamw or lion"):
        a2l.run("char-tiny", "sgd", 1e-3, 0.1, 0, 1, 1, 0)
    with pytest.raises(SystemExit):
        a2l.main(["--steps", "10", "--warmup", "10", "--output", "x.json"])


def test_autotunes_conversion_is_the_committed_measurement():
    """ADAMW_TO_LION (what `lioncub autotune --adamw-lr` proposes) is the best cell of the committed sweep, and says
    what that sweep measured."""
    res = json.loads((RESULTS.parent.parent.parent / ADAMW_TO_LION["result"]).read_text())
    assert res["complete"] and res["model"] in ADAMW_TO_LION["measured"]
    g = res["guidance"]
    assert (g["lr_divisor"], g["wd_factor"]) == (ADAMW_TO_LION["lr_divisor"], ADAMW_TO_LION["wd_factor"])
    assert f"{res['steps']} steps" in ADAMW_TO_LION["measured"] and f"{res['seeds']} seeds" in ADAMW_TO_LION["measured"]
    assert f"batch {res['batch']} " in ADAMW_TO_LION["measured"]
    assert len(res["runs"]) == res["seeds"] * (len(res["adamw"]) + len(res["lion"]))
    lr, wd = lion_from_adamw(res["adamw_lr"], res["adamw_wd"])
    best = next(c for c in res["lion"] if (c["lr_divisor"], c["wd_factor"]) == (g["lr_divisor"], g["wd_factor"]))
    assert (lr, wd) == (pytest.approx(best["lr"]), pytest.approx(best["weight_decay"]))
    assert sorted(p.name for p in RESULT_DIR.glob("*.json"))  # the result files live there


def test_the_docs_table_is_the_committed_measurement():
    """docs/methods.md's "Coming from AdamW" tables quote the committed sweep, cell by cell."""
    res = json.loads((RESULTS.parent.parent.parent / ADAMW_TO_LION["result"]).read_text())
    page = (RESULTS.parent.parent.parent / "docs" / "methods.md").read_text()
    section = page[page.index("## Coming from AdamW"):]
    section = section[:section.index("\n## ", 1)]
    for cell in res["adamw"] + res["lion"]:
        assert f"{cell['eval_loss']:.3f} +- {cell['eval_sd']:.3f}" in section, cell
    for cell in (c for c in res["lion"] if c["wd_factor"] == ADAMW_TO_LION["wd_factor"]):
        assert f"{cell['paired_vs_adamw']:+.2f} +- {cell['paired_sd']:.2f}" in section, cell
    g = res["guidance"]
    assert f"lr / {g['lr_divisor']}, weight\ndecay x {g['wd_factor']}" in section
    assert f"{res['steps']} steps, batch {res['batch']} x 64 tokens, {res['seeds']} seeds" in section


def test_the_longer_runs_agree_with_the_conversion():
    """At 1000 steps, AdamW's best lr divided by ADAMW_TO_LION's divisor is still Lion's best, and its weight decay
    factor lies inside the range of factors within noise of the best (30x is outside it)."""
    lr = json.loads((RESULT_DIR / "char-tiny-1000steps-lr.json").read_text())
    wd = json.loads((RESULT_DIR / "char-tiny-1000steps-wd.json").read_text())
    assert lr["complete"] and wd["complete"] and lr["steps"] == wd["steps"] == 1000
    assert lr["guidance"]["lr_divisor"] == ADAMW_TO_LION["lr_divisor"] and lr["adamw_lr"] == wd["adamw_lr"]
    near = [c["wd_factor"] for c in wd["guidance"]["within_noise"]]
    assert min(near) <= ADAMW_TO_LION["wd_factor"] <= max(near) < max(c["wd_factor"] for c in wd["lion"])
