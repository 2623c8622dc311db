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
* p-bit fields follow `lioncub.comm.wire.FieldLayout` (planar layout: element i in word i % W, field i // W).
* L1 levels: per parameter tensor t, `mult_t = float32((s/2) / mean|c_t|)` computed in float64
  (0 where mean|c_t| == 0), then `q = clamp(rint(c * mult_t), -s, s)` in fp32 (rint: half to even).

Large temporaries come from a per-device, per-thread scratch pool: a fresh multi-MB tensor costs a page fault per
4 KiB on first touch, which on a CPU costs more than the arithmetic.
"""

from __future__ import annotations

import threading

import torch

from lioncub.comm.wire import Codec, FieldLayout

PACK_MAGIC = 0x0102040810204080  # (8 bytes of 0/1 as an int64) * PACK_MAGIC >> 56 == the packed byte
_CACHE: dict = {}
# each thread's own scratch buffers: a communication thread's codec (lioncub.optim.local's streaming) runs while the
# main thread's Lion steps use theirs
_THREAD = threading.local()


def scratch(slot: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A reusable 1-D buffer of at least n elements (contents unspecified), this thread's. One buffer per slot
    name: two values that are alive at once must use different slots."""
    cache = getattr(_THREAD, "scratch", None)
    if cache is None:
        cache = _THREAD.scratch = {}
    key = (slot, dtype, torch.device(device))
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = cache[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


PIECE = 1 << 18  # elements per piece on a CPU: a piece's p, g, m and c stay in cache across a step's passes


def pieces(n: int, bounds: list[int] | None = None, device=None):
    """(segment index, start, end) pieces of [0, n): at most PIECE elements on a CPU (one piece on a GPU),
    starting on multiples of 64 inside a segment, never crossing a boundary in `bounds`."""
    bounds = bounds or [0, n]
    size = PIECE if device is None or torch.device(device).type == "cpu" else n
    for seg, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        s = a
        while s < b:
            e = min(b, (s // 64) * 64 + size)
            yield seg, s, e
            s = e


def _table(name, device, build):
    key = ("table", name, torch.device(device))
    if key not in _CACHE:
        _CACHE[key] = build().to(device)
    return _CACHE[key]


def _bit_table(kind: str, device) -> torch.Tensor:
    """256 rows: the 8 bits of byte b, as int64 of 8 0/1 bytes ('bytes'), or 8 fp32 +-1 ('sign') / 0-1."""
    def build():
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        if kind == "bytes":
            return bits.to(torch.uint8).contiguous().view(torch.int64).reshape(256)
        return (bits * 2 - 1).float() if kind == "sign" else bits.float()
    return _table(f"bits-{kind}", device, build)


# --- bit packing -------------------------------------------------------------------------------------


def pack_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bool or 0/1 uint8 tensor with numel % 8 == 0 -> uint8 tensor of numel/8 bytes."""
    n = bits.numel()
    if n % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 elements, got {n}")
    if out is None:
        out = torch.empty(n // 8, dtype=torch.uint8, device=bits.device)
    if n == 0:
        return out
    words = bits.contiguous().view(torch.uint8).view(torch.int64)
    tmp = torch.mul(words, PACK_MAGIC, out=scratch("pack", n // 8, torch.int64, bits.device))
    return out.copy_(tmp.bitwise_right_shift_(56))  # the cast to uint8 keeps the low byte


def unpack_bits(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 tensor of B bytes -> uint8 tensor of 8*B elements, each 0 or 1."""
    table = _bit_table("bytes", packed.device)
    if out is None:
        out = torch.empty(8 * packed.numel(), dtype=torch.uint8, device=packed.device)
    torch.index_select(table, 0, packed.to(torch.int32), out=out.view(torch.int64))
    return out


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
        if j == 0:
            out[: part.numel()].copy_(part)
        else:
            shifted = scratch("fields", part.numel(), out.dtype, out.device).copy_(part)
            out[: part.numel()].add_(shifted.bitwise_left_shift_(layout.width * j))
    return out


def _fields(words: torch.Tensor, layout: FieldLayout):
    """Yield (j, field j of every word) as integer tensors (views into scratch)."""
    mask = (1 << layout.width) - 1
    for j in range(layout.per_word):
        if layout.per_word == 1:
            yield j, words
            continue
        f = scratch("unfield", words.numel(), words.dtype, words.device)
        torch.bitwise_right_shift(words, layout.width * j, out=f)
        yield j, f.bitwise_and_(mask)


def unpack_fields(words: torch.Tensor, layout: FieldLayout, n: int) -> torch.Tensor:
    """Summed words -> int32 per-element sums (the first n elements)."""
    W = words.numel()
    out = torch.empty(W * layout.per_word, dtype=torch.int32, device=words.device)
    for j, f in _fields(words, layout):
        out[j * W : (j + 1) * W] = f
    return out[:n]


# --- Lion arithmetic ---------------------------------------------------------------------------------


def lion_direction(g: torch.Tensor, m: torch.Tensor, beta1: float, out: torch.Tensor | None = None):
    """c = beta1*m + (1-beta1)*g in fp32."""
    if g.dtype == torch.float32 and m.dtype == torch.float32:
        return torch.mul(m, beta1, out=out).add_(g, alpha=1 - beta1)
    c = m.float() if out is None else out.copy_(m)
    return c.mul_(beta1).add_(g.float(), alpha=1 - beta1)


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


def lion_step(p, g, m, *, lr: float, wd: float, beta1: float, beta2: float, skip=None) -> None:
    """One plain Lion step (no communication): the world-size-1 path. `skip`: a 0-dim int tensor (nonzero_flag's)
    that, when nonzero, leaves p and m as they are."""
    if skip is not None and bool(skip):
        return
    for _, s, e in pieces(p.numel(), device=p.device):
        update = lion_direction(g[s:e], m[s:e], beta1, scratch("c", e - s, torch.float32, g.device)).sign_()
        apply_update_(p[s:e], update, lr, wd)
        momentum_update_(m[s:e], g[s:e], beta2)


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on t's device, no host sync: one read pass, and a sum is finite iff every element
    is (a sum that overflows float32 also says no)."""
    return torch.isfinite(t.sum(dtype=torch.float32))


def nonfinite_flag(flags) -> torch.Tensor:
    """A 0-dim int32 tensor on the flags' device, 1 where one of the 0-dim "all finite" `flags` (finite_flag's)
    is false: no host sync."""
    return torch.stack(list(flags)).all().logical_not().to(torch.int32)


def all_finite(tensors) -> bool:
    """Whether every tensor of the sequence is all finite: one host sync in all."""
    return not tensors or bool(torch.stack([finite_flag(t) for t in tensors]).all())


# --- the compressed step: pre-pass, quantize-and-pack, vote, unpack-and-apply ---------------------------


_SUM_CHUNK = 1 << 14


def _sum_abs(c: torch.Tensor) -> torch.Tensor:
    """float64 sum of |c|: fp32 sums of 16K-element chunks (accurate to ~1e-7 and vectorised), combined in
    fp64 (a direct fp64 sum of fp32 data is ~50x slower)."""
    a = torch.abs(c, out=scratch("abs", c.numel(), c.dtype, c.device))
    k = a.numel() // _SUM_CHUNK
    main = a[: k * _SUM_CHUNK].view(k, _SUM_CHUNK).sum(1).double().sum() if k else 0.0
    return a[k * _SUM_CHUNK :].sum().double() + main


def segment_sums_abs(c: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 sums of |c| over each segment [offsets[i], offsets[i+1])."""
    sums = torch.zeros(len(offsets) - 1, dtype=torch.float64, device=c.device)
    for seg, s, e in pieces(c.numel(), offsets, c.device):
        sums[seg] += _sum_abs(c[s:e])
    return sums


def l1_multipliers(sums: torch.Tensor, offsets: list[int], levels: int) -> torch.Tensor:
    """mult_t = (s/2) / mean|c_t| as fp32, 0 where the mean is 0 (or the sum is not finite)."""
    sizes = tuple(e - s for s, e in zip(offsets[:-1], offsets[1:]))
    numel = _table(("numel", sizes), sums.device, lambda: torch.tensor(sizes, dtype=torch.float64))
    mean = sums / numel  # on sums' device: IEEE float64 division, the same bits anywhere, and no host sync
    ok = (mean > 0) & torch.isfinite(mean)
    mult = torch.where(ok, (levels / 2) / torch.where(ok, mean, 1.0), 0.0)
    return mult.float()


def prepass(codec: Codec, g, m, *, beta1: float, offsets: list[int], levels: int = 0):
    """Read-only pass before the step: (whether every gradient is finite, as a 0-dim bool tensor on g's
    device; L1 multipliers or None). Nothing waits for the device: the caller syncs once per step."""
    if codec.l1:
        sums = torch.zeros(len(offsets) - 1, dtype=torch.float64, device=g.device)
        for seg, s, e in pieces(g.numel(), offsets, g.device):
            c = lion_direction(g[s:e], m[s:e], beta1, scratch("c", e - s, torch.float32, g.device))
            sums[seg] += _sum_abs(c)
        return torch.isfinite(sums).all(), l1_multipliers(sums, offsets, levels)
    return finite_flag(g), None


def l1_levels(c: torch.Tensor, mult: torch.Tensor, offsets: list[int], levels: int) -> torch.Tensor:
    """q = clamp(rint(c * mult_t), -s, s), in place in c."""
    for k, s, e in zip(mult.tolist(), offsets[:-1], offsets[1:]):
        c[s:e].mul_(k)
    return c.round_().clamp_(-levels, levels)


def quantize_pack(codec: Codec, g, m, out: torch.Tensor, *, beta1: float, beta2: float,
                  zero_parity: int = 0, layout: FieldLayout | None = None,
                  mult: torch.Tensor | None = None, offsets: list[int] | None = None,
                  levels: int = 0, update_momentum: bool = True) -> torch.Tensor:
    """Form c, write the codec's packed code into `out`, update m in place unless update_momentum is False
    (one pass on a GPU).

    "signs": `out` is uint8 with 8*out.numel() >= n bits (padding bits are unspecified).
    "fields": `out` holds layout.words(n) words of layout.dtype.
    """
    _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum, None)
    return out


def quantize_pack_checked(codec: Codec, g, m, out: torch.Tensor, *, beta1: float, beta2: float,
                          zero_parity: int = 0, layout: FieldLayout | None = None,
                          mult: torch.Tensor | None = None, offsets: list[int] | None = None,
                          levels: int = 0, update_momentum: bool = True) -> torch.Tensor:
    """quantize_pack, returning whether every element of g is finite (a 0-dim bool tensor on g's device),
    checked piece by piece while each piece of g is in cache."""
    flags: list = []
    _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum, flags)
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=g.device)


def _quantize(codec, g, m, out, beta1, beta2, zero_parity, layout, mult, offsets, levels, update_momentum,
              flags: list | None) -> None:
    """quantize_pack's pieces; `flags`, if a list, gets each piece's "g all finite" flag."""
    n, dev = g.numel(), g.device
    if codec.kind == "signs":
        for _, s, e in pieces(n, device=dev):  # starts are multiples of 64: whole bytes, same index parity
            if flags is not None:
                flags.append(finite_flag(g[s:e]))
            c = lion_direction(g[s:e], m[s:e], beta1, scratch("c", e - s, torch.float32, dev))
            if update_momentum:
                momentum_update_(m[s:e], g[s:e], beta2)
            pack_signs(c, out[s // 8 : e // 8 if e < n else out.numel()], zero_parity)
        return
    _check_fields(codec)
    values = scratch("values", n, torch.float32, dev)
    scales = mult.tolist() if codec.l1 else None
    for seg, s, e in pieces(n, offsets if scales else None, dev):
        if flags is not None:
            flags.append(finite_flag(g[s:e]))
        c = lion_direction(g[s:e], m[s:e], beta1, values[s:e])
        if update_momentum:
            momentum_update_(m[s:e], g[s:e], beta2)
        if scales is None:
            c.sign_().add_(1)  # sign(c) + 1, in {0, 1, 2}
        else:
            c.mul_(scales[seg]).round_().clamp_(-levels, levels).add_(levels)  # q + s, in [0, 2s]
    pack_fields(values, layout, out)  # integral floats convert exactly to the word type


def pack_signs(c: torch.Tensor, out: torch.Tensor, zero_parity: int = 0) -> torch.Tensor:
    """fp32 c -> packed 1-bit votes in `out` (8*out.numel() >= n bits; padding votes as c == 0)."""
    n, n_pad = c.numel(), 8 * out.numel()
    sgn = torch.sign(c, out=scratch("sign", n, torch.float32, c.device))
    signs = scratch("signs", n_pad, torch.int8, c.device)
    signs[:n].copy_(sgn)
    signs[n:] = 0
    return _pack_sign_votes(signs, out, zero_parity)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Packed bits -> +-1 fp32 (a scratch view of n elements): one table lookup per byte."""
    return _bits_piece(packed, 0, n, "sign", "update")


def _bits_piece(plane: torch.Tensor, s: int, e: int, kind: str, slot: str) -> torch.Tensor:
    """Bits [s, e) of a packed plane (s a multiple of 8) as fp32 +-1 (kind "sign") or 0/1 ("ones")."""
    b0, b1 = s // 8, -(-e // 8)
    out = scratch(slot, 8 * (b1 - b0), torch.float32, plane.device)
    torch.index_select(_bit_table(kind, plane.device), 0, plane[b0:b1].to(torch.int32), out=out.view(-1, 8))
    return out[: e - s]


_LOW_BITS = 0x0101010101010101  # bit 0 of each of the 8 bytes of an int64
_ZERO_VOTE_WORDS = (0x0001000100010001, 0x0100010001000100)  # the elements (bytes) that vote + on c == 0


def _pack_sign_votes(signs: torch.Tensor, out: torch.Tensor, zero_parity: int) -> torch.Tensor:
    """int8 signs (-1 = 0xFF, 0, +1 = 0x01; length a multiple of 8) -> packed votes, where an element
    votes + if its sign is +1, or if it is 0 and it is on the zero-vote pattern."""
    w = signs.view(torch.int64)
    pos = torch.bitwise_right_shift(w, 1, out=scratch("w1", w.numel(), torch.int64, w.device))
    pos.bitwise_not_().bitwise_and_(w).bitwise_and_(_LOW_BITS)  # bit0 & ~bit1: only +1 bytes
    zero = torch.bitwise_not(w, out=scratch("w2", w.numel(), torch.int64, w.device))
    zero.bitwise_and_(_LOW_BITS & _ZERO_VOTE_WORDS[zero_parity])  # ~bit0: only 0 bytes, on the pattern
    votes = pos.bitwise_or_(zero)
    packed = votes.mul_(PACK_MAGIC).bitwise_right_shift_(56)
    return out.copy_(packed[: out.numel()])


def vote(rows: torch.Tensor, out_sign: torch.Tensor, out_nonzero: torch.Tensor | None = None) -> None:
    """Majority vote over N packed 1-bit rows (N, B): per bit position count the + votes P and write
    the sign bit (2P > N) and, when out_nonzero is given, the not-a-tie bit (2P != N).

    The count is kept bit-sliced: plane k holds bit k of P for 64 positions per int64 word, and each
    row is added with a ripple-carry of bitwise ops, so nothing is unpacked."""
    N, B = rows.shape
    words = _as_words(rows)
    planes: list[torch.Tensor] = []
    for r in range(N):
        carry = words[r]
        for k, plane in enumerate(planes):
            planes[k], carry = plane ^ carry, plane & carry
        if r + 1 == 1 << len(planes):  # the count may now need one more bit
            planes.append(carry.clone())
    _write_bytes(out_sign, _greater_than(planes, N // 2), B)  # 2P > N  <=>  P > floor(N/2)
    if out_nonzero is not None:
        _write_bytes(out_nonzero, ~_equals(planes, N / 2), B)


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    N, B = rows.shape
    if B % 8:
        padded = torch.zeros(N, B + 8 - B % 8, dtype=torch.uint8, device=rows.device)
        padded[:, :B] = rows
        rows = padded
    return rows.contiguous().view(torch.int64)


def _write_bytes(out: torch.Tensor, words: torch.Tensor, nbytes: int) -> None:
    out.copy_(words.view(torch.uint8)[:nbytes])


def _greater_than(planes: list[torch.Tensor], threshold: int) -> torch.Tensor:
    """Bit-sliced P > threshold, scanning from the most significant plane."""
    gt = torch.zeros_like(planes[0])
    eq = torch.full_like(planes[0], -1)
    for k in reversed(range(len(planes))):
        if threshold >> k & 1:
            eq &= planes[k]
        else:
            gt |= eq & planes[k]
            eq &= ~planes[k]
    return gt if threshold < 1 << len(planes) else torch.zeros_like(gt)


def _equals(planes: list[torch.Tensor], value: float) -> torch.Tensor:
    if value != int(value) or value >= 1 << len(planes):
        return torch.zeros_like(planes[0])
    eq = torch.full_like(planes[0], -1)
    for k, plane in enumerate(planes):
        eq &= plane if int(value) >> k & 1 else ~plane
    return eq


def _check_fields(codec: Codec) -> None:
    if codec.kind != "fields" or codec.values not in ("vote", "l1") or codec.decode not in ("sign", "mean"):
        raise ValueError(f"no field kernels for codec {codec}")


def _field_update(codec: Codec, sums: torch.Tensor, world_size: int, levels: int) -> torch.Tensor:
    """U (float64) from summed field values."""
    centred = sums - codec.offset(world_size, levels)
    return centred / world_size if codec.decode == "mean" else torch.sign(centred)


def _field_update_table(codec: Codec, layout: FieldLayout, world_size: int, levels: int, device):
    """U as a function of one summed field value f (a table of 2**width fp32 entries)."""
    def build():
        f = torch.arange(1 << layout.width, dtype=torch.float64)
        return _field_update(codec, f, world_size, levels).float()
    return _table((codec, layout, world_size, levels), device, build)


def _planes(n: int, layout: FieldLayout, W: int) -> list[int]:
    """Boundaries of the field planes of n elements in W words: element i is field i // W."""
    return [j * W for j in range(layout.per_word) if j * W < n] + [n]


def _decode_piece(codec: Codec, code, s: int, e: int, *, world_size: int, levels: int, layout, slot="update"):
    """U (fp32, a scratch view) for elements [s, e); s is a multiple of 64 and, for p-bit codes, [s, e)
    lies in one field plane."""
    if codec.kind == "signs":
        sign_plane, nonzero_plane = code
        update = _bits_piece(sign_plane, s, e, "sign", slot)
        if nonzero_plane is not None:
            update.mul_(_bits_piece(nonzero_plane, s, e, "ones", slot + "2"))
        return update
    W = code.numel()
    j = s // W
    words = code[s - j * W : e - j * W]
    f = scratch("unfield", words.numel(), words.dtype, words.device)
    torch.bitwise_right_shift(words, layout.width * j, out=f).bitwise_and_((1 << layout.width) - 1)
    table = _field_update_table(codec, layout, world_size, levels, code.device)
    return torch.index_select(table, 0, f.to(torch.int32), out=scratch(slot, e - s, torch.float32, code.device))


def decode_update(codec: Codec, code, n: int, *, world_size: int, levels: int = 0,
                  layout: FieldLayout | None = None) -> torch.Tensor:
    """The agreed update U (fp32, a new tensor of n elements) from the agreed code."""
    onebit = codec.kind == "signs"
    if not onebit:
        _check_fields(codec)
        if layout.width > 16:  # too wide for a table
            return _field_update(codec, unpack_fields(code, layout, n).double(), world_size, levels).float()
    out = torch.empty(n, dtype=torch.float32, device=(code[0] if onebit else code).device)
    bounds = None if onebit else _planes(n, layout, code.numel())
    for _, s, e in pieces(n, bounds, out.device):
        out[s:e] = _decode_piece(codec, code, s, e, world_size=world_size, levels=levels, layout=layout)
    return out


def unpack_apply(codec: Codec, p, code, *, lr: float, wd: float, world_size: int, levels: int = 0,
                 layout: FieldLayout | None = None, momentum=None) -> None:
    """Decode the agreed code and apply p <- p*(1 - lr*wd) - lr*U, and with momentum=(g, m, beta2) the
    momentum update too (one pass on a GPU; in cache-sized pieces on a CPU)."""
    n = p.numel()
    onebit = codec.kind == "signs"
    if not onebit and layout.width > 16:
        apply_update_(p, decode_update(codec, code, n, world_size=world_size, levels=levels, layout=layout), lr, wd)
        if momentum is not None:
            g, m, beta2 = momentum
            momentum_update_(m, g, beta2)
        return
    fused = onebit and code[1] is not None and p.dtype == torch.float32
    for _, s, e in pieces(n, None if onebit else _planes(n, layout, code.numel()), p.device):
        if fused:  # U = sign * not-a-tie, folded into the update
            signs = _bits_piece(code[0], s, e, "sign", "update")
            ones = _bits_piece(code[1], s, e, "ones", "update2")
            if wd:
                p[s:e].mul_(1 - lr * wd)
            p[s:e].addcmul_(signs, ones, value=-lr)
        else:
            update = _decode_piece(codec, code, s, e, world_size=world_size, levels=levels, layout=layout)
            apply_update_(p[s:e], update, lr, wd)
        if momentum is not None:
            g, m, beta2 = momentum
            momentum_update_(m[s:e], g[s:e], beta2)
