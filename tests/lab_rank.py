"""Rank programs for the lab tests: `python lab_rank.py SCENARIO [ARGS]`, started by the lab launcher."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from lioncub.lab import report


def gloo_sum() -> None:
    """Each rank all-reduces its rank number over the lab and reports where it ran."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    report({
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": x.item(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "ifname": os.environ["GLOO_SOCKET_IFNAME"],
        "interfaces": [name for _, name in socket.if_nameindex()],
        "master": os.environ["MASTER_ADDR"],
    })
    from lioncub.distributed import finish

    finish()


def die(victim: int) -> None:
    """All ranks all-reduce in a loop; `victim` SIGKILLs itself mid-run. The others would block in the
    collective (or fail) without the launcher."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.ones(1 << 16)
    for step in range(10**9):
        if step == 3 and dist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
        x.fill_(1)


def hang() -> None:
    """No torch: print our pid and sleep until killed."""
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    {"gloo_sum": gloo_sum, "die": die, "hang": hang}[scenario](*map(int, args))
