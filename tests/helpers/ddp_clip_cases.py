"""torch DDP + lioncub.attach_ddp on a few ranks, clipped three ways: what LionCub says about a .grad changed
after backward (module-level, so spawned ranks can import it)."""

from __future__ import annotations

import logging

import torch

import lioncub


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run(rank, world_size, clip: str, steps: int = 3) -> list[str]:
    """`clip`: "none", "torch" (torch.nn.utils.clip_grad_norm_ on .grad, at a norm that bites) or "lioncub"
    (opt.clip_grad_norm_). Returns LionCub's warnings on this rank."""
    records = _Records()
    logging.getLogger("lioncub").addHandler(records)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = lioncub.LionCub(model.parameters(), lr=0.01, method="vote-1bit")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    lioncub.attach_ddp(ddp, opt)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=gen)).square().mean().backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-4)
        elif clip == "lioncub":
            opt.clip_grad_norm_(1e-4)
        opt.step()
    return [m for m in records.messages if "changed after backward" in m]
