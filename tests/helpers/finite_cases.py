"""Rank functions for tests/optim/test_backward_check.py: a step that communicates inside step() (overlap off)
after a real backward, with the pre-pass calls counted."""

import torch

from lioncub import LionCub, kernels

BUCKET_MB = 1024 / 2**20  # two buckets of the model below


def model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 3))


def counted(name: str, calls: list):
    real = getattr(kernels, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return wrapper


def train(rank, world_size, method, bad_rank=None, touch=False, steps=4):
    """`steps` steps of a small model on rank-dependent data; on `bad_rank` step 2's loss is NaN. `touch`: an
    in-place no-op on every .grad after backward (the flags backward took no longer hold). Per step: pre-pass
    calls inside step(), whether the parameters moved; the final parameters."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, method=method, bucket_mb=BUCKET_MB, overlap=False)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 37, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        if step == 2 and rank == bad_rank:
            loss = loss * float("nan")
        loss.backward()
        if touch:
            for p in net.parameters():
                p.grad.add_(0.0)
        before = [p.detach().clone() for p in net.parameters()]
        calls: list = []
        real = kernels.prepass
        kernels.prepass = counted("prepass", calls)
        try:
            opt.step()
        finally:
            kernels.prepass = real
        out.append(dict(prepass=len(calls), moved=any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))))
    return dict(steps=out, skipped=opt.stats.skipped_steps, buckets=len(opt.engine.buckets),
                params=[p.detach().clone() for p in net.parameters()])


def backward_reads(rank, world_size, method):
    """(finite_flag calls during one backward, buckets) under LionCub(overlap=False)."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, method=method, bucket_mb=BUCKET_MB, overlap=False)
    calls: list = []
    real = kernels.finite_flag
    kernels.finite_flag = counted("finite_flag", calls)
    try:
        net(torch.randn(4, 37)).square().mean().backward()
    finally:
        kernels.finite_flag = real
    opt.step()
    return len(calls), len(opt.engine.buckets)
