"""Shared pieces of lioncub's Triton kernels: tile sizes, the Lion arithmetic as @triton.jit helpers,
argument checks and the small per-bucket tables the kernels read.

Every kernel is one pass over the bucket: tiles are contiguous runs of elements, so loads and stores are
coalesced, and a tile that lies wholly inside the bucket takes an unmasked path that Triton vectorises
(128-bit accesses when the base pointer is 16-byte aligned). Only the last tile of a bucket (or of a
p-bit field plane, or of a parameter tensor in the L1 reduction) takes the masked path.

Arithmetic matches the torch twins (`lioncub.kernels.reference`) operation by operation, so that under
the interpreter the results are bit-identical and on a GPU they differ at most where a value sits at a
rounding boundary:
  c = fma(g, 1-b1, m*b1)       torch's `mul(m, b1).add_(g, alpha=1-b1)` (one rounding for the add)
  m' = fma(g, 1-b2, m*b2)      torch's `m.mul_(b2).add_(g, alpha=1-b2)`
  p' = fma(U, -lr, p*decay)    torch's `p.mul_(1-lr*wd).add_(U, alpha=-lr)`, decay = 1-lr*wd in fp64
Scalars are converted to fp32 on the host exactly as torch converts them (double -> float, RNE).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from . import triton_interpreter

# Tile sizes and warps per program. Chosen for an H100 (memory-bound kernels: 8-16 fp32 per thread, enough
# bytes in flight per SM to cover HBM latency); tests shrink them to exercise many tiles at small sizes.
CFG = {
    "lion": (2048, 8),  # elements per program, warps
    "finite": (4096, 8),  # elements per program, warps
    "l1_sum": (4096, 8),  # elements per program (tiles of the uniform grid, split at tensor edges), warps
    "combine": 256,  # partial sums per loop iteration of the fp64 segment combine
    "onebit": (256, 8),  # packed bytes (8 elements each) per program, warps
    "fields": (2048, 8),  # elements per program for p-bit fields (words = this / fields per word), warps
    "vote": (1024, 4),  # words (int32, or bytes when rows are not 4-byte aligned) per program, warps
}

# Launch options: no contraction of a*b + c into an fma behind our back. The kernels spell out every fma
# they mean (the ones torch's CPU kernels perform), so GPU, interpreter and torch twin round alike.
LAUNCH = {"enable_fp_fusion": False}

# Element offsets are int32 inside the kernels.
MAX_ELEMENTS = 2**31 - 2**22
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite float32

# The field codecs compiled into the kernels (constexpr CODEC), by (values, decode) of lioncub.comm.wire.Codec.
FIELD_CODECS = {("vote", "sign"): 1, ("vote", "mean"): 2, ("l1", "sign"): 3}


def field_codec_id(codec) -> int:
    key = (codec.values, codec.decode)
    if codec.kind != "fields" or key not in FIELD_CODECS:
        raise ValueError(f"no field kernels for codec {codec}")
    return FIELD_CODECS[key]


# Older Triton interpreters (tests under TRITON_INTERPRET=1) are patched on import: triton_interpreter.py.
INTERPRETER_PATCHES = triton_interpreter.INTERPRETER_PATCHES


# --- device functions -------------------------------------------------------------------------------------


def device_fn(fn):
    """@triton.jit for the device functions the kernels call. Under the interpreter they stay plain Python:
    the interpreter re-patches triton.language on every call of a jit function (about a millisecond), which
    made the interpreted tests ten times slower. The code that runs is the same either way."""
    return fn if triton.knobs.runtime.interpret else triton.jit(fn)



@device_fn
def load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs)


@device_fn
def store(ptr, offs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=mask)
    else:
        tl.store(ptr + offs, value)


@device_fn
def to_dtype(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 -> the parameter dtype, rounding to nearest even. On a GPU this is the native conversion; the
    interpreter truncates fp32 -> bf16, so under it (EMULATE_BF16) the rounding is done on the bits."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton_interpreter.runs_as_sum
@triton.jit
def add(a, b):
    """The combine function of `total`: tl.sum's (which Triton keeps private), the same a + b."""
    return a + b


@device_fn
def nonfinite(x):
    """1 where x is inf or NaN (NaN compares false), else 0, as int32."""
    return tl.where(tl.abs(x) <= FP32_MAX, 0, 1)


@device_fn
def total(x, axis: tl.constexpr):
    """tl.sum, spelled as the tl.reduce it expands to. tl.sum and tl.zeros are @triton.jit functions of
    triton.language; if triton was imported before TRITON_INTERPRET=1 was set (torch._dynamo imports it,
    e.g. in a forkserver), the interpreter cannot call them. So the kernels use only builtins (tl.full,
    tl.reduce, ...) and jit functions of their own; the interpreter runs this reduce as np.sum."""
    return tl.reduce(x, axis, add)


@device_fn
def lion_direction(g, m, beta1, omb1):
    """c = beta1*m + (1-beta1)*g in fp32 (g, m already fp32)."""
    return tl.fma(g, omb1, m * beta1)


@device_fn
def momentum(g, m, beta2, omb2):
    """m' = beta2*m + (1-beta2)*g in fp32."""
    return tl.fma(g, omb2, m * beta2)


@device_fn
def apply_update(p, u, decay, neg_lr):
    """p' = p*(1 - lr*wd) - lr*U in fp32."""
    return tl.fma(u, neg_lr, p * decay)


@device_fn
def sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


@device_fn
def rint(x):
    """Round half to even (fp32), exact for every x: below 2**23 in magnitude, adding and subtracting 2**23
    leaves the nearest integer under IEEE round-to-nearest-even; above it every float is an integer."""
    ax = tl.abs(x)
    r = (ax + 8388608.0) - 8388608.0
    r = tl.where(x < 0, -r, r)
    return tl.where(ax < 8388608.0, r, x)


# --- host-side checks and tables ---------------------------------------------------------------------------


def emulate_bf16() -> bool:
    """Whether kernels run under the Triton interpreter (which truncates fp32 -> bf16)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_flat(*tensors: torch.Tensor) -> int:
    """All tensors 1-D contiguous of one length on one device; returns that length."""
    n = tensors[0].numel()
    for t in tensors:
        if not t.is_contiguous() or t.numel() != n or t.device != tensors[0].device:
            raise ValueError("lioncub Triton kernels work on contiguous flat buckets of one length and device")
    if n > MAX_ELEMENTS:
        raise ValueError(f"bucket of {n} elements is too large for the Triton kernels (max {MAX_ELEMENTS}); "
                         "use a smaller bucket_mb")
    return n


def check_offsets(offsets, n: int) -> np.ndarray:
    off = np.asarray(offsets, dtype=np.int64)
    if off.ndim != 1 or off.size < 2 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
        raise ValueError(f"offsets must rise from 0 to the bucket length {n}, got {list(offsets)[:8]}...")
    return off


_TABLES: dict = {}


def cached(key, build):
    """Small per-bucket tables (device tensors), built once: buckets keep their layout for the whole run."""
    if key not in _TABLES:
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[key] = build()
    return _TABLES[key]


def dummy(device) -> torch.Tensor:
    """A stand-in for a pointer argument that the specialised kernel does not read."""
    return cached(("dummy", str(device)), lambda: torch.zeros(16, dtype=torch.uint8, device=device))


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()
