"""Quantize-and-pack: read g and m, form c, write the packed code, update m in place, in one pass.
(With update_momentum=False m is left as it is: the overlapped step updates it in unpack_apply, once every
rank has agreed to take the step.)

1-bit methods (vote-allgather, vote-1bit): a program owns BYTES output bytes = 8*BYTES consecutive
elements, loaded as a [BYTES, 8] tile (rows contiguous: coalesced, vectorised). Bit j of byte b is
element 8b+j (little-endian):

    elements  | e0 e1 e2 e3 e4 e5 e6 e7 | e8 ...        bit = c > 0, or c == 0 and (i + parity) even
    byte 0    |  b0 (LSB) ...      b7   | byte 1 ...

Elements past n (the padding of a 1-bit all-to-all buffer) read as g = m = 0, so they vote like c == 0,
as in the torch twin.

`quantize_pack_checked` also counts the non-finite gradients each program read (CHECK: one int32 per
program, which the host-side wrapper reduces on the device), so where the momentum update waits for the
ranks' agreement (the overlapped step) the non-finite check costs no read of its own.

p-bit methods: the planar layout of lioncub.comm.wire.FieldLayout, W words of F fields of `width` bits:

    word w  =  v[w] | v[W + w] << width | v[2W + w] << 2*width | ... | v[(F-1)W + w] << (F-1)*width

A program owns BW consecutive words and, for each field j, reads the BW consecutive elements jW + w, so
every access is contiguous. v = sign(c) + 1 (vote-pbit, avg-pbit) or clamp(rint(c*mult_t), -s, s) + s
(l1-pbit), where mult_t is the multiplier of the parameter tensor holding the element: a host-built table
gives the first and last tensor of each (program, field); when they agree (almost always: tensors are
much longer than a tile) mult is one scalar load, otherwise a branch-free binary search over the bucket's
tensor offsets finds it per element.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .triton_common import (
    CFG,
    LAUNCH,
    cached,
    check_flat,
    check_offsets,
    device_fn,
    dummy,
    emulate_bf16,
    field_codec_id,
    lion_direction,
    load,
    momentum,
    next_pow2,
    nonfinite,
    rint,
    sign,
    store,
    to_dtype,
    total,
)


@device_fn
def _onebit_tile(g_ptr, m_ptr, out_ptr, bad_ptr, pid, rows, n, nbytes, beta1, omb1, beta2, omb2, parity,
                 UPDATE_M: tl.constexpr, MASKED: tl.constexpr, EMU: tl.constexpr, CHECK: tl.constexpr):
    j = tl.arange(0, 8)
    i = rows[:, None] * 8 + j[None, :]
    mask = i < n
    g = load(g_ptr, i, mask, MASKED).to(tl.float32)
    m = load(m_ptr, i, mask, MASKED).to(tl.float32)
    if CHECK:
        tl.store(bad_ptr + pid, total(total(nonfinite(g), axis=1), axis=0))
    c = lion_direction(g, m, beta1, omb1)
    if UPDATE_M:
        store(m_ptr, i, to_dtype(momentum(g, m, beta2, omb2), m_ptr.dtype.element_ty, EMU), mask, MASKED)
    zero_vote = ((j + parity) & 1) == 0
    bit = (c > 0) | ((c == 0) & zero_vote[None, :])
    byte = total(bit.to(tl.int32) << j[None, :], axis=1)
    store(out_ptr, rows, byte.to(tl.uint8), rows < nbytes, MASKED)


@triton.jit
def onebit_kernel(g_ptr, m_ptr, out_ptr, bad_ptr, n, nbytes, beta1, omb1, beta2, omb2, parity,
                   BYTES: tl.constexpr, UPDATE_M: tl.constexpr, EMU: tl.constexpr, CHECK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BYTES + tl.arange(0, BYTES)
    end = (pid + 1) * BYTES
    if (end * 8 <= n) & (end <= nbytes):
        _onebit_tile(g_ptr, m_ptr, out_ptr, bad_ptr, pid, rows, n, nbytes, beta1, omb1, beta2, omb2, parity,
                     UPDATE_M, False, EMU, CHECK)
    else:
        _onebit_tile(g_ptr, m_ptr, out_ptr, bad_ptr, pid, rows, n, nbytes, beta1, omb1, beta2, omb2, parity,
                     UPDATE_M, True, EMU, CHECK)


@device_fn
def _l1_multiplier(mult_ptr, off_ptr, seg_ptr, i, slot, BW: tl.constexpr, NSTEPS: tl.constexpr):
    """fp32 multiplier of the tensor holding each element i (seg_ptr: first/last tensor of this tile)."""
    first = tl.load(seg_ptr + 2 * slot)
    last = tl.load(seg_ptr + 2 * slot + 1)
    if first == last:
        k = tl.full([BW], 0, tl.float32) + tl.load(mult_ptr + first)
    else:  # largest t in [first, last] with offsets[t] <= i
        lo = tl.full([BW], 0, tl.int32) + first
        hi = tl.full([BW], 0, tl.int32) + last + 1
        for _ in tl.static_range(NSTEPS):
            mid = (lo + hi) >> 1
            go = tl.load(off_ptr + mid) <= i
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        k = tl.load(mult_ptr + lo)
    return k


@device_fn
def _fields_tile(g_ptr, m_ptr, out_ptr, mult_ptr, off_ptr, seg_ptr, bad_ptr, w, pid, n, W, beta1, omb1, beta2,
                 omb2, levels, CODEC: tl.constexpr, WIDTH: tl.constexpr, FIELDS: tl.constexpr, WIDE: tl.constexpr,
                 BW: tl.constexpr, NSTEPS: tl.constexpr, UPDATE_M: tl.constexpr, MASKED: tl.constexpr,
                 EMU: tl.constexpr, CHECK: tl.constexpr):
    acc = tl.full([BW], 0, tl.int64 if WIDE else tl.int32)
    bad = tl.full([BW], 0, tl.int32)
    for j in tl.static_range(FIELDS):
        i = j * W + w
        mask = (w < W) & (i < n)
        g = load(g_ptr, i, mask, MASKED).to(tl.float32)
        m = load(m_ptr, i, mask, MASKED).to(tl.float32)
        if CHECK:
            bad += nonfinite(g)
        c = lion_direction(g, m, beta1, omb1)
        if UPDATE_M:
            store(m_ptr, i, to_dtype(momentum(g, m, beta2, omb2), m_ptr.dtype.element_ty, EMU), mask, MASKED)
        if CODEC == 3:  # L1 levels: clamp first, then round (the same as round-then-clamp for integer s)
            k = _l1_multiplier(mult_ptr, off_ptr, seg_ptr, i, pid * FIELDS + j, BW, NSTEPS)
            v = rint(tl.minimum(tl.maximum(c * k, -levels), levels)) + levels
        else:
            v = sign(c) + 1.0
        if MASKED:
            v = tl.where(mask, v, 0.0)  # fields past n stay 0
        acc += v.to(acc.dtype) << (WIDTH * j)
    store(out_ptr, w, acc.to(out_ptr.dtype.element_ty), w < W, MASKED)
    if CHECK:
        tl.store(bad_ptr + pid, total(bad, axis=0))


@triton.jit
def fields_kernel(g_ptr, m_ptr, out_ptr, mult_ptr, off_ptr, seg_ptr, bad_ptr, n, W, beta1, omb1, beta2, omb2,
                   levels, CODEC: tl.constexpr, WIDTH: tl.constexpr, FIELDS: tl.constexpr, WIDE: tl.constexpr,
                   BW: tl.constexpr, NSTEPS: tl.constexpr, UPDATE_M: tl.constexpr, EMU: tl.constexpr,
                   CHECK: tl.constexpr):
    pid = tl.program_id(0)
    w = pid * BW + tl.arange(0, BW)
    end = (pid + 1) * BW
    if (end <= W) & ((FIELDS - 1) * W + end <= n):
        _fields_tile(g_ptr, m_ptr, out_ptr, mult_ptr, off_ptr, seg_ptr, bad_ptr, w, pid, n, W, beta1, omb1, beta2,
                     omb2, levels, CODEC, WIDTH, FIELDS, WIDE, BW, NSTEPS, UPDATE_M, False, EMU, CHECK)
    else:
        _fields_tile(g_ptr, m_ptr, out_ptr, mult_ptr, off_ptr, seg_ptr, bad_ptr, w, pid, n, W, beta1, omb1, beta2,
                     omb2, levels, CODEC, WIDTH, FIELDS, WIDE, BW, NSTEPS, UPDATE_M, True, EMU, CHECK)


def field_words_per_program(fields: int) -> int:
    return max(16, CFG["fields"][0] // next_pow2(fields))


def _tile_segments(offsets, n: int, W: int, bw: int, fields: int, device):
    """(offsets as int32, [first, last] tensor of each (program, field) as int32 pairs) on the device."""
    def build():
        off = check_offsets(offsets, n)
        grid = triton.cdiv(W, bw)
        first = np.arange(fields)[None, :] * W + np.arange(grid)[:, None] * bw
        last = np.minimum(np.minimum(first + bw, (np.arange(fields)[None, :] + 1) * W), n) - 1
        empty = last < first
        seg = np.stack([np.searchsorted(off, np.where(empty, 0, x), side="right") - 1 for x in (first, last)], -1)
        seg = np.minimum(seg, len(off) - 2)
        return (torch.from_numpy(off.astype(np.int32)).to(device),
                torch.from_numpy(seg.reshape(-1).astype(np.int32)).to(device))
    return cached(("tile_segments", tuple(offsets), n, W, bw, fields, str(device)), build)


def quantize_pack(codec, g, m, out: torch.Tensor, *, beta1: float, beta2: float, zero_parity: int = 0,
                  layout=None, mult: torch.Tensor | None = None, offsets=None, levels: int = 0,
                  update_momentum: bool = True) -> torch.Tensor:
    """Form c, write the codec's packed code into `out`, update m in place: one launch, one pass."""
    _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum, False)
    return out


def quantize_pack_checked(codec, g, m, out: torch.Tensor, *, beta1: float, beta2: float, zero_parity: int = 0,
                          layout=None, mult: torch.Tensor | None = None, offsets=None, levels: int = 0,
                          update_momentum: bool = True) -> torch.Tensor:
    """quantize_pack, returning whether every element of g is finite (a 0-dim bool tensor on g's device, no host
    sync), counted in the same pass."""
    bad = _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum,
                    True)
    return torch.ones((), dtype=torch.bool, device=g.device) if bad is None else ~bad.any()


def _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum,
              check: bool) -> torch.Tensor | None:
    """The launch; with `check`, the per-program non-finite counts (None where nothing was launched)."""
    n = check_flat(g, m)
    scalars = (float(beta1), float(1 - beta1), float(beta2), float(1 - beta2))
    if not out.is_contiguous() or out.device != g.device:
        raise ValueError("quantize_pack: `out` must be contiguous on the bucket's device")
    if codec.kind == "signs":
        nbytes = out.numel()
        covered = max(nbytes, triton.cdiv(n, 8))
        if covered == 0:
            return None
        rows, warps = CFG["onebit"]
        grid = triton.cdiv(covered, rows)
        bad = torch.empty(grid, dtype=torch.int32, device=g.device) if check else dummy(g.device)
        onebit_kernel[(grid,)](g, m, out, bad, n, nbytes, *scalars, int(zero_parity) % 2, BYTES=rows,
                               UPDATE_M=bool(update_momentum), EMU=emulate_bf16(), CHECK=check, **LAUNCH,
                               num_warps=warps)
        return bad if check else None
    codec_id = field_codec_id(codec)
    W, F = out.numel(), layout.per_word
    if W * F < n:
        raise ValueError(f"{W} words of {F} fields cannot hold {n} values")
    if out.dtype != getattr(torch, layout.dtype):
        raise ValueError(f"quantize_pack: out is {out.dtype}, the layout needs {layout.dtype}")
    if W == 0:
        return None
    bw = field_words_per_program(F)
    if codec.l1:
        if mult is None or offsets is None:
            raise ValueError("quantize_pack: l1-pbit needs mult and offsets (from prepass)")
        off, seg = _tile_segments(offsets, n, W, bw, F, g.device)
        mult = mult.to(device=g.device, dtype=torch.float32)
        nsteps = max(1, (len(offsets) - 1).bit_length())
    else:
        off = seg = mult = dummy(g.device)  # not read by this specialisation
        nsteps = 1
    grid = triton.cdiv(W, bw)
    bad = torch.empty(grid, dtype=torch.int32, device=g.device) if check else dummy(g.device)
    fields_kernel[(grid,)](
        g, m, out, mult, off, seg, bad, n, W, *scalars, float(levels), CODEC=codec_id, WIDTH=layout.width,
        FIELDS=F, WIDE=layout.word_bits == 64, BW=bw, NSTEPS=nsteps, UPDATE_M=bool(update_momentum), EMU=emulate_bf16(),
        CHECK=check, **LAUNCH, num_warps=CFG["fields"][1])
    return bad if check else None
