"""The README's torchrun example runs as documented."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_example_trains_and_keeps_replicas_identical():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "torchrun_minimal.py"), "--steps", "20", "--method", "vote-1bit"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 2 rank(s), method vote-1bit" in out.stdout
    losses = [float(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05  # it learns
