"""Multi-rank scenarios of tests/optim/test_replicas.py: ranks that bring the same gradients to a step (a model
wrapped in torch DDP that LionCub was not attached to, or every rank reading the same data)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from dist_cases import flat, gather
from safe_cases import listen

from lioncub import LionCub
from lioncub.optim import Lion


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def ddp_without_attach(rank, world_size, method, runs=3, steps=3):
    """`runs` times: a model wrapped in DDP, LionCub (overlap on) built on its parameters, never attached; every
    rank its own data. Beside it, plain Lion on a copy, fed the gradients DDP averaged."""
    log = listen()
    out = []
    for run in range(runs):
        net = _net(run)
        ref = copy.deepcopy(net)
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, method=method, overlap=True)
        lion = Lion(ref.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(steps):
            x, y = _batch(100 * step + 10 * run + rank)
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            for p, q in zip(net.parameters(), ref.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            lion.step()
        params = flat(net.parameters())
        out.append(dict(replicas_equal=all(torch.equal(params, x) for x in gather(params)),
                        err=(params - flat(ref.parameters())).abs().max().item(),
                        overlapped=opt.stats.overlapped_steps))
    return dict(runs=out, messages=log.messages)


def same_data(rank, world_size, method, overlap, shared, steps=3, dense_warmup=0):
    """`steps` steps with every rank reading the same batches (`shared`) or its own; the warnings and each step's
    collectives."""
    log = listen()
    net = _net()
    opt = LionCub(net.parameters(), lr=0.01, method=method, overlap=overlap, dense_warmup=dense_warmup)
    collectives = []
    for step in range(steps):
        x, y = _batch(100 * step + (0 if shared else rank))
        opt.zero_grad()
        (net(x) - y).square().mean().backward()
        opt.step()
        collectives.append(opt.stats.last_collectives)
    dist.barrier()
    return dict(messages=log.messages, collectives=collectives)


class _SumInBackward(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient on the default group, from the autograd thread, as
    tensor-parallel layers and SyncBatchNorm do."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def collectives_in_backward(rank, world_size, method, overlap, steps=4):
    """A six-layer model whose backward all-reduces between layers, with tiny buckets (one exchange per layer on
    LionCub's thread, during backward); returns the parameters."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(6)])
    opt = LionCub(layers.parameters(), lr=0.01, method=method, overlap=overlap, bucket_mb=1e-4)
    for step in range(steps):
        x, _ = _batch(100 * step + rank)
        for layer in layers:
            x = _SumInBackward.apply(torch.tanh(layer(x)))
        opt.zero_grad()
        x.square().mean().backward()
        opt.step()
    params = flat(layers.parameters())
    return dict(params=params, replicas_equal=all(torch.equal(params, x) for x in gather(params)),
                overlapped=opt.stats.overlapped_steps)


def own_groups(rank, world_size):
    """The group two overlapping optimizers send on, and a non-overlapping one's."""
    a = LionCub(_net().parameters(), lr=0.01, overlap=True)
    b = LionCub(_net().parameters(), lr=0.01, overlap=True)
    c = LionCub(_net().parameters(), lr=0.01, overlap=False)
    world = dist.group.WORLD
    return dict(shared=a.process_group is b.process_group, own=a.process_group is not world,
                plain_on_world=c.process_group in (None, world),
                ranks=dist.get_process_group_ranks(a.process_group))
