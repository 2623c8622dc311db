"""Plain-torch codecs: lioncub's CPU path and the oracle the Triton kernels are tested against.

All functions work on flat 1-D buckets. Conventions shared with the Triton kernels:

* Lion direction `c = beta1*m + (1-beta1)*g`, computed in fp32 (`torch.mul(m, b1).add_(g, alpha=1-b1)`,
  the op order of the reference Lion implementations, so world size 1 reproduces them bit for bit).
* Momentum `m <- beta2*m + (1-beta2)*g` is updated in the same pass that quantizes.
* Bits are packed little-endian: element `8*i + j` is bit `j` of byte `i`.
* 1-bit votes: bit = 1 for c > 0, 0 for c < 0. A rank cannot abstain in 1 bit, so where c == 0 it votes
  `+` iff `(index + rank + step)` is even (`zero_parity = (rank + step) % 2`). With an even number of
  ranks an all-zero coordinate is then an exact tie (no update); with an odd number it moves by +-lr,
  alternating in sign from step to step, so it does not drift.
* p-bit fields follow `lioncub.wire.FieldLayout` (planar layout: element i in word i % W, field i // W).
* L1 levels: per parameter tensor t, `mult_t = float32((s/2) / mean|c_t|)` computed in float64
  (0 where mean|c_t| == 0), then `q = clamp(rint(c * mult_t), -s, s)` in fp32 (rint: half to even).
"""

from __future__ import annotations

import torch

from lioncub.wire import FieldLayout

PACK_MAGIC = 0x0102040810204080  # (8 bytes of 0/1 as an int64) * PACK_MAGIC >> 56 == the packed byte
ZERO_VOTE_PATTERN = (0x55, 0xAA)  # bits set at even / odd element indices
_LUT: dict[torch.device, torch.Tensor] = {}


def _unpack_lut(device: torch.device) -> torch.Tensor:
    """256 int64 words; word b holds the 8 bits of byte b as 8 bytes of 0/1 (little-endian)."""
    lut = _LUT.get(device)
    if lut is None:
        b = torch.arange(256, dtype=torch.int64)
        bits = ((b[:, None] >> torch.arange(8)) & 1).to(torch.uint8)
        lut = _LUT[device] = bits.contiguous().view(torch.int64).reshape(256).to(device)
    return lut


# --- bit packing -------------------------------------------------------------------------------------


def pack_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bool or 0/1 uint8 tensor with numel % 8 == 0 -> uint8 tensor of numel/8 bytes."""
    if bits.numel() % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 elements, got {bits.numel()}")
    if bits.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=bits.device) if out is None else out
    words = bits.contiguous().view(torch.uint8).view(torch.int64)
    packed = ((words * PACK_MAGIC) >> 56).bitwise_and_(0xFF)
    if out is None:
        return packed.to(torch.uint8)
    return out.copy_(packed)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 tensor of B bytes -> uint8 tensor of 8*B elements, each 0 or 1."""
    lut = _unpack_lut(packed.device)
    return lut[packed.to(torch.int32)].view(torch.uint8)


# --- p-bit integer fields ----------------------------------------------------------------------------


def pack_fields(values: torch.Tensor, layout: FieldLayout, out: torch.Tensor) -> torch.Tensor:
    """Pack non-negative integers (each <= layout.max_value) into `out` (layout.words(n) words)."""
    n, W = values.numel(), out.numel()
    if W * layout.per_word < n:
        raise ValueError(f"{W} words of {layout.per_word} fields cannot hold {n} values")
    out.zero_()
    for j in range(layout.per_word):
        part = values[j * W : (j + 1) * W]
        if part.numel() == 0:
            break
        out[: part.numel()].add_(part.to(out.dtype) << (layout.width * j))
    return out


def unpack_fields(words: torch.Tensor, layout: FieldLayout, n: int) -> torch.Tensor:
    """Summed words -> int32 per-element sums (the first n elements)."""
    W, mask = words.numel(), (1 << layout.width) - 1
    out = torch.empty(W * layout.per_word, dtype=torch.int32, device=words.device)
    for j in range(layout.per_word):
        out[j * W : (j + 1) * W] = (words >> (layout.width * j)).bitwise_and_(mask)
    return out[:n]


# --- Lion arithmetic ---------------------------------------------------------------------------------


def lion_direction(g: torch.Tensor, m: torch.Tensor, beta1: float) -> torch.Tensor:
    """c = beta1*m + (1-beta1)*g in fp32."""
    if g.dtype == torch.float32 and m.dtype == torch.float32:
        return torch.mul(m, beta1).add_(g, alpha=1 - beta1)
    return m.float().mul_(beta1).add_(g.float(), alpha=1 - beta1)


def momentum_update_(m: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    if m.dtype == torch.float32 and g.dtype == torch.float32:
        m.mul_(beta2).add_(g, alpha=1 - beta2)
    else:
        m.copy_(m.float().mul_(beta2).add_(g.float(), alpha=1 - beta2))


def apply_update_(p: torch.Tensor, update: torch.Tensor, lr: float, wd: float) -> None:
    """p <- p*(1 - lr*wd) - lr*U, math in fp32."""
    if p.dtype == torch.float32:
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(update, alpha=-lr)
    else:
        p32 = p.float()
        if wd:
            p32.mul_(1 - lr * wd)
        p.copy_(p32.add_(update, alpha=-lr))


def lion_step(p, g, m, *, lr: float, wd: float, beta1: float, beta2: float) -> None:
    """One plain Lion step (no communication): the world-size-1 path."""
    update = lion_direction(g, m, beta1).sign_()
    apply_update_(p, update, lr, wd)
    momentum_update_(m, g, beta2)


# --- the compressed step: pre-pass, quantize-and-pack, vote, unpack-and-apply ---------------------------


def segment_sums_abs(c: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 sums of |c| over each segment [offsets[i], offsets[i+1])."""
    a = c.abs()
    return torch.stack([a[s:e].sum(dtype=torch.float64) for s, e in zip(offsets[:-1], offsets[1:])])


def l1_multipliers(sums: torch.Tensor, offsets: list[int], levels: int) -> torch.Tensor:
    """mult_t = (s/2) / mean|c_t| as fp32, 0 where the mean is 0 (or the sum is not finite)."""
    numel = torch.tensor([e - s for s, e in zip(offsets[:-1], offsets[1:])], dtype=torch.float64)
    mean = sums.cpu() / numel
    ok = (mean > 0) & torch.isfinite(mean)
    mult = torch.where(ok, (levels / 2) / torch.where(ok, mean, 1.0), 0.0)
    return mult.float().to(sums.device)


def prepass(method: str, g, m, *, beta1: float, offsets: list[int], levels: int = 0):
    """Read-only pass before the step: (is every gradient finite, L1 multipliers or None)."""
    if method == "l1-pbit":
        sums = segment_sums_abs(lion_direction(g, m, beta1), offsets)
        return bool(torch.isfinite(sums).all()), l1_multipliers(sums, offsets, levels)
    return bool(torch.isfinite(g).all()), None


def l1_levels(c: torch.Tensor, mult: torch.Tensor, offsets: list[int], levels: int) -> torch.Tensor:
    lengths = torch.tensor([e - s for s, e in zip(offsets[:-1], offsets[1:])], device=c.device)
    scale = torch.repeat_interleave(mult, lengths)
    return c.mul_(scale).round_().clamp_(-levels, levels)


def quantize_pack(method: str, g, m, out: torch.Tensor, *, beta1: float, beta2: float,
                  zero_parity: int = 0, layout: FieldLayout | None = None,
                  mult: torch.Tensor | None = None, offsets: list[int] | None = None,
                  levels: int = 0) -> torch.Tensor:
    """Form c, write the method's packed code into `out`, update m in place (one pass on a GPU).

    1-bit methods: `out` is uint8 with 8*out.numel() >= n bits (padding bits are unspecified).
    p-bit methods: `out` holds layout.words(n) words of layout.dtype.
    """
    n = g.numel()
    c = lion_direction(g, m, beta1)
    momentum_update_(m, g, beta2)
    if method in ("vote-1bit", "vote-allgather"):
        n_pad = out.numel() * 8
        pos = torch.zeros(n_pad, dtype=torch.bool, device=g.device)
        zero = torch.zeros(n_pad, dtype=torch.bool, device=g.device)
        torch.gt(c, 0, out=pos[:n])
        torch.eq(c, 0, out=zero[:n])
        packed = pack_bits(pos, out)
        return packed.bitwise_or_(pack_bits(zero).bitwise_and_(ZERO_VOTE_PATTERN[zero_parity]))
    if method in ("vote-pbit", "avg-pbit"):
        values = (c > 0).to(torch.uint8).add_(c >= 0)  # sign(c) + 1, in {0, 1, 2}
    elif method == "l1-pbit":
        values = l1_levels(c, mult, offsets, levels).add_(levels).to(torch.int32)
    else:
        raise ValueError(f"quantize_pack: method {method!r} has no code")
    return pack_fields(values, layout, out)


def vote(rows: torch.Tensor, out_sign: torch.Tensor, out_nonzero: torch.Tensor | None = None) -> None:
    """Majority vote over N packed 1-bit rows (N, B): per bit position count the + votes P and write
    sign bit (2P > N) and, when out_nonzero is given, the not-a-tie bit (2P != N)."""
    N = rows.shape[0]
    bits = unpack_bits(rows.reshape(-1)).view(N, -1)
    twice = bits.sum(0, dtype=torch.int32).mul_(2)
    pack_bits(twice > N, out_sign)
    if out_nonzero is not None:
        pack_bits(twice != N, out_nonzero)


def decode_update(method: str, code, n: int, *, world_size: int, levels: int = 0,
                  layout: FieldLayout | None = None) -> torch.Tensor:
    """The agreed update U (fp32) from the agreed code."""
    N = world_size
    if method in ("vote-1bit", "vote-allgather"):
        sign_plane, nonzero_plane = code
        update = unpack_bits(sign_plane)[:n].float().mul_(2).sub_(1)
        if nonzero_plane is not None:
            update.mul_(unpack_bits(nonzero_plane)[:n])
        return update
    sums = unpack_fields(code, layout, n)
    if method == "vote-pbit":
        return sums.sub_(N).sign_().float()
    if method == "avg-pbit":
        return sums.sub_(N).float().div_(N)
    if method == "l1-pbit":
        return sums.sub_(N * levels).sign_().float()
    raise ValueError(f"decode_update: unknown method {method!r}")


def unpack_apply(method: str, p, code, *, lr: float, wd: float, world_size: int, levels: int = 0,
                 layout: FieldLayout | None = None) -> None:
    """Decode the agreed code and apply p <- p*(1 - lr*wd) - lr*U (one pass on a GPU)."""
    update = decode_update(method, code, p.numel(), world_size=world_size, levels=levels, layout=layout)
    apply_update_(p, update, lr, wd)
