"""The convergence map's bookkeeping (research.convergence_map): parts, merge, heat map."""

import json

import pytest
from repo import REPO

from research import convergence_map as cm


def test_parts_cover_the_grid_once():
    runs = cm.runs(lr=1e-3)
    assert len(runs) == len(cm.CONFIGS) * len(cm.WORLDS) * len(cm.BATCHES) * len(cm.LR_FACTORS) * len(cm.SEEDS)
    assert runs[0]["config"] == "allreduce"  # the baseline first: any finished part has its ratios
    parts = [cm.part_of(runs, f"{i}/5") for i in range(1, 6)]
    assert sum(parts, []) == runs
    with pytest.raises(ValueError):
        cm.part_of(runs, "0/3")


def test_merge_ratios_and_plot(tmp_path):
    rows = []
    for run in cm.runs(configs=("allreduce", "vote-1bit"), lr=1e-3):
        loss = 2.0 + 0.01 * run["seed"] + (0.1 if run["config"] == "vote-1bit" else 0.0)
        rows.append(dict(run, method=run["config"], momentum_sync="none", final_loss=loss, train_loss=loss,
                         bytes_per_step=100.0 if run["config"] == "allreduce" else 5.0, momentum_syncs=0,
                         agreement=None if run["config"] == "allreduce" else 0.4, final_agreement=None
                         if run["config"] == "allreduce" else 0.3, mean_step_seconds=0.1, wall_seconds=1.0))
    half = len(rows) // 2
    paths = []
    for i, chunk in enumerate((rows[:half], rows[half:])):
        p = tmp_path / f"part{i}.json"
        p.write_text(json.dumps(dict(model="char-tiny", steps=200, runs=chunk)))
        paths.append(str(p))
    res = cm.merge(paths)
    vote = [c for c in res["cells"] if c["config"] == "vote-1bit"]
    assert len(vote) == len(cm.regimes(1e-3))
    assert all(c["ratio"] == pytest.approx((2.1 / 2.0 + 2.11 / 2.01) / 2) for c in vote)
    assert all(c["se"] == pytest.approx(abs(2.1 / 2.0 - 2.11 / 2.01) / 2) == c["spread"] for c in vote)  # 2 seeds
    assert all(c["bytes_vs_baseline"] == pytest.approx(0.05) and c["agreement"] == pytest.approx(0.4) for c in vote)
    assert res["grid"] == dict(worlds=list(cm.WORLDS), batches=list(cm.BATCHES), lrs=[1e-3, 2e-3],
                               seeds=list(cm.SEEDS), configs=["allreduce", "vote-1bit"])  # what was run
    cm.plot(res, str(tmp_path / "map.png"))
    assert (tmp_path / "map.png").stat().st_size > 1000
    assert "vote-1bit" in cm.format_map(res)


def test_grid_cli_passes_its_base_lr_to_the_grid(monkeypatch):
    from research.cli import main

    seen = {}
    monkeypatch.setattr(cm, "run_grid", lambda *a, **kw: seen.update(kw) or {})
    assert main(["bench", "convergence-map", "--lr", "3e-4", "--lr-factors", "1,2"]) == 0
    assert seen.pop("device") == "cpu" and seen.pop("deadline") is None and seen.pop("setup") == {}
    assert seen["lr"] == 3e-4 and seen["lr_factors"] == (1.0, 2.0)
    assert [r["lr"] for r in cm.runs(configs=("allreduce",), seeds=(0,), worlds=(2,), batches=(8,), **seen)] == [
        3e-4, 6e-4]


def test_parts_of_another_model_steps_or_device_are_never_merged_or_resumed_into(tmp_path):
    base = dict(config="allreduce", seed=0, ranks=2, batch_size=8, lr=1e-3, method="allreduce", momentum_sync="none",
                final_loss=2.0, train_loss=2.0, bytes_per_step=1.0, momentum_syncs=0, agreement=None,
                final_agreement=None, mean_step_seconds=0.1, wall_seconds=1.0)
    old = tmp_path / "old.json"  # written before parts recorded their device: it ran on the CPU
    old.write_text(json.dumps(dict(model="char-tiny", steps=200, runs=[base])))
    same = tmp_path / "same.json"
    same.write_text(json.dumps(dict(model="char-tiny", steps=200, device="cpu", runs=[dict(base, seed=1)])))
    assert cm.merge([str(old), str(same)])["device"] == "cpu"
    for other in (dict(model="char-medium"), dict(steps=100), dict(device="cuda")):
        p = tmp_path / "other.json"
        p.write_text(json.dumps(dict(dict(model="char-tiny", steps=200, device="cpu"), **other, runs=[base])))
        with pytest.raises(ValueError, match="merge each apart"):
            cm.merge([str(old), str(p)])
        with pytest.raises(ValueError, match="give another --output"):  # before any run starts
            cm.run_grid(None, str(p), configs=("allreduce",), seeds=(0,), worlds=(2,), batches=(8,),
                        lr_factors=(1.0,))


def test_grid_cli_passes_the_device_and_the_curves_refuse_it(monkeypatch, capsys):
    from lioncub.cli import main as lioncub_main
    from research.cli import main

    seen = {}
    monkeypatch.setattr(cm, "run_grid", lambda *a, **kw: seen.update(kw) or {})
    assert main(["bench", "convergence-map", "--device", "cuda"]) == 0
    assert seen["device"] == "cuda"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # `lioncub bench convergence` is the curves: no grid options
        lioncub_main(["bench", "convergence", "--device", "cuda"])
    assert exc.value.code == 2 and "unrecognized arguments: --device cuda" in capsys.readouterr().err


def test_gpu_map_script_rehearses_a_regime_on_cpu_and_checks_the_rule(tmp_path):
    """research/gpu/gpu_map.sh with DEVICE=cpu: one grid per regime x seed stream, merged, and the committed rule
    checked on it (a regime the fit never saw is held out)."""
    import json
    import os
    import subprocess
    import sys

    root = REPO
    env = dict(os.environ, DEVICE="cpu", MODELS="char-tiny", STEPS="2", REGIMES="N3-b4-x1", SEED_STREAMS="0 1",
               CONFIGS="allreduce,vote-1bit", PYTHON=sys.executable, SKIP_INSTALL="1")
    out = tmp_path / "gm"
    p = subprocess.run(["bash", str(root / "research" / "gpu" / "gpu_map.sh"), str(out), "240"], env=env,
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(f.name for f in out.glob("char-tiny-N3-*.json")) == ["char-tiny-N3-b4-x1-s0.json",
                                                                      "char-tiny-N3-b4-x1-s1.json"]
    merged = json.loads((out / "char-tiny-map.json").read_text())
    cell = next(c for c in merged["cells"] if c["config"] == "vote-1bit")
    assert (cell["ranks"], cell["batch_size"], cell["seeds"]) == (3, 4, [0, 1])
    check = json.loads((out / "char-tiny-check.json").read_text())
    assert [(c["regime"], c["config"]) for c in check["cells"]] == [("N3-b4-x1", "vote-1bit")]
