"""LionCub at world size 1 on the device (`pytest -m cuda`; tests/helpers/cuda_cases.py): GPT-2-124M's parameter
shapes on the Triton kernels (tiny ones in the CPU rehearsal), no host sync in step(), a NaN gradient skipped on
the device, and the finite check taken during backward used by every step. The step times against
lion-pytorch and fused AdamW are a benchmark: scripts/gpu_bench.py."""

from __future__ import annotations

import math

import pytest
import torch
from cuda_cases import CFG, DEVICE, TRITON_OPS, gpt2_shapes, report, sync
from finite_cases import counted

from lioncub import LionCub, kernels

pytestmark = pytest.mark.cuda
HP = dict(lr=1e-4, weight_decay=0.1)


def _gpt2(seed=0):
    """GPT-2-shaped parameters and gradients on the device (fixed values)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = gpt2_shapes(**CFG["gpt2"])
    base = [torch.randn(s, generator=gen, device=DEVICE).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=DEVICE) for s in shapes]
    return base, grads


def _fresh(base, grads):
    ps = [torch.nn.Parameter(b.clone()) for b in base]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def test_gpt2_shaped_steps_on_the_triton_kernels(monkeypatch):
    """3 steps from the same start: finite, moved, on the Triton kernels, and the same with and without the
    finite check (how far lion-pytorch's Triton Lion is, at rounding level, is reported)."""
    monkeypatch.setenv("LIONCUB_KERNELS", "triton")
    base, grads = _gpt2()
    runs = {}
    for name, skip in (("lioncub", True), ("no finite check", False)):
        ps = _fresh(base, grads)
        opt = LionCub(ps, skip_nonfinite=skip, **HP)
        for _ in range(3):
            opt.step()
        runs[name] = ps
    sync()
    assert kernels.implementation(runs["lioncub"][0].detach()).__name__ == TRITON_OPS
    lc = runs["lioncub"]
    assert sum(math.prod(p.shape) for p in lc) == sum(math.prod(s) for s in gpt2_shapes(**CFG["gpt2"]))
    assert all(bool(torch.isfinite(p).all()) for p in lc)
    assert not all(torch.equal(p.detach(), b) for p, b in zip(lc, base))
    assert all(torch.equal(a, b) for a, b in zip(lc, runs["no finite check"]))
    try:
        from lion_pytorch import Lion
    except ImportError:
        return  # (make gpu-check's install step fails the run without it)
    ps = _fresh(base, grads)
    opt = Lion(ps, use_triton=DEVICE.type == "cuda", **HP)  # its Triton kernel needs CUDA tensors
    for _ in range(3):
        opt.step()
    report("LionCub vs lion-pytorch after 3 steps", mismatches=sum(int((a != b).sum()) for a, b in zip(lc, ps)),
           elements=sum(p.numel() for p in ps))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch.cuda.set_sync_debug_mode: CUDA only")
def test_step_makes_no_host_sync():
    """The finite check stays on the device: a read-back would drain the queue."""
    ps = [torch.nn.Parameter(torch.randn(4096 + k, device=DEVICE)) for k in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = LionCub(ps, lr=1e-3, weight_decay=0.1)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_nan_gradient_is_skipped_on_the_device_and_counted():
    ps = [torch.nn.Parameter(torch.randn(4096 + k, device=DEVICE)) for k in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = LionCub(ps, lr=1e-3, weight_decay=0.1)
    opt.step()
    opt.step()
    sync()
    before = [t.detach().clone() for p in ps for t in (p, opt.state[p]["exp_avg"])]
    ps[1].grad[7] = float("nan")
    opt.step()
    sync()
    assert all(torch.equal(a, b) for a, b in zip(before, [t for p in ps for t in (p, opt.state[p]["exp_avg"])]))
    assert opt.stats.skipped_steps == 1


def _busy_backward(grads: list, dim: int):
    """backward(params): each parameter's gradient (grads') lands after a (dim x dim) matmul, as after a layer's
    backward compute (the check's side stream can run beside it)."""
    w = torch.randn(dim, dim, device=DEVICE)

    class Land(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, g):
            ctx.g = g
            return p.view_as(p)

        @staticmethod
        def backward(ctx, _):
            torch.mm(w, w)
            return ctx.g, None

    def backward(params):
        torch.autograd.backward([Land.apply(p, g).sum() for p, g in zip(params, grads)])
    return backward


@pytest.mark.parametrize("backward", ["accumulate", "computing"])
def test_the_check_taken_in_backward_is_used_by_every_step(monkeypatch, backward):
    """zero_grad(), then backward: torch.autograd.backward(params, grads) (accumulation alone) or one that
    computes before each gradient lands. The check runs during backward (one read per bucket), step() reads no
    gradient, skips nothing, and steps as an optimizer without any check does."""
    monkeypatch.setenv("LIONCUB_KERNELS", "triton")
    base, grads = _gpt2(1)
    back = ((lambda ps: torch.autograd.backward(ps, grads)) if backward == "accumulate"
            else _busy_backward(grads, CFG["busy_dim"]))
    runs = {}
    for name, skip in (("check in backward", True), ("no check", False)):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        runs[name] = (ps, LionCub(ps, skip_nonfinite=skip, **HP))
    reads: list = []
    monkeypatch.setattr(kernels, "finite_flag", counted("finite_flag", reads))
    for _ in range(3):
        for name, (ps, opt) in runs.items():
            opt.zero_grad()
            back(ps)
            sync()
            if name == "check in backward":
                assert reads, "backward took no check"
            reads.clear()
            opt.step()
            sync()
            assert reads == [], f"{name}: step() read the gradients again"
    assert runs["check in backward"][1].stats.skipped_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(runs["check in backward"][0], runs["no check"][0]))
