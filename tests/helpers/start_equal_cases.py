"""Multi-rank scenarios of the start check (Engine.start_equal, issue 51): every path LionCub trains by, with
models that every rank built alike or each rank from its own seed, and what the check put on the wire."""

from __future__ import annotations

import torch
from dist_cases import flat, gather
from safe_cases import BUCKET_MB, LR, batch, listen

from lioncub import LionCub, LocalSteps
from lioncub.comm import transport

CHECK, FIX = "all_reduce (same parameters)", "broadcast (parameters)"
PATHS = {  # name: (method, LionCub's options)
    "vote-1bit": ("vote-1bit", {}),
    "l1-pbit": ("l1-pbit", {}),
    "allreduce": ("allreduce", {}),
    "no-overlap": ("vote-1bit", dict(overlap=False)),
    "warmup": ("vote-pbit", dict(dense_warmup=2)),
    "node": ("vote-1bit", dict(node_size=2)),
    "local": ("vote-1bit", dict(local=LocalSteps(2))),
    "ddp": ("vote-1bit", {}),  # in torch DDP, attached (lioncub.attach_ddp)
}


def model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def run(rank, world_size, path, own_seed, check=True, steps=3):
    """`steps` steps on `path`, the model seeded by the rank (`own_seed`) or alike; with check=False the check is
    left out. Returns whether the parameters were the same on every rank after each step
    (with local steps: after each outer step, every 2nd), the named collectives this process called from the
    optimizer's construction on, and the warnings."""
    log = listen()
    net = model(rank if own_seed else 0)
    method, options = PATHS[path]
    transport.record_call_times(False)  # (restart the count)
    transport.record_call_times(True)
    opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB, **options)
    driven = net
    if path == "ddp":
        from lioncub.integrations.ddp import attach_ddp

        driven = torch.nn.parallel.DistributedDataParallel(net)
        attach_ddp(driven, opt)
    if not check:
        opt.engine.start_equal = lambda: None
    equal = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(driven(x), y).backward()
        opt.step()
        if path != "local" or step % 2 == 0:
            params = flat(net.parameters())
            equal.append(all(torch.equal(x, params) for x in gather(params)))
    return dict(equal=equal, calls={k: n for k, (n, _) in transport.call_times().items()},
                buckets=len(opt.engine.buckets), warnings=[m for m in log.messages if "parameters differed" in m])
