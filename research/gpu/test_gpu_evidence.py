"""research/gpu/gpu_evidence.sh, issue 30's GPU command, rehearsed on CPU, and the lr sweep's pick it relies on
(research.lr_sweep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo import REPO

from research import lr_sweep
from research.risk import preregister


def test_lr_sweep_picks_the_lowest_mean_only_when_complete(tmp_path, capsys):
    runs = [dict(config="allreduce", lr=lr, seed=s, final_loss=loss) for lr, s, loss in
            [(1e-4, 0, 2.0), (1e-4, 1, 2.2), (2e-4, 0, 1.9), (2e-4, 1, 2.1), (4e-4, 0, 1.7)]]
    res = lr_sweep.select(dict(model="m", steps=3, runs=runs), [0, 1])
    assert not res["complete"] and res["lr"] is None
    runs.append(dict(config="allreduce", lr=4e-4, seed=1, final_loss=2.5))
    res = lr_sweep.select(dict(model="m", steps=3, runs=runs), [0, 1])
    assert res["complete"] and res["lr"] == 2e-4 and res["at_edge"] is False
    runs.append(dict(config="allreduce", lr=5e-5, seed=0, final_loss=2.0))  # a tie on the mean goes lower...
    runs.append(dict(config="allreduce", lr=5e-5, seed=1, final_loss=2.0))
    res = lr_sweep.select(dict(model="m", steps=3, runs=runs), [0, 1])
    assert res["lr"] == 5e-5 and res["at_edge"] is True
    planned = lr_sweep.select(dict(model="m", steps=3, runs=runs), [0, 1], lrs=[5e-5, 1e-4, 2e-4, 4e-4, 8e-4])
    assert not planned["complete"] and planned["lr"] is None  # 8e-4 never ran (a deadline): no pick
    assert planned["table"][-1] == dict(lr=8e-4, seeds=[], losses=[], mean=None, worst=None)
    path = tmp_path / "map.json"
    path.write_text(json.dumps(dict(model="m", steps=3, runs=runs[:5])))
    assert lr_sweep.main([str(path), "--seeds", "0,1", "--output", str(tmp_path / "lr.json")]) == 3
    assert not (tmp_path / "lr.json").exists()
    path.write_text(json.dumps(dict(model="m", steps=3, runs=runs)))
    assert lr_sweep.main([str(path), "--seeds", "0,1", "--lrs", "5e-5,1e-4,2e-4,4e-4,8e-4"]) == 3
    assert lr_sweep.main([str(path), "--seeds", "0,1", "--lrs", "5e-5,1e-4,2e-4,4.0000001e-4"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_gpu_evidence_script_rehearses_sweep_map_and_report_on_cpu_and_resumes(tmp_path):
    """research/gpu/gpu_evidence.sh with DEVICE=cpu and tiny sizes: the sweep and its pick, the pre-registered set at
    the pick's lr, the report; a second call finds everything done and changes nothing."""
    plan = dict(protocol="rehearsal", allow_missing_levels=True, sets=[dict(
        name="gpu", model="char-tiny", steps=2, regimes=["N3-b4-x1"], configs=["vote-1bit", "l1-pbit@every:10"],
        seeds=[0, 1], min_seeds=2, setup=dict(data="python-src", block_size=16, amp="none", eval_batches=1),
        where="rehearsal")])
    prereg = tmp_path / "prereg.json"
    preregister.write(preregister.register(plan), str(prereg))
    env = dict(os.environ, DEVICE="cpu", SWEEP_MODELS="char-tiny", SWEEP_STEPS="2", SWEEP_FACTORS="1,2",
               SWEEP_SEEDS="0", SWEEP_EXTEND="1", PREREG=str(prereg), CORPUS_EXPECT="none", SKIP_INSTALL="1",
               PYTHON=sys.executable)
    out = tmp_path / "ev"
    script = REPO / "research" / "gpu" / "gpu_evidence.sh"
    p = subprocess.run(["bash", str(script), str(out), "3000"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=3600)  # (a deadline no busy machine reaches: the test is about what runs, not when)
    assert p.returncode == 0, p.stderr[-3000:]
    pick = json.loads((out / "sweep" / "char-tiny" / "lr.json").read_text())
    assert pick["complete"] and pick["seeds"] == [0]
    extended = out / "sweep" / "char-tiny" / "extend"
    if extended.exists():  # the pick at 2x was at the top edge: one doubling more, then the pick among three
        assert extended.read_text().split() == ["4.0"]
        assert json.loads((out / "sweep" / "char-tiny" / "lr-edge-0.json").read_text())["lr"] == 1e-3
        assert [r["lr"] for r in pick["table"]] == [5e-4, 1e-3, 2e-3] and pick["lr"] in (5e-4, 1e-3, 2e-3)
    else:
        assert [r["lr"] for r in pick["table"]] == [5e-4, 1e-3] and pick["lr"] in (5e-4, 1e-3)
    merged = json.loads((out / "map" / "char-tiny-map.json").read_text())
    assert merged["data"] == "python-src" and merged["block_size"] == 16 and merged["steps"] == 2
    assert {r["lr"] for r in merged["runs"]} == {pick["lr"]}  # the map runs at x1 of the sweep's pick
    rep = json.loads((out / "report.json").read_text())
    assert [(c["config"], c["seeds"], c["complete"]) for c in rep["cells"] if c["kind"] == "call"] == [
        ("vote-1bit", [0, 1], True), ("l1-pbit@every:10", [0, 1], True)]
    summary = (out / "summary.txt").read_text()
    assert "sweep char-tiny: pick: lr" in summary and "| all |" in summary
    before = {f: f.read_bytes() for f in out.rglob("*.json")}
    p = subprocess.run(["bash", str(script), str(out), "3000"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    parts = [f for f in before if f.name.startswith("char-tiny-N")]
    assert parts and all(f.read_bytes() == before[f] for f in parts)  # every run was there: none ran again
