"""The README's torchrun example runs as documented."""

import os
import subprocess
import sys

from repo import REPO

ROOT = str(REPO)


def test_torchrun_example_trains_and_keeps_replicas_identical():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "torchrun_minimal.py"), "--steps", "20", "--method", "vote-1bit"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 2 rank(s), method vote-1bit" in out.stdout
    losses = [float(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05  # it learns


def test_torchrun_example_on_two_nodes_hierarchical():
    """Two torchrun agents (two "nodes" of 2 ranks, c10d rendezvous): LOCAL_WORLD_SIZE gives the node size."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               os.path.join(ROOT, "examples", "torchrun_minimal.py"), "--steps", "20",
                               "--method", "vote-1bit", "--hierarchical"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    assert "done: 4 rank(s), nodes of 2, method vote-1bit" in outs[0][0]
    losses = [float(line.split()[3]) for line in outs[0][0].splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05
