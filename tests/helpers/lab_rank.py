"""Rank programs for the lab tests: `python lab_rank.py SCENARIO [ARGS]`, started by the lab launcher."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from lioncub.apps.lab import report


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
    from lioncub.comm.distributed import finish

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


def link_traffic(local_bytes: int, link_bytes: int) -> None:
    """Two phases, each framed by reads of this host's link counters and of its loopback's: (1) the ranks of
    each host all-reduce `local_bytes` among themselves, (2) local rank 0 of hosts 0 and 1 all-reduce
    `link_bytes` with each other. Local rank 0 reports the counters."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from lioncub.apps.lab import link_counters

    def lo() -> dict:
        stats = Path("/sys/class/net/lo/statistics")
        return {k: int((stats / k).read_text()) for k in ("tx_bytes", "rx_bytes")}

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rph = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = [dist.new_group(list(range(h * rph, (h + 1) * rph))) for h in range(world // rph)]
    node = nodes[rank // rph]
    cross = dist.new_group([0, rph])
    dist.all_reduce(torch.ones(1024), group=node)  # connect the pairs before counting
    dist.all_reduce(torch.ones(1024), group=cross) if rank in (0, rph) else None
    dist.barrier()
    marks = [(link_counters(), lo())]
    dist.all_reduce(torch.ones(local_bytes // 4), group=node)
    dist.barrier(group=node)
    marks.append((link_counters(), lo()))
    dist.barrier()
    marks.append((link_counters(), lo()))
    if rank in (0, rph):
        dist.all_reduce(torch.ones(link_bytes // 4), group=cross)
    dist.barrier(group=node)
    marks.append((link_counters(), lo()))
    if os.environ["LOCAL_RANK"] == "0":
        report({"link": [m[0] for m in marks], "lo": [m[1] for m in marks]})
    dist.barrier()
    from lioncub.comm.distributed import finish

    finish()


def hang() -> None:
    """No torch: print our pid and sleep until killed."""
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    {"gloo_sum": gloo_sum, "die": die, "hang": hang, "link_traffic": link_traffic}[scenario](*map(int, args))
