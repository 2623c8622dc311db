"""Unpack-and-apply: from the agreed code, U per element and p <- p*(1 - lr*wd) - lr*U, in one pass.

1-bit code (sign plane, optional not-a-tie plane): a program owns BYTES bytes of each plane and the
8*BYTES parameters they cover, as a [BYTES, 8] tile; U = +1 where the sign bit is set, -1 where not,
and 0 where the not-a-tie bit is clear.
p-bit code (summed words, planar fields as in quantize_pack): for each field j the program reads the BW
consecutive parameters jW + w; f = (word >> width*j) & (2**width - 1) is the sum over ranks, and
    vote-pbit  U = sign(f - N)         (each rank sent sign(c) + 1)
    avg-pbit   U = (f - N) / N         (divided in fp64, rounded once to fp32, as the twin's table)
    l1-pbit    U = sign(f - N*s)       (each rank sent q + s)
Math is in fp32 whatever the parameter dtype, with one rounding at the store.
With `momentum=(g, m, beta2)` the same pass also updates m <- beta2*m + (1-beta2)*g (the overlapped step
defers it to here, after every rank has agreed to take the step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    CFG,
    LAUNCH,
    apply_update,
    check_flat,
    device_fn,
    dummy,
    emulate_bf16,
    field_codec_id,
    load,
    momentum,
    store,
    to_dtype,
)
from .triton_quantize import field_words_per_program


@device_fn
def _momentum_tile(g_ptr, m_ptr, i, mask, beta2, omb2, MASKED: tl.constexpr, EMU: tl.constexpr):
    g = load(g_ptr, i, mask, MASKED).to(tl.float32)
    m = load(m_ptr, i, mask, MASKED).to(tl.float32)
    store(m_ptr, i, to_dtype(momentum(g, m, beta2, omb2), m_ptr.dtype.element_ty, EMU), mask, MASKED)


@device_fn
def _onebit_tile(p_ptr, s_ptr, z_ptr, g_ptr, m_ptr, rows, n, nb, decay, neg_lr, beta2, omb2, HAS_Z: tl.constexpr,
                 HAS_M: tl.constexpr, MASKED: tl.constexpr, EMU: tl.constexpr):
    j = tl.arange(0, 8)
    i = rows[:, None] * 8 + j[None, :]
    mask = i < n
    rmask = rows < nb
    sb = load(s_ptr, rows, rmask, MASKED).to(tl.int32)
    u = tl.where(((sb[:, None] >> j[None, :]) & 1) != 0, 1.0, -1.0)
    if HAS_Z:
        zb = load(z_ptr, rows, rmask, MASKED).to(tl.int32)
        u = tl.where(((zb[:, None] >> j[None, :]) & 1) != 0, u, 0.0)
    p = load(p_ptr, i, mask, MASKED).to(tl.float32)
    store(p_ptr, i, to_dtype(apply_update(p, u, decay, neg_lr), p_ptr.dtype.element_ty, EMU), mask, MASKED)
    if HAS_M:
        _momentum_tile(g_ptr, m_ptr, i, mask, beta2, omb2, MASKED, EMU)


@triton.jit
def onebit_kernel(p_ptr, s_ptr, z_ptr, g_ptr, m_ptr, n, nb, decay, neg_lr, beta2, omb2, HAS_Z: tl.constexpr,
                   HAS_M: tl.constexpr, BYTES: tl.constexpr, EMU: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BYTES + tl.arange(0, BYTES)
    if (pid + 1) * BYTES * 8 <= n:
        _onebit_tile(p_ptr, s_ptr, z_ptr, g_ptr, m_ptr, rows, n, nb, decay, neg_lr, beta2, omb2, HAS_Z, HAS_M,
                     False, EMU)
    else:
        _onebit_tile(p_ptr, s_ptr, z_ptr, g_ptr, m_ptr, rows, n, nb, decay, neg_lr, beta2, omb2, HAS_Z, HAS_M,
                     True, EMU)


@device_fn
def _fields_tile(p_ptr, code_ptr, g_ptr, m_ptr, w, n, W, decay, neg_lr, world, world_f, offset, beta2, omb2,
                 CODEC: tl.constexpr, WIDTH: tl.constexpr, FIELDS: tl.constexpr, WIDE: tl.constexpr,
                 HAS_M: tl.constexpr, MASKED: tl.constexpr, EMU: tl.constexpr):
    word = load(code_ptr, w, w < W, MASKED)
    word = word.to(tl.int64) if WIDE else word.to(tl.int32)
    for j in tl.static_range(FIELDS):
        i = j * W + w
        mask = (w < W) & (i < n)
        f = (word >> (WIDTH * j)) & ((1 << WIDTH) - 1)
        if CODEC == 2:  # mean of the votes
            u = ((f - world).to(tl.float64) / world_f).to(tl.float32)  # fp64 / (fp32 N, exact) in fp64
        else:
            u = tl.where(f > offset, 1.0, tl.where(f < offset, -1.0, 0.0))
        p = load(p_ptr, i, mask, MASKED).to(tl.float32)
        store(p_ptr, i, to_dtype(apply_update(p, u, decay, neg_lr), p_ptr.dtype.element_ty, EMU), mask, MASKED)
        if HAS_M:
            _momentum_tile(g_ptr, m_ptr, i, mask, beta2, omb2, MASKED, EMU)


@triton.jit
def fields_kernel(p_ptr, code_ptr, g_ptr, m_ptr, n, W, decay, neg_lr, world, world_f, offset, beta2, omb2,
                   CODEC: tl.constexpr, WIDTH: tl.constexpr, FIELDS: tl.constexpr, WIDE: tl.constexpr,
                   HAS_M: tl.constexpr, BW: tl.constexpr, EMU: tl.constexpr):
    pid = tl.program_id(0)
    w = pid * BW + tl.arange(0, BW)
    end = (pid + 1) * BW
    if (end <= W) & ((FIELDS - 1) * W + end <= n):
        _fields_tile(p_ptr, code_ptr, g_ptr, m_ptr, w, n, W, decay, neg_lr, world, world_f, offset, beta2, omb2,
                     CODEC, WIDTH, FIELDS, WIDE, HAS_M, False, EMU)
    else:
        _fields_tile(p_ptr, code_ptr, g_ptr, m_ptr, w, n, W, decay, neg_lr, world, world_f, offset, beta2, omb2,
                     CODEC, WIDTH, FIELDS, WIDE, HAS_M, True, EMU)


def unpack_apply(codec, p, code, *, lr: float, wd: float, world_size: int, levels: int = 0,
                 layout=None, momentum=None) -> None:
    """Decode the agreed code and apply p <- p*(1 - lr*wd) - lr*U (and, with momentum=(g, m, beta2), the
    momentum update): one launch, one pass."""
    n = check_flat(p)
    if n == 0:
        return
    decay, neg_lr = float(1 - lr * wd), float(-lr)
    has_m = momentum is not None
    g, m, beta2 = momentum if has_m else (dummy(p.device), dummy(p.device), 0.0)
    if has_m:
        check_flat(p, g, m)
    mom = (g, m)
    if codec.kind == "signs":
        sign_plane, nonzero_plane = code
        nb = triton.cdiv(n, 8)
        # a plane gathered from an all-gather may be a strided view (N chunks of one byte): make it dense
        sign_plane = sign_plane.reshape(-1).contiguous()
        nonzero_plane = None if nonzero_plane is None else nonzero_plane.reshape(-1).contiguous()
        planes = [t for t in (sign_plane, nonzero_plane) if t is not None]
        if any(t.numel() < nb or t.dtype != torch.uint8 for t in planes):
            raise ValueError(f"unpack_apply: 1-bit planes must be uint8 of at least {nb} bytes")
        rows, warps = CFG["onebit"]
        has_z = nonzero_plane is not None
        onebit_kernel[(triton.cdiv(nb, rows),)](
            p, sign_plane, nonzero_plane if has_z else dummy(p.device), *mom, n, nb, decay, neg_lr, float(beta2),
            float(1 - beta2), HAS_Z=has_z, HAS_M=has_m, BYTES=rows, EMU=emulate_bf16(), **LAUNCH, num_warps=warps)
        return
    codec_id = field_codec_id(codec)
    code = code.reshape(-1).contiguous()
    W, F = code.numel(), layout.per_word
    if W * F < n:
        raise ValueError(f"unpack_apply: {W} words of {F} fields cannot hold {n} values")
    offset = codec.offset(world_size, levels)
    bw = field_words_per_program(F)
    fields_kernel[(triton.cdiv(W, bw),)](
        p, code, *mom, n, W, decay, neg_lr, int(world_size), float(world_size), int(offset), float(beta2),
        float(1 - beta2), CODEC=codec_id, WIDTH=layout.width, FIELDS=F, WIDE=layout.word_bits == 64, HAS_M=has_m,
        BW=bw, EMU=emulate_bf16(),
        **LAUNCH, num_warps=CFG["fields"][1])
