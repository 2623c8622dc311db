"""Majority vote over N packed 1-bit rows: per bit position, P = number of + votes; write 2P > N (sign)
and 2P != N (not a tie).

Nothing is unpacked. The count is kept bit-sliced in registers: plane k holds bit k of P for the 32 bit
positions of an int32 word (or 8 of a byte), and each row is added by a ripple-carry of two bitwise ops
per plane. With K = bit_length(N) planes the vote costs 2K integer ops per 32 positions per row, and the
compare with floor(N/2) is K more, scanning from the most significant plane:

    rows (N, B) -> per word: for r < N: carry = row[r]; (plane_k, carry) = (plane_k ^ carry, plane_k & carry)
                   sign = [P > floor(N/2)],  tie = [P == N/2] (N even)

Rows are read as int32 words when their length and addresses allow it (4x fewer ops than bytes), else
as bytes; a program owns a run of words of every row (contiguous, coalesced loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import CFG, LAUNCH, device_fn, dummy, load, store

MAX_PLANES = 16  # N < 65536 ranks


@device_fn
def _add(plane, carry):
    return plane ^ carry, plane & carry


@device_fn
def _compare(gt, eq, plane, half, K: tl.constexpr):
    """One step, from the most significant plane down, of the bit-sliced P > half and P == half."""
    hm = 0 - ((half >> K) & 1)  # all ones where bit K of half is set
    gt = gt | (eq & plane & ~hm)
    eq = eq & ~(plane ^ hm)
    return gt, eq


@device_fn
def _vote_tile(rows_ptr, sign_ptr, nz_ptr, w, N, half, B, HAS_NZ: tl.constexpr, NPL: tl.constexpr,
               BW: tl.constexpr, MASKED: tl.constexpr):
    mask = w < B
    # one variable per bit plane of the count (up to 2**NPL - 1 votes): Triton has no arrays of tensors
    p0 = tl.full([BW], 0, tl.int32)
    p1 = p0
    p2 = p0
    p3 = p0
    p4 = p0
    p5 = p0
    p6 = p0
    p7 = p0
    p8 = p0
    p9 = p0
    p10 = p0
    p11 = p0
    p12 = p0
    p13 = p0
    p14 = p0
    p15 = p0
    row_ptr = rows_ptr  # advanced by B per row: 64-bit pointer arithmetic, no int32 overflow for N*B >= 2**31
    for _ in range(N):
        x = load(row_ptr, w, mask, MASKED).to(tl.int32)
        row_ptr += B
        p0, x = _add(p0, x)
        if NPL > 1:
            p1, x = _add(p1, x)
        if NPL > 2:
            p2, x = _add(p2, x)
        if NPL > 3:
            p3, x = _add(p3, x)
        if NPL > 4:
            p4, x = _add(p4, x)
        if NPL > 5:
            p5, x = _add(p5, x)
        if NPL > 6:
            p6, x = _add(p6, x)
        if NPL > 7:
            p7, x = _add(p7, x)
        if NPL > 8:
            p8, x = _add(p8, x)
        if NPL > 9:
            p9, x = _add(p9, x)
        if NPL > 10:
            p10, x = _add(p10, x)
        if NPL > 11:
            p11, x = _add(p11, x)
        if NPL > 12:
            p12, x = _add(p12, x)
        if NPL > 13:
            p13, x = _add(p13, x)
        if NPL > 14:
            p14, x = _add(p14, x)
        if NPL > 15:
            p15, x = _add(p15, x)
    gt = tl.full([BW], 0, tl.int32)
    eq = ~gt
    if NPL > 15:
        gt, eq = _compare(gt, eq, p15, half, 15)
    if NPL > 14:
        gt, eq = _compare(gt, eq, p14, half, 14)
    if NPL > 13:
        gt, eq = _compare(gt, eq, p13, half, 13)
    if NPL > 12:
        gt, eq = _compare(gt, eq, p12, half, 12)
    if NPL > 11:
        gt, eq = _compare(gt, eq, p11, half, 11)
    if NPL > 10:
        gt, eq = _compare(gt, eq, p10, half, 10)
    if NPL > 9:
        gt, eq = _compare(gt, eq, p9, half, 9)
    if NPL > 8:
        gt, eq = _compare(gt, eq, p8, half, 8)
    if NPL > 7:
        gt, eq = _compare(gt, eq, p7, half, 7)
    if NPL > 6:
        gt, eq = _compare(gt, eq, p6, half, 6)
    if NPL > 5:
        gt, eq = _compare(gt, eq, p5, half, 5)
    if NPL > 4:
        gt, eq = _compare(gt, eq, p4, half, 4)
    if NPL > 3:
        gt, eq = _compare(gt, eq, p3, half, 3)
    if NPL > 2:
        gt, eq = _compare(gt, eq, p2, half, 2)
    if NPL > 1:
        gt, eq = _compare(gt, eq, p1, half, 1)
    gt, eq = _compare(gt, eq, p0, half, 0)
    store(sign_ptr, w, gt.to(sign_ptr.dtype.element_ty), mask, MASKED)
    if HAS_NZ:
        tie = tl.where((N % 2) == 0, eq, 0)  # an odd number of votes never ties
        store(nz_ptr, w, (~tie).to(nz_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def vote_kernel(rows_ptr, sign_ptr, nz_ptr, N, half, B, HAS_NZ: tl.constexpr, NPL: tl.constexpr,
                 BW: tl.constexpr):
    pid = tl.program_id(0)
    w = pid * BW + tl.arange(0, BW)
    if (pid + 1) * BW <= B:
        _vote_tile(rows_ptr, sign_ptr, nz_ptr, w, N, half, B, HAS_NZ, NPL, BW, False)
    else:
        _vote_tile(rows_ptr, sign_ptr, nz_ptr, w, N, half, B, HAS_NZ, NPL, BW, True)


def _as_words(tensors) -> list | None:
    """int32 views of uint8 tensors whose size and address allow it (all or none)."""
    if all(t.numel() % 4 == 0 and t.data_ptr() % 4 == 0 for t in tensors):
        return [t.view(torch.int32) for t in tensors]
    return None


def vote(rows: torch.Tensor, out_sign: torch.Tensor, out_nonzero: torch.Tensor | None = None) -> None:
    """Majority vote over N packed 1-bit rows (N, B): sign bit = 2P > N, not-a-tie bit = 2P != N."""
    N, B = rows.shape
    outs = [t for t in (out_sign, out_nonzero) if t is not None]
    rows = rows.contiguous()
    if rows.dtype != torch.uint8:
        raise ValueError("vote: rows must be an (N, B) uint8 tensor")
    if any(t.numel() != B or not t.is_contiguous() or t.dtype != torch.uint8 for t in outs):
        raise ValueError(f"vote: outputs must be contiguous uint8 tensors of {B} bytes")
    if N < 1 or N >= 1 << MAX_PLANES:
        raise ValueError(f"vote: 1 <= N < {1 << MAX_PLANES} rows, got {N}")
    if B == 0:
        return
    words = _as_words([rows, *outs]) if B % 4 == 0 else None
    if words is not None:
        rows, outs = words[0].view(N, B // 4), words[1:]
        B //= 4
    bw, warps = CFG["vote"]
    has_nz = out_nonzero is not None
    nz = outs[1] if has_nz else dummy(rows.device)
    vote_kernel[(triton.cdiv(B, bw),)](rows, outs[0], nz, N, N // 2, B, HAS_NZ=has_nz, NPL=N.bit_length(), BW=bw,
                                        **LAUNCH, num_warps=warps)
