"""The smallest change for a DDP script (issue 51 item 8): examples/ddp_adamw/train.py, a nanoGPT-shaped DDP + AdamW
script (gradient accumulation under no_sync(), clipping at 1.0, a loss scaler, a rank-0 torch.save inside the eval
block, torch.compile), and examples/ddp_adamw/to_lioncub.diff, its conversion, applied here with `patch` / `git
apply` to a temporary copy. Both run on 2 Gloo ranks; the converted one trains, its replicas are bit-identical, its
activation-checkpointed run equals the plain one bit for bit, torch.compile works, and the checkpoint its rank 0
wrote resumes a LionCub with torch.load's safe default."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import checkpoint_patterns as cp
import pytest
import torch
from repo import REPO

from lioncub.comm.spawn import spawn

SCRIPT = REPO / "examples" / "ddp_adamw" / "train.py"
DIFF = REPO / "examples" / "ddp_adamw" / "to_lioncub.diff"
MAX_CHANGED_LINES = 12
_FINAL = re.compile(r"rank (\d): final loss ([\d.]+), parameters ([0-9a-f]{16})")
_EVAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def changed_lines(diff: str) -> tuple[int, int]:
    lines = diff.splitlines()
    added = sum(1 for x in lines if x.startswith("+") and not x.startswith("+++"))
    removed = sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))
    return added, removed


def test_the_conversion_is_at_most_12_lines_and_none_for_checkpoints():
    diff = DIFF.read_text()
    added, removed = changed_lines(diff)
    assert added + removed <= MAX_CHANGED_LINES, (added, removed)
    body = [x for x in diff.splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    assert not any("save" in x or "load" in x or "ckpt" in x for x in body)  # checkpoints untouched
    assert any("lioncub.attach_ddp(model, optimizer)" in x for x in body)  # the DDP wrapper stays


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A copy of the repository's example with the diff applied (git apply, else patch)."""
    root = tmp_path_factory.mktemp("converted")
    (root / "examples" / "ddp_adamw").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "examples" / "ddp_adamw" / "train.py")
    if shutil.which("git"):
        cmd = ["git", "apply", "-p1", str(DIFF)]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    else:
        proc = subprocess.run(["patch", "-p1", "-i", str(DIFF)], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = root / "examples" / "ddp_adamw" / "train.py"
    assert "lioncub.LionCub(" in out.read_text() and "torch.optim.AdamW" not in out.read_text()
    return out


def run(script: Path, out_dir: Path, *flags: str) -> dict:
    """torchrun --nproc_per_node 2 script --max_iters 10 ... on Gloo: {"evals": [(step, train, val)], "final":
    {rank: (loss, digest)}}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), "--max_iters", "10",
           "--eval_interval", "5", "--learning_rate", "1e-2", "--out_dir", str(out_dir), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=script.parent, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    evals = [(int(s), float(t), float(v)) for s, t, v in _EVAL.findall(proc.stdout)]
    final = {int(r): (float(loss), digest) for r, loss, digest in _FINAL.findall(proc.stdout)}
    assert len(evals) == 3 and sorted(final) == [0, 1], proc.stdout
    return dict(evals=evals, final=final)


def test_the_original_ddp_adamw_script_trains(tmp_path):
    r = run(SCRIPT, tmp_path / "out", "--compile", "none")
    assert r["evals"][-1][2] < r["evals"][0][2] - 0.05  # val loss falls
    assert r["final"][0][1] == r["final"][1][1]  # DDP's replicas agree
    assert (tmp_path / "out" / "ckpt.pt").is_file()


@pytest.fixture(scope="module")
def plain(converted, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plain")
    return dict(run(converted, out, "--compile", "none"), out=out)


def test_the_converted_script_trains_keeps_replicas_identical_and_its_checkpoint_resumes(converted, plain, tmp_path):
    assert plain["evals"][-1][2] < plain["evals"][0][2] - 0.05
    assert plain["final"][0][1] == plain["final"][1][1]  # bit-identical replicas (a digest of every parameter)
    # activation checkpointing (torch.utils.checkpoint in each block) changes nothing, bit for bit
    ac = run(converted, tmp_path / "ac", "--compile", "none", "--activation_checkpointing")
    assert ac["final"] == plain["final"]
    # the rank-0 checkpoint of the eval block, unchanged by the diff, resumes on 2 ranks with torch.load's default
    # (weights_only=True): every rank takes rank 0's state
    r0, r1 = spawn(cp.resume_script_checkpoint, 2, str(converted), str(plain["out"] / "ckpt.pt"), timeout=120)
    assert r0["iter_num"] == 10 and r0["step"] == r1["step"] == 11 and r0["wd"] == [0.5, 0.0]
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_the_converted_script_under_torch_compile(converted, plain, tmp_path, backend):
    """torch.compile before the DDP wrapper (as nanoGPT): LionCub's backward hooks see every gradient. aot_eager
    traces forward and backward as inductor does but runs them eagerly, so it is bit-identical to no compile and
    fast on a CPU; docs/integrations.md says what inductor measured."""
    compiled = run(converted, tmp_path / "compiled", "--compile", backend, "--activation_checkpointing")
    assert compiled["final"][0][1] == compiled["final"][1][1]
    assert compiled["final"] == plain["final"]
