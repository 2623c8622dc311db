"""Training on the device (`pytest -m cuda`; tests/helpers/cuda_cases.py): char-medium, 200 steps, batch 32 x 128
on one GPU (char-tiny for 3 steps in the CPU rehearsal), deterministic algorithms, three concurrent runs: the
Triton kernels, the torch twins, Triton again (a control: is the model itself deterministic here?).

The runs finish on the intended backends, the loss goes down, and the Triton and twin runs give the same loss
curve: bit-identical, or within 2% (the mean of the last 20 losses and the eval loss) where a sign flips at
rounding level and the two runs follow different, equally good trajectories from there. Bit-identical is
asserted in the rehearsal (the interpreter reproduces the twins exactly) and reported on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cuda_cases import CFG, DEVICE, SIZE, TRAIN_TOLERANCE, TRITON_OPS, TWINS, curve_diff, report
from repo import REPO

pytestmark = pytest.mark.cuda
RUNS = {"triton": "triton", "torch": "torch", "triton-control": "triton"}


def test_triton_and_the_twins_train_the_same_loss_curve(tmp_path):
    cfg = CFG["train"]
    procs = {}
    for label, backend in RUNS.items():
        path = tmp_path / f"{label}.json"
        code = f"from cuda_cases import train_run; train_run({str(path)!r}, {DEVICE.type!r}, {cfg!r})"
        env = dict(os.environ, LIONCUB_KERNELS=backend, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # deterministic cuBLAS
        procs[label] = (path, subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    res = {}
    for label, (path, proc) in procs.items():
        out, _ = proc.communicate(timeout=1200)
        assert proc.returncode == 0 and path.exists(), f"run {label} failed:\n{out[-3000:]}"
        res[label] = json.loads(path.read_text())
    a, b, control = res["triton"], res["torch"], res["triton-control"]
    assert a["ran"] == TRITON_OPS and control["ran"] == TRITON_OPS and b["ran"] == TWINS
    losses = a["losses"]
    assert losses and all(x == x and abs(x) < float("inf") for x in losses)
    if SIZE == "full":
        k = max(1, len(losses) // 10)
        assert sum(losses[-k:]) < sum(losses[:k]), "the loss did not go down"
    d = curve_diff(a["losses"], b["losses"])
    d["eval_rel_diff"] = abs(a["final_loss"] - b["final_loss"]) / max(abs(b["final_loss"]), 1e-12)
    identical = d["identical"] and a["final_loss"] == b["final_loss"]
    report(f"Triton vs torch twins bit-identical ({cfg['steps']}-step training)", target=identical,
           control_identical=control["losses"] == a["losses"], params=a["params"], step_ms=[a["step_ms"], b["step_ms"]],
           eval_loss=[a["final_loss"], b["final_loss"]], **d)
    if DEVICE.type == "cpu":
        assert identical, d
    assert identical or (d["tail_mean_rel_diff"] <= TRAIN_TOLERANCE and d["eval_rel_diff"] <= TRAIN_TOLERANCE), (
        f"not the same loss curve from step {d['first_different_step']} (the control run "
        f"{'agrees' if control['losses'] == a['losses'] else 'differs: the model is not deterministic here'}): {d}")
