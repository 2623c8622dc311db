"""Rank functions for tests/optim/test_backward_check.py: a step that communicates inside step() (overlap off)
after a real backward, with the pre-pass calls counted."""

import torch

from lioncub import LionCub, kernels
from lioncub.comm import wire

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


def train(rank, world_size, method, bad_rank=None, touch=False, steps=4, edit=None, merged=False):
    """`steps` steps of a small model on rank-dependent data; on `bad_rank` step 2's loss is NaN. `touch`: an
    in-place no-op on every .grad after backward (the flags backward took no longer hold). `edit` (EDITS), after
    step 3's backward: a change that leaves the gradients as they are. `merged`: automatic buckets, which step()
    exchanges as runs (lioncub.optim.buckets.Run); else the buckets one by one. Per step: pre-pass calls inside step(),
    whether the parameters moved; the final parameters and momenta."""
    net = model()
    if merged:
        wire.auto_bucket_mb = lambda total: BUCKET_MB
    opt = LionCub(net.parameters(), lr=1e-2, method=method, bucket_mb=None if merged else BUCKET_MB, overlap=False)
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
        if edit and step == 3:
            EDITS[edit](opt)
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
                runs=len(opt.engine.step_units(opt.engine.spec)[0]),
                params=[p.detach().clone() for p in net.parameters()],
                momenta=[opt.state[p]["exp_avg"].clone() for p in net.parameters()])


def _halve_a_momentum(opt):
    opt.state[next(iter(opt.state))]["exp_avg"].mul_(0.5)


def _change_beta1(opt):
    opt.param_groups[0]["betas"] = (0.8, opt.param_groups[0]["betas"][1])


def _clip(opt):
    opt.clip_grad_norm_(1e-3)


EDITS = {"momentum": _halve_a_momentum, "beta1": _change_beta1, "clip": _clip}


def backward_reads(rank, world_size, method):
    """({kernel: calls during one backward} of the check and the pre-pass, buckets) under LionCub(overlap=False)."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, method=method, bucket_mb=BUCKET_MB, overlap=False)
    calls: list = []
    real = kernels.finite_flag, kernels.prepass
    kernels.finite_flag, kernels.prepass = counted("finite_flag", calls), counted("prepass", calls)
    try:
        net(torch.randn(4, 37)).square().mean().backward()
    finally:
        kernels.finite_flag, kernels.prepass = real
    opt.step()
    return {k: calls.count(k) for k in set(calls)}, len(opt.engine.buckets)
