"""The Triton kernels against their torch twins and against first principles.

On CPU they run under the Triton interpreter (TRITON_INTERPRET=1 is set by the `T` fixture, before the
kernels are imported, and removed after this module). The same tests validate the GPU kernels:

    LIONCUB_TEST_DEVICE=cuda pytest tests/kernels/test_kernels_triton.py

Float pipelines may differ only where a value sits at a rounding boundary: a sign flip where |c| is at
rounding level (or, for l1-pbit, a level change where c*mult is at a half-integer). `assert_close_codes`
checks exactly that: every mismatch is such an element and there are very few of them. Under the
interpreter the kernels reproduce the twins bit for bit, so there are none.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from lioncub.kernels import reference as ref

from lioncub import kernels, methods


def codec(method):
    return methods.get(method).codec


def layout(method, N, levels=None):
    return methods.get(method).layout(N, levels or 0)

DEVICE = os.environ.get("LIONCUB_TEST_DEVICE", "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
B1, B2, LR, WD = 0.9, 0.99, 0.01, 0.1
# small tiles: many programs, tiles that straddle tensor edges and field planes, at interpreter-friendly sizes
TINY = {"lion": (64, 4), "finite": (64, 4), "l1_sum": (32, 4), "combine": 4, "onebit": (4, 4), "fields": (64, 4),
        "vote": (16, 4)}
ROUNDING = 2.0**-20  # relative size of "at rounding level" (fp32 rounds at 2**-24)


@pytest.fixture(scope="module")
def T():
    mp = pytest.MonkeyPatch()
    if DEVICE == "cpu":
        mp.setenv("TRITON_INTERPRET", "1")
        # a kernel module imported earlier in this process without the interpreter holds jit-compiled
        # device functions that the interpreter cannot call: import them afresh
        for name in [m for m in sys.modules if m.startswith("lioncub.kernels.triton_")]:
            mp.delitem(sys.modules, name)
    try:
        yield importlib.import_module("lioncub.kernels.triton_ops")
    finally:
        mp.undo()


@pytest.fixture(params=["default-tiles", "tiny-tiles"])
def tiles(request, T, monkeypatch):
    if request.param == "tiny-tiles":
        common = importlib.import_module("lioncub.kernels.triton_common")
        for k, v in TINY.items():
            monkeypatch.setitem(common.CFG, k, v)
    return request.param


# --- data and first-principles helpers -------------------------------------------------------------------


def make_gm(n, dtype=torch.float32, seed=0):
    """g, m with exact zeros (c == 0), and a few elements where c is tiny but not 0 (rounding level)."""
    gen = torch.Generator().manual_seed(seed)
    g, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g[::7] = 0
    m[::7] = 0
    g[3::97] = -9 * m[3::97]  # b1*m + (1-b1)*g cancels up to rounding
    return g.to(dtype).to(DEVICE), m.to(dtype).to(DEVICE)


def npf(t):
    return t.detach().float().cpu().numpy()


def c_exact(g, m, beta1=B1):
    """c of the fp32 pipeline (fl(m*b1), then g*(1-b1) added) in fp64: exact sign and zero-ness, and the
    scale of its operands (for 'at rounding level')."""
    mb = (npf(m) * np.float32(beta1)).astype(np.float32).astype(np.float64)
    gb = npf(g).astype(np.float64) * np.float64(np.float32(1 - beta1))
    return mb + gb, np.abs(mb) + np.abs(gb)


def at_rounding_level(c, scale):
    return np.abs(c) <= ROUNDING * scale


def log_mismatches(what, mismatches, size, explained):
    """With LIONCUB_TEST_MISMATCH_LOG=path, append one JSON line per comparison (`make gpu-check` reads them:
    the tests tolerate rounding-level mismatches, the GPU check reports whether there were any)."""
    path = os.environ.get("LIONCUB_TEST_MISMATCH_LOG")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    if not path or "test_assert_close_codes" in test:
        return
    import json
    with open(path, "a") as f:
        f.write(json.dumps(dict(test=test, what=what, device=DEVICE, mismatches=int(mismatches), size=int(size),
                                explained=bool(explained))) + "\n")


def assert_close_codes(got, want, allowed, what):
    """got/want: per-element decoded values of two float pipelines. Mismatches only where `allowed`
    (an element at a rounding boundary), and few of them."""
    got, want = np.asarray(got), np.asarray(want)
    bad = np.nonzero(got != want)[0]
    log_mismatches(what, len(bad), got.size, np.all(allowed[bad]))
    assert np.all(allowed[bad]), f"{what}: mismatch at elements {bad[~allowed[bad]][:10]} not at rounding level"
    assert len(bad) <= 4 + got.size // 1000, f"{what}: {len(bad)} rounding-level mismatches of {got.size}"


def onebit_values(packed, n):
    return np.unpackbits(packed.cpu().numpy(), bitorder="little")[:n]


def field_values(words, layout, n):
    """Per-element field values, decoded with Python integers (independent of both implementations)."""
    w = [int(x) for x in words.cpu().numpy().astype(np.int64)]
    W, mask = len(w), (1 << layout.width) - 1
    return np.array([(w[i % W] >> (layout.width * (i // W))) & mask for i in range(n)], dtype=np.int64)


def momentum_exact(g, m, beta2=B2):
    """fp64 value of b2*m + (1-b2)*g from fp32 operands, rounded once into the parameter dtype."""
    mb = (npf(m) * np.float32(beta2)).astype(np.float32).astype(np.float64)
    return mb + npf(g).astype(np.float64) * np.float64(np.float32(1 - beta2))


def assert_within_one_rounding(got, exact64, dtype):
    """got (dtype) is exact64 rounded to dtype: at most half an ulp of dtype away (plus fp32 rounding)."""
    got64 = got.double().cpu().numpy()
    ulp = torch.finfo(dtype).eps * np.maximum(np.abs(exact64), torch.finfo(dtype).tiny)
    assert np.all(np.abs(got64 - exact64) <= 0.5 * ulp + 2.0**-23 * np.abs(exact64)), dtype


# --- dispatch ------------------------------------------------------------------------------------------


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    from lioncub import kernels
    monkeypatch.setenv("LIONCUB_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.lion_step(p, p.clone(), p.clone(), lr=0.1, wd=0.0, beta1=0.9, beta2=0.99)
    assert p.eq(0).all()  # nothing ran


def test_dispatch_picks_triton_ops_under_interpreter(T, monkeypatch):
    from lioncub import kernels
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LIONCUB_KERNELS", "triton")
    assert kernels.implementation(torch.zeros(1)) is T
    monkeypatch.setenv("LIONCUB_KERNELS", "auto")
    assert kernels.implementation(torch.zeros(1)) is ref  # CPU tensors take the twins under auto


# --- plain Lion step -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 13, 2051, 4096])
def test_lion_step_matches_twin_and_first_principles(T, tiles, dtype, n):
    g, m = make_gm(n, dtype, seed=n)
    p = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype).to(DEVICE)
    c, scale = c_exact(g, m)
    p1, m1, p2, m2 = p.clone(), m.clone(), p.clone(), m.clone()
    T.lion_step(p1, g, m1, lr=LR, wd=WD, beta1=B1, beta2=B2)
    ref.lion_step(p2, g, m2, lr=LR, wd=WD, beta1=B1, beta2=B2)
    assert torch.equal(m1, m2)
    assert_close_codes(npf(p1), npf(p2), at_rounding_level(c, scale), "lion p")
    # first principles: decay, then a step of lr against sign(c), rounded once from fp32
    decayed = (npf(p) * np.float32(1 - LR * WD)).astype(np.float32)
    want = torch.from_numpy((decayed - np.float32(LR) * np.sign(c).astype(np.float32)).astype(np.float32))
    assert torch.equal(p1.cpu(), want.to(dtype))
    assert_within_one_rounding(m1, momentum_exact(g, m), dtype)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_lion_step_skips_on_the_device_flag(T, tiles, bad):
    """kernels.nonfinite_flag decides on the device; lion_step(skip=flag) writes nothing where it is set, and
    is the plain step where it is not (Triton and twin alike)."""
    n = 2051
    g, m = make_gm(n, torch.float32, seed=3)
    p = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    if bad is not None:
        g[1234] = bad
    flag = kernels.nonfinite_flag([kernels.finite_flag(g[:1000]), kernels.finite_flag(g[1000:])])
    assert flag.shape == () and flag.dtype == torch.int32 and int(flag) == (bad is not None)
    for impl in (T, ref):
        p1, m1, p2, m2 = p.clone(), m.clone(), p.clone(), m.clone()
        impl.lion_step(p1, g, m1, lr=LR, wd=WD, beta1=B1, beta2=B2, skip=flag)
        if bad is not None:
            assert torch.equal(p1, p) and torch.equal(m1, m)
        else:
            impl.lion_step(p2, g, m2, lr=LR, wd=WD, beta1=B1, beta2=B2)
            assert torch.equal(p1, p2) and torch.equal(m1, m2)


def test_lion_step_matches_lion_pytorch(T):
    lion_pytorch = pytest.importorskip("lion_pytorch")
    torch.manual_seed(0)
    q = torch.nn.Parameter(torch.randn(1000))
    p, m = q.detach().clone().to(DEVICE), torch.zeros(1000, device=DEVICE)
    opt = lion_pytorch.Lion([q], lr=3e-3, weight_decay=0.2)
    for _ in range(5):
        g = torch.randn(1000)
        q.grad = g.clone()
        opt.step()
        T.lion_step(p, g.to(DEVICE), m, lr=3e-3, wd=0.2, beta1=0.9, beta2=0.99)
    assert torch.equal(p.cpu(), q.detach()) and torch.equal(m.cpu(), opt.state[q]["exp_avg"])


# --- pre-pass ----------------------------------------------------------------------------------------------


def random_offsets(n, seed, max_len=40):
    """Tensor boundaries of a bucket: short tensors and an empty one (after the first)."""
    rng = np.random.default_rng(seed)
    off = [0]
    while off[-1] < n:
        off.append(min(n, off[-1] + int(rng.integers(1, max_len))))
    return off[:2] + off[1:]


@pytest.mark.parametrize("n", [1, 300, 4099])
def test_prepass_l1_multipliers(T, tiles, n):
    g, m = make_gm(n, seed=n)
    offsets = random_offsets(n, n)
    g[offsets[-2]:] = 0  # the last tensor's c is all zero
    m[offsets[-2]:] = 0
    s = 7
    f1, mult1 = T.prepass(codec("l1-pbit"), g, m, beta1=B1, offsets=offsets, levels=s)
    f2, mult2 = ref.prepass(codec("l1-pbit"), g, m, beta1=B1, offsets=offsets, levels=s)
    assert bool(f1) is True and bool(f2) is True
    assert f1.device == g.device and f1.dim() == 0  # a device flag: the prepass does not wait for the GPU
    # both accumulate |c| accurately but in different orders (fp64 tiles vs fp32 chunks): equal to ~1e-7
    assert torch.allclose(mult1.cpu(), mult2.cpu(), rtol=1e-6, atol=0)
    c, _ = c_exact(g, m)
    for k, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        mean = np.abs(c[a:b]).sum() / max(b - a, 1)
        want = 0.0 if mean == 0 else float(np.float32((s / 2) / mean))
        assert float(mult1[k]) == pytest.approx(want, rel=1e-6, abs=0.0), k
    assert mult1[1] == 0 and mult1[-1] == 0  # the empty tensor and the all-zero tensor: q = 0
    assert n < 40 or (mult1 > 0).sum() > len(offsets) // 2  # most tensors have a scale


@pytest.mark.parametrize("twin", [False, True])
def test_l1_multipliers_of_a_run_are_its_buckets_joined(T, tiles, twin):
    """Backward takes l1-pbit's pre-pass per bucket (lioncub.optim.backward); step() may exchange a run of buckets
    (lioncub.optim.buckets.Run): the buckets' multipliers, joined with 0 for the padding, are bit for bit the run's."""
    from lioncub import LionCub
    from lioncub.optim.buckets import Run

    ops = ref if twin else T
    params = [torch.nn.Parameter(torch.zeros(n, device=DEVICE)) for n in (5, 3000, 7, 4100, 1, 9000)]
    buckets = LionCub(params, bucket_mb=3000 * 4 / 2**20).engine.buckets
    run = Run(buckets, list(range(len(buckets))))
    assert len(buckets) >= 3 and len(run.offsets) > sum(len(b.offsets) - 1 for b in buckets) + 1  # padding
    gen = torch.Generator().manual_seed(5)
    run.g.copy_(torch.randn(run.n, generator=gen))
    run.m.copy_(torch.randn(run.n, generator=gen) * 0.1)
    for b in buckets:  # the padding: no parameter, zero gradient and momentum
        at = b.start - buckets[0].start
        run.g[at + b.n : at + -(-b.n // 4096) * 4096].zero_()
        run.m[at + b.n : at + -(-b.n // 4096) * 4096].zero_()
    l1 = codec("l1-pbit")
    each = [ops.prepass(l1, b.g, b.m, beta1=B1, offsets=b.offsets, levels=7)[1] for b in buckets]
    whole = ops.prepass(l1, run.g, run.m, beta1=B1, offsets=run.offsets, levels=7)[1]
    assert torch.equal(run.joined(each), whole) and (whole > 0).sum() == len(params)


@pytest.mark.parametrize("method", ["vote-1bit", "vote-pbit", "l1-pbit"])
@pytest.mark.parametrize("where, bad", [("first", float("nan")), ("middle", float("inf")), ("last", -float("inf"))])
def test_prepass_flags_non_finite(T, tiles, method, where, bad):
    n = 301
    g, m = make_gm(n, seed=1)
    offsets = [0, 100, 301]
    assert bool(T.prepass(codec(method), g, m, beta1=B1, offsets=offsets, levels=3)[0]) is True
    g[{"first": 0, "middle": 150, "last": n - 1}[where]] = bad
    assert bool(T.prepass(codec(method), g, m, beta1=B1, offsets=offsets, levels=3)[0]) is False
    assert bool(ref.prepass(codec(method), g, m, beta1=B1, offsets=offsets, levels=3)[0]) is False


# --- quantize-and-pack --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, pad", [(1, 0), (13, 2), (64, 0), (2051, 5)])
@pytest.mark.parametrize("parity", [0, 1])
def test_quantize_onebit(T, tiles, dtype, n, pad, parity):
    g, m = make_gm(n, dtype, seed=n + parity)
    c, scale = c_exact(g, m)
    nbytes = -(-n // 8) + pad  # padded like a 1-bit all-to-all buffer
    out1 = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=DEVICE)
    out2 = out1.clone()
    m1, m2 = m.clone(), m.clone()
    T.quantize_pack(codec("vote-1bit"), g, m1, out1, beta1=B1, beta2=B2, zero_parity=parity)
    ref.quantize_pack(codec("vote-1bit"), g, m2, out2, beta1=B1, beta2=B2, zero_parity=parity)
    assert torch.equal(m1, m2)
    assert_within_one_rounding(m1, momentum_exact(g, m), dtype)
    allowed = np.concatenate([at_rounding_level(c, scale), np.zeros(8 * nbytes - n, bool)])
    assert_close_codes(onebit_values(out1, 8 * nbytes), onebit_values(out2, 8 * nbytes), allowed, "1-bit code")
    # first principles: + for c > 0; for c == 0 (and the padding) + iff (index + parity) is even
    idx = np.arange(8 * nbytes)
    cc = np.concatenate([c, np.zeros(8 * nbytes - n)])
    want = np.where(cc > 0, 1, np.where(cc < 0, 0, (idx + parity) % 2 == 0))
    assert_close_codes(onebit_values(out1, 8 * nbytes), want, allowed, "1-bit vs first principles")


PBIT_CASES = [  # method, N, levels: uint8 x 2 fields, int64 x 21, int32 x 3, uint8 x 1, int64 x 7
    ("vote-pbit", 4, None), ("vote-pbit", 2, None), ("avg-pbit", 40, None), ("l1-pbit", 4, None),
    ("l1-pbit", 3, 30)]


@pytest.mark.parametrize("method, N, levels", [("vote-1bit", 4, None)] + PBIT_CASES)
@pytest.mark.parametrize("n, bad_at", [(0, None), (1001, None), (1001, 0), (1001, 1000), (3, 2)])
@pytest.mark.parametrize("twin", [False, True])
def test_quantize_pack_checked_is_quantize_pack_and_finite_flag(T, tiles, method, N, levels, n, bad_at, twin):
    """The check counted in quantize's own pass: the same code and momentum as quantize_pack, bit for bit, and
    the flag finite_flag gives (a NaN or inf in g: first element, last one in a masked tail tile; none)."""
    ops = ref if twin else T
    meth = methods.get(method)
    g, m = make_gm(n, DTYPES[n % 3], seed=n + 1)
    if bad_at is not None:
        g[bad_at] = float("nan") if bad_at % 2 == 0 else -float("inf")
    offsets = random_offsets(n, seed=N) if n else [0, 0]
    if meth.codec.kind == "signs":
        lay, s, mult = None, 0, None
        out = torch.full((-(-n // 8) + 3,), 0xA5, dtype=torch.uint8, device=DEVICE)
    else:
        lay = layout(method, N, levels)
        s = (levels or meth.resolve_levels(N)) if meth.codec.l1 else 0
        mult = ref.prepass(meth.codec, g.nan_to_num(0.0, 0.0, 0.0), m, beta1=B1, offsets=offsets, levels=s)[1]
        out = torch.full((lay.words(n),), 3, dtype=getattr(torch, lay.dtype), device=DEVICE)
    kw = dict(beta1=B1, beta2=B2, zero_parity=1, layout=lay, mult=mult, offsets=offsets, levels=s,
              update_momentum=bad_at is None)
    out2, m2 = out.clone(), m.clone()
    flag = ops.quantize_pack_checked(meth.codec, g, m, out, **kw)
    ops.quantize_pack(meth.codec, g, m2, out2, **kw)
    assert flag.dim() == 0 and flag.device == g.device
    assert bool(flag) is (bad_at is None) is bool(ref.finite_flag(g))
    assert torch.equal(out, out2) and torch.equal(m, m2)


@pytest.mark.parametrize("method, N, levels", PBIT_CASES)
@pytest.mark.parametrize("n", [1, 77, 1001])
def test_quantize_fields(T, tiles, method, N, levels, n):
    lay = layout(method, N, levels)
    s = (levels or methods.get('l1-pbit').resolve_levels(N)) if method == "l1-pbit" else 0
    dtype = DTYPES[n % 3]
    g, m = make_gm(n, dtype, seed=n)
    offsets = random_offsets(n, seed=N)
    _, mult = ref.prepass(codec(method), g, m, beta1=B1, offsets=offsets, levels=s)
    out1 = torch.full((lay.words(n),), 3, dtype=getattr(torch, lay.dtype), device=DEVICE)
    out2 = out1.clone()
    m1, m2 = m.clone(), m.clone()
    kw = dict(beta1=B1, beta2=B2, layout=lay, mult=mult, offsets=offsets, levels=s)
    T.quantize_pack(codec(method), g, m1, out1, **kw)
    ref.quantize_pack(codec(method), g, m2, out2, **kw)
    assert torch.equal(m1, m2)
    c, scale = c_exact(g, m)
    allowed = at_rounding_level(c, scale)
    got = field_values(out1, lay, lay.words(n) * lay.per_word)
    assert np.all(got[n:] == 0)  # fields past the end stay empty
    if method == "l1-pbit":  # level changes where c*mult is within rounding of a half-integer are allowed too
        k = np.repeat(npf(mult).astype(np.float64), np.diff(offsets))
        x = c * k
        allowed |= np.abs(np.abs(x - np.floor(x)) - 0.5) <= ROUNDING * np.maximum(np.abs(x), 1)
        want = np.clip(np.rint(x), -s, s) + s  # numpy rint: half to even
    else:
        want = np.sign(c) + 1
    assert_close_codes(got[:n], field_values(out2, lay, n), allowed, f"{method} fields vs twin")
    assert_close_codes(got[:n], want.astype(np.int64), allowed, f"{method} fields vs first principles")


def test_l1_levels_round_half_to_even_and_clamp(T):
    # beta1 = 0.5 and g = m make c = m exactly; mean |c| = 2 = s/2 makes mult = 1, so q = rint(c) clamped
    c = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 7.0, -9.0, 0.0, 1.0, -1.0, 2.0], device=DEVICE)
    c = torch.cat([c, torch.full((12,), 2.0 * 24 - float(c.abs().sum()), device=DEVICE) / 12])
    assert float(c.abs().mean()) == 2.0
    s, offsets = 4, [0, 24]
    lay = layout("l1-pbit", 2, s)
    f, mult = T.prepass(codec("l1-pbit"), c, c, beta1=0.5, offsets=offsets, levels=s)
    assert f and float(mult[0]) == 1.0
    out = torch.zeros(lay.words(24), dtype=getattr(torch, lay.dtype), device=DEVICE)
    T.quantize_pack(codec("l1-pbit"), c, c.clone(), out, beta1=0.5, beta2=0.5, layout=lay, mult=mult, offsets=offsets,
                    levels=s)
    q = field_values(out, lay, 12) - s
    assert q.tolist() == [0, 2, 2, 0, -2, 4, 4, -4, 0, 1, -1, 2]  # Python round(): half to even


# --- vote --------------------------------------------------------------------------------------------------


VOTE_CASES = [(N, B, aligned, "default-tiles") for N in (1, 2, 3, 4, 5, 8, 16, 31, 64)
              for B, aligned in ((1, True), (13, True), (64, True), (260, False))]
VOTE_CASES += [(N, B, aligned, "tiny-tiles") for N in (1, 2, 3, 4, 5, 8, 16, 31, 64)
               for B, aligned in ((13, True), (100, False))]


@pytest.mark.parametrize("N, B, aligned, tile_cfg", VOTE_CASES)
def test_vote_counts_plus_votes(T, monkeypatch, N, B, aligned, tile_cfg):
    if tile_cfg == "tiny-tiles":
        monkeypatch.setitem(importlib.import_module("lioncub.kernels.triton_common").CFG, "vote", TINY["vote"])
    rng = np.random.default_rng(N * 1000 + B)
    rows_np = rng.integers(0, 256, size=(N, B)).astype(np.uint8)
    rows_np[:, 0] = np.where(np.arange(N) % 2 == 0, 0x0F, 0xF0)  # ties in every bit of byte 0 for even N
    buf = torch.zeros(N * B + 4, dtype=torch.uint8, device=DEVICE)
    start = 0 if aligned else 1  # an odd address: the kernel falls back from int32 words to bytes
    rows = buf[start:start + N * B].view(N, B)
    rows.copy_(torch.from_numpy(rows_np))
    sign1, nz1, sign2, nz2, sign3 = (torch.empty(B, dtype=torch.uint8, device=DEVICE) for _ in range(5))
    T.vote(rows, sign1, nz1)
    T.vote(rows, sign3)  # no tie plane requested
    ref.vote(rows, sign2, nz2)
    plus = np.unpackbits(rows_np, axis=1, bitorder="little").sum(0)
    assert onebit_values(sign1, 8 * B).tolist() == (2 * plus > N).astype(int).tolist()
    assert onebit_values(nz1, 8 * B).tolist() == (2 * plus != N).astype(int).tolist()
    assert torch.equal(sign1, sign2) and torch.equal(nz1, nz2) and torch.equal(sign1, sign3)
    if N % 2 == 0:
        assert (2 * plus == N).sum() >= 8  # the ties are really there


# --- unpack-and-apply -------------------------------------------------------------------------------------


def expected_apply(p, U, dtype):
    """p*(1-lr*wd) rounded to fp32, then -lr*U with one rounding (U exact in fp32), then into dtype."""
    decayed = (npf(p) * np.float32(1 - LR * WD)).astype(np.float32)
    exact = decayed.astype(np.float64) - np.float64(np.float32(LR)) * U
    return torch.from_numpy(exact.astype(np.float32)).to(dtype)  # fp64 -> fp32: correctly rounded here


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 13, 2051])
@pytest.mark.parametrize("tie_plane", [False, True])
def test_unpack_apply_onebit(T, tiles, dtype, n, tie_plane):
    rng = np.random.default_rng(n)
    nb = -(-n // 8) + 3
    sign = torch.from_numpy(rng.integers(0, 256, nb).astype(np.uint8)).to(DEVICE)
    nz = torch.from_numpy(rng.integers(0, 256, nb).astype(np.uint8)).to(DEVICE) if tie_plane else None
    p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    p1, p2 = p.clone(), p.clone()
    T.unpack_apply(codec("vote-1bit"), p1, (sign, nz), lr=LR, wd=WD, world_size=4)
    ref.unpack_apply(codec("vote-1bit"), p2, (sign, nz), lr=LR, wd=WD, world_size=4)
    assert torch.equal(p1, p2)
    U = 2.0 * onebit_values(sign, n) - 1
    if tie_plane:
        U = U * onebit_values(nz, n)
    assert torch.equal(p1.cpu(), expected_apply(p, U, dtype))


@pytest.mark.parametrize("method, N, levels", PBIT_CASES)
@pytest.mark.parametrize("n", [1, 77, 1001])
def test_unpack_apply_fields(T, tiles, method, N, levels, n):
    lay = layout(method, N, levels)
    s = (levels or methods.get('l1-pbit').resolve_levels(N)) if method == "l1-pbit" else 0
    dtype = DTYPES[(n + N) % 3]
    rng = np.random.default_rng(n + N)
    per_rank = rng.integers(0, lay.max_value + 1, size=(N, n))
    per_rank[:, ::5] = lay.max_value // 2  # every rank abstains (sign 0 / level 0): sum exactly at the offset
    sums = per_rank.sum(0)
    W = lay.words(n)
    words = [0] * W
    for i, v in enumerate(sums):  # summed fields, packed with Python integers
        words[i % W] += int(v) << (lay.width * (i // W))
    code = torch.tensor(words, dtype=torch.int64).to(getattr(torch, lay.dtype)).to(DEVICE)
    p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    p1, p2 = p.clone(), p.clone()
    kw = dict(lr=LR, wd=WD, world_size=N, levels=s, layout=lay)
    T.unpack_apply(codec(method), p1, code, **kw)
    ref.unpack_apply(codec(method), p2, code, **kw)
    assert torch.equal(p1, p2)
    signed = sums.astype(np.float64) - N * (s if method == "l1-pbit" else 1)
    if method == "avg-pbit":
        U = (signed / N).astype(np.float32).astype(np.float64)
        decayed = (npf(p) * np.float32(1 - LR * WD)).astype(np.float32).astype(np.float64)
        want = torch.from_numpy((decayed + np.float64(np.float32(-LR)) * U).astype(np.float32)).to(dtype)
        # fma: one rounding of the exact fp64 value (exact here: 24-bit x 24-bit products fit in fp64)
        assert torch.equal(p1.cpu(), want)
    else:
        assert torch.equal(p1.cpu(), expected_apply(p, np.sign(signed), dtype))
    assert np.sum(signed == 0) >= len(range(0, n, 5))  # U = 0 really occurs


# --- the float-tolerance checker itself ------------------------------------------------------------------


def test_assert_close_codes_rejects_a_real_difference():
    allowed = np.array([False, True, False, False])
    assert_close_codes([1, 0, 1, 1], [1, 1, 1, 1], allowed, "ok")  # a flip at rounding level: fine
    with pytest.raises(AssertionError, match="not at rounding level"):
        assert_close_codes([1, 1, 0, 1], [1, 1, 1, 1], allowed, "bad")
    with pytest.raises(AssertionError, match="rounding-level mismatches"):
        assert_close_codes(np.zeros(100), np.ones(100), np.ones(100, bool), "too many")


# --- the whole optimizer ------------------------------------------------------------------------------------


def test_local_optimizer_triton_equals_torch(T, monkeypatch):
    """World size 1 (no process group): LionCub's local path, both backends, bit for bit."""
    import dist_cases

    from lioncub import LionCub

    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LIONCUB_KERNELS", backend)
        params, groups = dist_cases.make_params()
        for p in params:
            p.data = p.data.to(DEVICE)
        opt = LionCub(groups, method="l1-pbit", bucket_mb=dist_cases.BUCKET_MB, weight_decay=0.1, lr=0.01)
        for step in range(1, 4):
            grads = [None if g is None else g.to(DEVICE) for g in dist_cases.make_grads(params, 0, step)]
            dist_cases.assign(params, grads, step)
            opt.step()
        runs[backend] = [p.detach().clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"], runs["triton"]))
    assert not torch.equal(runs["triton"][0], dist_cases.make_params()[0][0].to(DEVICE))  # it moved


BUCKET_MB = 1024 / 2**20  # several tensors per bucket, one or two buckets per dtype


def rounding_level_coordinates(opt, params, grads):
    """Per parameter coordinate: is this rank's c at a rounding boundary (|c| at rounding level, or for
    l1-pbit c*mult within rounding of a half-integer level)?"""
    beta1 = {id(q): gr["betas"][0] for gr in opt.param_groups for q in gr["params"]}
    out = []
    for p, g in zip(params, grads):
        m = opt.state[p]["exp_avg"].reshape(-1)
        c, scale = c_exact(torch.zeros_like(m) if g is None else g.reshape(-1), m, beta1[id(p)])
        near = at_rounding_level(c, scale)
        if opt.method == "l1-pbit" and np.abs(c).sum() > 0:
            x = c * ((opt.levels / 2) / np.abs(c).mean())
            near |= np.abs(np.abs(x - np.floor(x)) - 0.5) <= ROUNDING * np.maximum(np.abs(x), 1)
        out.append(near)
    return torch.from_numpy(np.concatenate(out))


def lockstep_backends(rank, world_size, methods, steps):
    """Rank body: two LionCub replicas, one on the torch twins and one on the Triton kernels (interpreter),
    stepped in lockstep on the same gradients. Before each step the Triton replica is reset to the torch
    replica's state, so each step is compared from identical inputs. Returns per method the number of
    mismatching parameters/momenta and how many mismatches no rank's rounding-level c explains."""
    import dist_cases
    import torch.distributed as dist

    from lioncub import LionCub, kernels

    def flat(tensors):
        return torch.cat([t.detach().double().reshape(-1) for t in tensors])

    report = {}
    for method in methods:
        reps = {}
        for backend in ("torch", "triton"):
            params, groups = dist_cases.make_params()
            reps[backend] = (params, LionCub(groups, method=method, bucket_mb=BUCKET_MB, weight_decay=0.1,
                                             lr=0.01))
        (pa, oa), (pb, ob) = reps["torch"], reps["triton"]
        r = dict(p_mismatch=0, unexplained=0, m_mismatch=0, elements=0, updated=0)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for a, b in zip(pa, pb):
                    b.copy_(a)
                    ob.state[b]["exp_avg"].copy_(oa.state[a]["exp_avg"])
            grads = dist_cases.make_grads(pa, rank, step)
            near = rounding_level_coordinates(oa, pa, grads)
            gathered = [torch.empty_like(near) for _ in range(world_size)]
            dist.all_gather(gathered, near)
            explained = torch.stack(gathered).any(0).numpy()
            before = flat(pa)
            for backend, (params, opt) in reps.items():
                os.environ["LIONCUB_KERNELS"] = backend
                dist_cases.assign(params, [None if g is None else g.clone() for g in grads], step)
                opt.step()
            diff = (flat(pa) != flat(pb)).numpy()
            r["p_mismatch"] += int(diff.sum())
            r["unexplained"] += int((diff & ~explained).sum())
            r["m_mismatch"] += int((flat(oa.state[a]["exp_avg"] for a in pa) !=
                                    flat(ob.state[b]["exp_avg"] for b in pb)).sum())
            r["elements"] += diff.size
            r["updated"] += int((flat(pa) != before).sum())
        r["stats_equal"] = (oa.stats.steps, oa.stats.skipped_steps) == (ob.stats.steps, ob.stats.skipped_steps)
        report[method] = r
    os.environ["LIONCUB_KERNELS"] = "triton"
    report["backend"] = kernels.implementation(torch.zeros(1)).__name__  # the Triton replica really ran Triton
    return report


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_optimizer_triton_equals_torch_on_ranks(T, world_size):
    from lioncub.comm.spawn import spawn

    methods = {2: ["vote-1bit", "vote-allgather", "vote-pbit", "avg-pbit", "l1-pbit"],
               3: ["vote-1bit", "vote-pbit", "l1-pbit"], 4: ["vote-1bit", "vote-allgather", "avg-pbit", "l1-pbit"]}[
                   world_size]
    reports = spawn(lockstep_backends, world_size, methods, 3, timeout=300,
                    env={"TRITON_INTERPRET": "1", "LIONCUB_KERNELS": "torch"})
    for rank, report in enumerate(reports):
        assert report["backend"] == "lioncub.kernels.triton_ops"
        for method in methods:
            r = report[method]
            assert r["m_mismatch"] == 0, (rank, method, r)
            assert r["unexplained"] == 0, (rank, method, r)
            assert r["p_mismatch"] <= 4 + r["elements"] // 1000, (rank, method, r)
            assert r["updated"] > r["elements"] // 2, (rank, method, r)  # the steps really moved parameters
            assert r["stats_equal"], (rank, method)


# --- the GPU path compiles (ahead of time, no GPU needed) ------------------------------------------------


def test_kernels_compile_for_h100_with_vector_accesses():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "lioncub.kernels.triton_ptx", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    res = {r["name"]: r for r in json.loads(out.stdout)}
    assert len(res) >= 14
    for name, r in res.items():  # the bulk kernels read full tiles with 128-bit loads; nothing spills
        if name.startswith(("lion", "quantize 1-bit", "quantize l1", "apply", "prepass l1 sums")):
            assert r["vector_loads"], (name, r["global_ops"])
        assert r["stack_bytes"] in (0, None), (name, r)
    assert res["lion fp32"]["fma"] >= 3  # c, momentum and the update are fused multiply-adds


# --- the benchmark's code paths (timings are not asserted) -------------------------------------------------


def test_bench_runs_every_gpu_kernel_closure_under_the_interpreter(T):
    from lioncub.apps.benchmarks import kernels as bench

    kernels, steps, (p, g, m) = bench.bucket_ops(T, 3001, torch.float32, torch.device(DEVICE), 4)
    for name, nbytes, fn in kernels:
        fn()
        assert nbytes > 0, name
    for fn in steps.values():
        fn()
    assert torch.isfinite(p).all() and torch.isfinite(m).all()


def test_bench_cpu_report_and_json(monkeypatch, capsys):
    from lioncub.apps.benchmarks import kernels as bench
    from lioncub.cli import main

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    assert main(["bench", "kernels", "--device", "cpu", "--sizes", "64K", "--repeat", "1", "--json"]) == 0
    import json
    res = json.loads(capsys.readouterr().out)
    assert res["sizes"] == [65536] and res["copy_gbps"] > 0
    assert {r["kernel"] for r in res["kernels"]} >= {"lion_step", "quantize_pack 1-bit", "unpack_apply 1-bit"}
    assert res["packbits"][0]["pack_x_numpy"] > 0 and set(res["targets"])
    gpu_like = dict(res, backend="triton", device="NVIDIA H100", targets={"x": True})
    text = bench.format_report(gpu_like)
    assert "torch twins (same device)" in text and "NVIDIA H100" in text


DEFERRED_CASES = [("vote-1bit", 4, None), ("vote-1bit", 3, None)] + PBIT_CASES


@pytest.mark.parametrize("method, N, levels", DEFERRED_CASES)
@pytest.mark.parametrize("n", [77, 1001])
def test_deferred_momentum_equals_the_fused_update(T, tiles, method, N, levels, n):
    """The overlapped step quantizes without touching m and updates m in unpack_apply: the same code,
    parameters and momentum as the fused path, bit for bit, in Triton and in the twin."""
    meth = methods.get(method)
    s = meth.resolve_levels(N, levels) if meth.uses_levels else 0
    dtype = DTYPES[n % 3]
    g, m = make_gm(n, dtype, seed=n + 1)
    p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    offsets = random_offsets(n, seed=N)
    x = meth.exchange(n, DEVICE, None, levels=s, world_size=N)
    results = []
    for ops in (T, ref):
        for deferred in (False, True):
            mm, pp, code = m.clone(), p.clone(), x.code.clone().zero_()
            _, mult = ops.prepass(meth.codec, g, mm, beta1=B1, offsets=offsets, levels=s)
            ops.quantize_pack(meth.codec, g, mm, code, beta1=B1, beta2=B2, zero_parity=1, layout=x.layout,
                              mult=mult, offsets=offsets, levels=s, update_momentum=not deferred)
            if meth.codec.kind == "signs":  # every rank voted like this one: the agreed planes are its bits
                agreed = (code[: -(-n // 8)], torch.full_like(code[: -(-n // 8)], 255) if N % 2 == 0 else None)
            else:
                agreed = code * N  # N identical rank codes summed; fields are wide enough for N copies
            ops.unpack_apply(meth.codec, pp, agreed, lr=LR, wd=WD, world_size=N, levels=s, layout=x.layout,
                             momentum=(g, mm, B2) if deferred else None)
            results.append((code, pp, mm))
    code0, p0, m0 = results[0]
    assert not torch.equal(m0, m) and not torch.equal(p0, p)
    for code1, p1, m1 in results[1:]:
        assert torch.equal(code1, code0) and torch.equal(p1, p0) and torch.equal(m1, m0)
