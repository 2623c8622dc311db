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


def _two_nodes(script, *args):
    """Two torchrun agents (two "nodes" of 2 ranks, c10d rendezvous): LOCAL_WORLD_SIZE gives the node size. The
    stdout of node 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               os.path.join(ROOT, "examples", script), *args],
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
    return outs[0][0]


def _losses(out):
    return [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]


def test_torchrun_example_on_two_nodes_hierarchical():
    out = _two_nodes("torchrun_minimal.py", "--steps", "20", "--method", "vote-1bit", "--hierarchical")
    assert "done: 4 rank(s), nodes of 2, method vote-1bit" in out
    losses = _losses(out)
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05


def test_hsdp_example_on_two_nodes_shards_and_votes():
    """examples/hsdp_minimal.py: FSDP2 shards inside each node, vote-1bit across the two; the example asserts the
    full model is identical on every rank; each rank holds half the parameters."""
    import re

    out = _two_nodes("hsdp_minimal.py", "--steps", "30", "--method", "vote-1bit")
    done = re.search(r"done: 4 rank\(s\), 2 node\(s\) of 2, method vote-1bit, final loss [\d.]+, "
                     r"parameters per rank (\d+) of (\d+)", out)
    assert done, out[-2000:]
    local, dense = map(int, done.groups())
    assert 2 * local == dense  # every layer's rows split evenly in two: 1/G exactly
    losses = _losses(out)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05
