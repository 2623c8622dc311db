"""The torch twins (CPU path and Triton oracle) against first principles."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lioncub.kernels import reference as ref

from lioncub import methods
from lioncub.methods.vote_1bit import chunk_bytes


def codec(method):
    return methods.get(method).codec


def layout(method, N, levels=None):
    return methods.get(method).layout(N, levels or 0)


@given(nbytes=st.integers(0, 300), seed=st.integers(0, 2**31))
def test_pack_bits_is_numpy_packbits_little_endian(nbytes, seed):
    bits = np.random.default_rng(seed).integers(0, 2, size=8 * nbytes).astype(np.uint8)
    packed = ref.pack_bits(torch.from_numpy(bits))
    assert packed.dtype == torch.uint8
    assert packed.numpy().tolist() == np.packbits(bits, bitorder="little").tolist()
    assert ref.unpack_bits(packed).numpy().tolist() == bits.tolist()


def test_pack_bits_rejects_partial_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.pack_bits(torch.ones(12, dtype=torch.bool))


@settings(deadline=None)
@given(N=st.integers(1, 64), nbytes=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_vote_counts_plus_votes_per_bit(N, nbytes, seed):
    rows = np.random.default_rng(seed).integers(0, 256, size=(N, nbytes)).astype(np.uint8)
    plus = np.unpackbits(rows, axis=1, bitorder="little").sum(0).astype(int)
    sign, nonzero = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    ref.vote(torch.from_numpy(rows), sign, nonzero)
    assert np.unpackbits(sign.numpy(), bitorder="little").tolist() == (2 * plus > N).astype(int).tolist()
    assert np.unpackbits(nonzero.numpy(), bitorder="little").tolist() == (2 * plus != N).astype(int).tolist()


def _gm(n, seed=0, zeros=True):
    gen = torch.Generator().manual_seed(seed)
    g, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    if zeros:
        g[::7] = 0
        m[::7] = 0  # c == 0 exactly there
    return g, m


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 1001])
@pytest.mark.parametrize("parity", [0, 1])
def test_quantize_1bit_signs_and_zero_votes(n, parity):
    g, m = _gm(n)
    c = 0.9 * m + 0.1 * g
    m_ref = torch.mul(m, 0.99).add_(g, alpha=0.01)
    out = torch.empty(-(-n // 8) + 2, dtype=torch.uint8)  # padded, as in a 1-bit all-to-all buffer
    ref.quantize_pack(codec("vote-1bit"), g, m, out, beta1=0.9, beta2=0.99, zero_parity=parity)
    bits = np.unpackbits(out.numpy(), bitorder="little")[:n]
    idx = np.arange(n)
    want = np.where(c.numpy() > 0, 1, np.where(c.numpy() < 0, 0, (idx + parity) % 2 == 0))
    assert bits.tolist() == want.astype(int).tolist()
    assert torch.equal(m, m_ref)  # momentum updated in the same call


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8, 100])
def test_vote_pbit_fields_hold_sign_plus_one(N):
    g, m = _gm(301)
    lay = layout("vote-pbit", N)
    out = torch.empty(lay.words(301), dtype=getattr(torch, lay.dtype))
    c = torch.mul(m, 0.9).add_(g, alpha=0.1)
    ref.quantize_pack(codec("vote-pbit"), g, m, out, beta1=0.9, beta2=0.99, layout=lay)
    assert ref.unpack_fields(out, lay, 301).tolist() == (torch.sign(c) + 1).int().tolist()


def test_l1_levels_first_principles():
    # one tensor with mean |c| = 1 and s = 4: q = round_half_even(2c), clamped to [-4, 4]
    c = torch.tensor([0.25, -0.25, 0.75, 1.25, -3.0, 0.0, 1.5, 1.0])
    assert c.abs().mean() == 1.0
    s = 4
    offsets = [0, 8]
    sums = ref.segment_sums_abs(c, offsets)
    mult = ref.l1_multipliers(sums, offsets, s)
    q = ref.l1_levels(c.clone(), mult, offsets, s)
    want = [max(-s, min(s, round(2 * float(x)))) for x in c]  # Python's round() is half-to-even
    assert q.tolist() == want == [0, 0, 2, 2, -4, 0, 3, 2]


def test_l1_zero_tensor_gives_zero_levels_and_segments_are_per_tensor():
    c = torch.cat([torch.zeros(5), torch.tensor([1.0, -1.0, 3.0]), torch.tensor([100.0])])
    offsets = [0, 5, 8, 9]
    mult = ref.l1_multipliers(ref.segment_sums_abs(c, offsets), offsets, 2)
    assert mult[0] == 0  # mean |c| == 0 -> q == 0
    q = ref.l1_levels(c.clone(), mult, offsets, 2)
    assert q[:5].tolist() == [0] * 5
    assert q[5:8].tolist() == [1.0, -1.0, 2.0]  # mean 5/3: c*(1/(5/3)) = 0.6, -0.6, 1.8 -> 1, -1, 2
    assert q[8].item() == 1.0  # its own tensor: c / mean = 1 -> round(1.0) = 1


@pytest.mark.parametrize("method", ("vote-pbit", "avg-pbit", "l1-pbit"))
def test_decode_pbit_updates(method):
    N, s = 4, 3
    lay = layout(method, N, s if method == "l1-pbit" else None)
    # per-rank values already shifted: sums of 4 ranks
    shift = s if method == "l1-pbit" else 1
    per_rank = torch.tensor([[1, 0, 2, 1], [1, 0, 2, 2], [1, 2, 0, 0], [1, 2, 0, 0]]).T  # 4 ranks x 4 elems
    if method == "l1-pbit":
        per_rank = torch.tensor([[3, 0, 6, 4], [3, 0, 6, 5], [3, 6, 0, 0], [3, 6, 0, 1]]).T
    total = sum(ref.pack_fields(per_rank[r], lay, torch.empty(lay.words(4), dtype=getattr(torch, lay.dtype)))
                for r in range(N))
    U = ref.decode_update(codec(method), total, 4, world_size=N, levels=s, layout=lay)
    signed_sum = (per_rank - shift).sum(0).float()
    want = signed_sum / N if method == "avg-pbit" else torch.sign(signed_sum)
    assert torch.equal(U, want)


def test_decode_1bit_with_tie_plane():
    sign = ref.pack_bits(torch.tensor([1, 0, 1, 0, 1, 1, 0, 0], dtype=torch.uint8))
    nonzero = ref.pack_bits(torch.tensor([1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.uint8))
    U = ref.decode_update(codec("vote-1bit"), (sign, nonzero), 6, world_size=4)
    assert U.tolist() == [1, -1, 0, 0, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_is_decay_then_step_in_fp32(dtype):
    p = torch.randn(100).to(dtype)
    U = torch.sign(torch.randn(100))
    got = p.clone()
    ref.apply_update_(got, U, lr=0.01, wd=0.5)
    want = (p.double() * (1 - 0.005) - 0.01 * U.double()).to(dtype)
    assert (got.double() - want.double()).abs().max() <= 2 * torch.finfo(dtype).eps * 4


def test_lion_step_matches_lion_pytorch_bit_for_bit():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    q = torch.nn.Parameter(p.detach().clone())
    opt = lion_pytorch.Lion([q], lr=3e-3, weight_decay=0.2)
    m = torch.zeros(1000)
    for _ in range(10):
        g = torch.randn(1000)
        q.grad = g.clone()
        opt.step()
        ref.lion_step(p.data, g, m, lr=3e-3, wd=0.2, beta1=0.9, beta2=0.99)
    assert torch.equal(p, q)
    assert torch.equal(m, opt.state[q]["exp_avg"])


@pytest.mark.parametrize("method", ["vote-1bit", "vote-allgather", "vote-pbit", "avg-pbit", "l1-pbit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pieces_give_the_same_bits_as_one_pass(monkeypatch, method, dtype):
    """On a CPU the twins work in cache-sized pieces: cutting a bucket into many small pieces (crossing
    tensor and field-plane boundaries) must change nothing, bit for bit."""
    n, N, s_levels = 5000, 4, 5
    offsets = [0, 7, 1300, 1301, 4000, n]
    g, m = _gm(n, seed=3)
    p = torch.randn(n, generator=torch.Generator().manual_seed(9))
    g, m, p = g.to(dtype), m.to(dtype), p.to(dtype)
    lay = layout(method, N, s_levels) if method.endswith("pbit") else None
    results = []
    for piece in (1 << 30, 192):
        monkeypatch.setattr(ref, "PIECE", piece)
        mm, pp = m.clone(), p.clone()
        finite, mult = ref.prepass(codec(method), g, mm, beta1=0.9, offsets=offsets, levels=s_levels)
        if lay is None:
            out = torch.zeros(N * chunk_bytes(n, N), dtype=torch.uint8)
        else:
            out = torch.zeros(lay.words(n), dtype=getattr(torch, lay.dtype))
        ref.quantize_pack(codec(method), g, mm, out, beta1=0.9, beta2=0.99, zero_parity=1, layout=lay, mult=mult,
                          offsets=offsets, levels=s_levels)
        code = (out, out.flip(0)) if lay is None else out  # any agreed planes will do
        ref.unpack_apply(codec(method), pp, code, lr=0.01, wd=0.1, world_size=N, levels=s_levels, layout=lay)
        lion_p, lion_m = p.clone(), m.clone()
        ref.lion_step(lion_p, g, lion_m, lr=0.01, wd=0.1, beta1=0.9, beta2=0.99)
        results.append((finite, mult, out, mm, pp, lion_p, lion_m))
    (f1, m1, *a), (f2, m2, *b) = results
    assert f1 == f2
    if m1 is not None:
        assert torch.allclose(m1, m2, rtol=1e-6, atol=0)  # |c| sums grouped differently: ~1e-7
    for x, y in zip(a, b):
        assert torch.equal(x, y)
