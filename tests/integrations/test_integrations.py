"""The framework recipes (examples/) run under torchrun on 2 local Gloo ranks: Hugging Face Trainer, accelerate
and Lightning each wrap the model in DDP; LionCub attached to it votes during every backward, the model
learns, and the replicas stay identical (each example asserts it before printing "done")."""

import os
import re
import subprocess
import sys

import pytest
from repo import REPO

ROOT = str(REPO)


def _torchrun(script, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_hugging_face_trainer():
    out = _torchrun("hf_trainer.py", "--steps", "30", "--method", "vote-1bit")
    losses = [float(x) for x in re.search(r"losses ([\d. ]+)", out).group(1).split()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    assert "done: hf trainer, method vote-1bit, 30 overlapped steps" in out


@pytest.mark.parametrize("script, name", [("accelerate_loop.py", "accelerate"), ("lightning_ddp.py", "lightning")])
def test_accelerate_and_lightning(script, name):
    out = _torchrun(script, "--steps", "40", "--method", "l1-pbit")
    first, last = map(float, re.search(r"loss first ([\d.]+) last ([\d.]+)", out).groups())
    assert last < first - 0.3
    assert f"done: {name}, method l1-pbit, 40 steps, 40 overlapped" in out
