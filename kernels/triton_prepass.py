"""The read-only pre-pass of a compressed step: is every gradient finite, and (l1-pbit) mean |c| per tensor.

The ranks must agree that every gradient is finite before anything is written (a skipped step leaves
p and m untouched), so the step reads the bucket once before quantizing. The L1 scale rides on that pass:

* vote/avg methods: one read of g (element size bytes per parameter); each tile writes a count of
  non-finite elements; the host reduces the few thousand counts.
* l1-pbit: one read of g and m. The bucket is cut into the tiles of a uniform grid, split where a
  parameter tensor ends, so no tile straddles two tensors; each tile forms c and writes the sum of |c|
  accumulated in fp64 (|c| is exact in fp32; the fp64 tree sum of <= 4096 terms is accurate to ~1e-16
  and cannot overflow). A second tiny kernel adds each tensor's tile sums in fp64, in a fixed order
  (deterministic, no atomics). c is not stored: quantize_pack recomputes it from g and m, which costs
  the same bytes as storing and reloading it in fp32 and fewer in bf16.
The non-finite flag of l1-pbit is "some tensor's sum of |c| is not finite", as in the torch twin.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import reference
from .triton_common import CFG, LAUNCH, cached, check_flat, check_offsets, lion_direction, load, nonfinite, total


@triton.jit
def finite_kernel(g_ptr, bad_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if (pid + 1) * BLOCK <= n:
        g = load(g_ptr, offs, mask, False).to(tl.float32)
    else:
        g = load(g_ptr, offs, mask, True).to(tl.float32)
    tl.store(bad_ptr + pid, total(nonfinite(g), axis=0))


@triton.jit
def l1_sum_kernel(g_ptr, m_ptr, tile_ptr, lo_ptr, hi_ptr, part_ptr, beta1, omb1, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.multiple_of(tl.load(tile_ptr + pid) * BLOCK, BLOCK)
    lo = tl.load(lo_ptr + pid)
    hi = tl.load(hi_ptr + pid)
    offs = start + tl.arange(0, BLOCK)
    mask = (offs >= lo) & (offs < hi)
    if (lo == start) & (hi == start + BLOCK):
        g = load(g_ptr, offs, mask, False).to(tl.float32)
        m = load(m_ptr, offs, mask, False).to(tl.float32)
    else:
        g = load(g_ptr, offs, mask, True).to(tl.float32)  # masked lanes read 0, so c = 0 there
        m = load(m_ptr, offs, mask, True).to(tl.float32)
    a = tl.abs(lion_direction(g, m, beta1, omb1)).to(tl.float64)
    tl.store(part_ptr + pid, total(a, axis=0))


@triton.jit
def combine_kernel(part_ptr, first_ptr, sums_ptr, CHUNK: tl.constexpr):
    s = tl.program_id(0)
    a = tl.load(first_ptr + s)
    b = tl.load(first_ptr + s + 1)
    acc = tl.full([CHUNK], 0, tl.float64)
    for k in range(a, b, CHUNK):
        idx = k + tl.arange(0, CHUNK)
        acc += tl.load(part_ptr + idx, mask=idx < b, other=0.0)
    tl.store(sums_ptr + s, total(acc, axis=0))


def l1_tiles(offsets, n: int, block: int, device):
    """(tile, lo, hi, first) as device int32 tensors: tile t of the uniform grid restricted to [lo, hi),
    one row per (tensor, tile) pair; the rows of tensor s are first[s]:first[s+1]."""
    def build():
        off = check_offsets(offsets, n)
        a, b = off[:-1], off[1:]
        t0 = a // block
        counts = np.where(b > a, (b - 1) // block - t0 + 1, 0)
        first = np.concatenate([[0], np.cumsum(counts)])
        seg = np.repeat(np.arange(len(a)), counts)
        tile = t0[seg] + np.arange(int(first[-1])) - first[seg]
        lo = np.maximum(a[seg], tile * block)
        hi = np.minimum(b[seg], (tile + 1) * block)
        return tuple(torch.from_numpy(x.astype(np.int32)).to(device) for x in (tile, lo, hi, first))
    return cached(("l1_tiles", tuple(offsets), n, block, str(device)), build)


def segment_abs_sums(g, m, *, beta1: float, offsets) -> torch.Tensor:
    """float64 sums of |b1*m + (1-b1)*g| over each segment [offsets[i], offsets[i+1])."""
    n = check_flat(g, m)
    block, warps = CFG["l1_sum"]
    tile, lo, hi, first = l1_tiles(offsets, n, block, g.device)
    sums = torch.zeros(len(offsets) - 1, dtype=torch.float64, device=g.device)
    if tile.numel() == 0:
        return sums
    parts = torch.empty(tile.numel(), dtype=torch.float64, device=g.device)
    l1_sum_kernel[(tile.numel(),)](g, m, tile, lo, hi, parts, float(beta1), float(1 - beta1),
                                    BLOCK=block, **LAUNCH, num_warps=warps)
    combine_kernel[(sums.numel(),)](parts, first, sums, CHUNK=CFG["combine"], **LAUNCH, num_warps=4)
    return sums


def finite_flag(g) -> torch.Tensor:
    """A 0-dim bool tensor on g's device: whether every element is finite (no host sync)."""
    n = check_flat(g)
    if n == 0:
        return torch.ones((), dtype=torch.bool, device=g.device)
    block, warps = CFG["finite"]
    grid = triton.cdiv(n, block)
    bad = torch.empty(grid, dtype=torch.int32, device=g.device)
    finite_kernel[(grid,)](g, bad, n, BLOCK=block, **LAUNCH, num_warps=warps)
    return ~bad.any()


def prepass(codec, g, m, *, beta1: float, offsets, levels: int = 0):
    """Read-only pass before the step: (whether every gradient is finite, as a 0-dim bool tensor on g's
    device; L1 multipliers or None). Nothing waits for the GPU: the caller syncs once per step."""
    if codec.l1:
        sums = segment_abs_sums(g, m, beta1=beta1, offsets=offsets)
        return torch.isfinite(sums).all(), reference.l1_multipliers(sums, list(offsets), levels)
    return finite_flag(g), None
