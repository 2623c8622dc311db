"""Plain fused Lion step (no communication): the world-size-1 path.

One pass: reads p, g, m and writes p, m (5 x element size bytes per parameter), like lion-pytorch's
Triton kernel, with the torch twin's rounding (so world size 1 reproduces single-process Lion).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    CFG,
    LAUNCH,
    apply_update,
    cached,
    check_flat,
    device_fn,
    emulate_bf16,
    lion_direction,
    load,
    momentum,
    sign,
    store,
    to_dtype,
)


@device_fn
def _lion_tile(p_ptr, g_ptr, m_ptr, offs, n, decay, neg_lr, beta1, omb1, beta2, omb2, MASKED: tl.constexpr,
               EMU: tl.constexpr):
    mask = offs < n
    p = load(p_ptr, offs, mask, MASKED).to(tl.float32)
    g = load(g_ptr, offs, mask, MASKED).to(tl.float32)
    m = load(m_ptr, offs, mask, MASKED).to(tl.float32)
    u = sign(lion_direction(g, m, beta1, omb1))
    store(p_ptr, offs, to_dtype(apply_update(p, u, decay, neg_lr), p_ptr.dtype.element_ty, EMU), mask, MASKED)
    store(m_ptr, offs, to_dtype(momentum(g, m, beta2, omb2), m_ptr.dtype.element_ty, EMU), mask, MASKED)


@triton.jit
def lion_kernel(p_ptr, g_ptr, m_ptr, skip_ptr, n, decay, neg_lr, beta1, omb1, beta2, omb2, BLOCK: tl.constexpr,
                EMU: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if tl.load(skip_ptr) == 0:
        if start + BLOCK <= n:
            _lion_tile(p_ptr, g_ptr, m_ptr, offs, n, decay, neg_lr, beta1, omb1, beta2, omb2, False, EMU)
        else:
            _lion_tile(p_ptr, g_ptr, m_ptr, offs, n, decay, neg_lr, beta1, omb1, beta2, omb2, True, EMU)


def lion_step(p, g, m, *, lr: float, wd: float, beta1: float, beta2: float, skip=None) -> None:
    """p <- p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m <- b2*m + (1-b2)*g, in one launch; nothing where the
    0-dim int32 `skip` (read on the device, no host sync) is nonzero."""
    n = check_flat(p, g, m)
    if n == 0:
        return
    if skip is None:
        skip = cached(("no skip", str(p.device)), lambda: torch.zeros((), dtype=torch.int32, device=p.device))
    block, warps = CFG["lion"]
    lion_kernel[(triton.cdiv(n, block),)](
        p, g, m, skip, n, float(1 - lr * wd), float(-lr), float(beta1), float(1 - beta1), float(beta2),
        float(1 - beta2), BLOCK=block, EMU=emulate_bf16(), **LAUNCH, num_warps=warps)
