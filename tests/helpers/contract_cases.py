"""Multi-rank scenarios of torch.optim's contract (module-level functions, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_cases import flat, gather

from lioncub import LionCub


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def add_param_group(rank, world_size, method, overlap):
    """Train the first layer alone for 2 steps, add the second layer as a param group, train 3 more."""
    net = _net()
    first, second = list(net[0].parameters()), list(net[2].parameters())
    opt = LionCub(first, lr=0.01, method=method, overlap=overlap, bucket_mb=1e-4)
    seen = []
    for step in range(1, 6):
        if step == 3:
            opt.add_param_group(dict(params=second, lr=0.02))
        gen = torch.Generator().manual_seed(100 * step + rank)
        before = flat(second).clone()
        opt.zero_grad()
        net(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        seen.append((flat(second) - before).abs().max().item())
    params = flat(net.parameters())
    return dict(moved=seen, replicas_equal=all(torch.equal(params, x) for x in gather(params)),
                groups=len(opt.param_groups), buckets=len(opt.engine.buckets),
                momentum_of_second=[opt.state[p]["exp_avg"].abs().sum().item() for p in second],
                world=dist.get_world_size())


class _Branchy(torch.nn.Module):
    """`never` is in no rank's graph; `rank0` only in rank 0's; `shared` in every rank's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.shared = torch.nn.Linear(6, 6)
        self.rank0 = torch.nn.Linear(6, 6)
        self.never = torch.nn.Linear(6, 6)

    def forward(self, x, rank):
        y = self.shared(x)
        return self.rank0(y) if rank == 0 else y


def unused_parameters(rank, world_size, method, overlap, kw=None):
    """Five steps with opt.zero_grad() (set_to_none, torch's default) before each backward."""
    net = _Branchy()
    opt = LionCub(net.parameters(), lr=0.01, weight_decay=0.1, method=method, overlap=overlap,
                  momentum_sync=None if method == "allreduce" else 2, bucket_mb=1e-4, **(kw or {}))
    start = {name: flat(m.parameters()).clone() for name, m in net.named_children()}
    for step in range(1, 6):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        net(torch.randn(4, 6, generator=gen), rank).square().mean().backward()
        opt.step()
    now = {name: flat(m.parameters()) for name, m in net.named_children()}
    moms = opt.state_dict()["state"]
    params = flat(net.parameters())
    return dict(moved={name: not torch.equal(start[name], now[name]) for name in now},
                replicas_equal=all(torch.equal(params, x) for x in gather(params)),
                never_momentum=[float(moms[i]["exp_avg"].abs().sum()) for i in (4, 5)] if 4 in moms else None,
                collectives=opt.stats.total_collectives, skipped=opt.stats.skipped_steps)
