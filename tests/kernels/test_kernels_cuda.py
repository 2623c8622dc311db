"""The first Triton launch on the device (`pytest -m cuda`; tests/helpers/cuda_cases.py): lion_step compiles,
runs and computes what its torch twin computes. The kernel-by-kernel equality with the twins is
tests/kernels/test_kernels_triton.py, which `make gpu-check` runs with LIONCUB_TEST_DEVICE=cuda."""

from __future__ import annotations

import time

import pytest
import torch
from cuda_cases import CFG, DEVICE, report, sync

pytestmark = pytest.mark.cuda


def test_first_launch_lion_step_agrees_with_its_twin():
    from lioncub.kernels import reference, triton_ops

    n = CFG["smoke_n"]
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(n, generator=gen).to(DEVICE) for _ in range(3))
    a, b = (p.clone(), m.clone()), (p.clone(), m.clone())
    t = time.perf_counter()
    triton_ops.lion_step(a[0], g, a[1], lr=1e-3, wd=0.1, beta1=0.9, beta2=0.99)
    sync()
    seconds = time.perf_counter() - t
    reference.lion_step(b[0], g, b[1], lr=1e-3, wd=0.1, beta1=0.9, beta2=0.99)
    diff = int((a[0] != b[0]).sum()) + int((a[1] != b[1]).sum())
    report("first launch lion_step vs twin", mismatches=diff, elements=2 * n, seconds_with_compile=round(seconds, 2))
    assert all(bool(torch.isfinite(x).all()) for x in a)
    assert all(float(((x - y).abs() / y.abs().clamp_min(1e-3)).max()) < 1e-2 for x, y in zip(a, b)), \
        "the Triton kernel's result is not the twin's"
    assert not torch.equal(a[0], p) and not torch.equal(a[1], m)
