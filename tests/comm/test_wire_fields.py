"""p-bit field packing is overflow-free for any world size: proved by the layout inequalities and checked
by summing real packed words for N ranks at the extremes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lioncub.kernels import reference as ref

from lioncub import methods
from lioncub.comm import wire

PBIT_METHODS = [m for m, spec in methods.REGISTRY.items() if spec.codec is not None and spec.codec.kind == "fields"]

world_sizes = st.integers(min_value=1, max_value=4096)


@given(N=world_sizes, method=st.sampled_from(PBIT_METHODS))
def test_layout_inequalities(N, method):
    lay = methods.get(method).layout(N)
    usable = {8: 8, 32: 31, 64: 63}[lay.word_bits]
    assert N * lay.max_value < 2**lay.width  # a field's sum never carries
    assert lay.width * lay.per_word <= usable  # a word's sum never overflows or turns negative
    assert lay.width == (N * lay.max_value).bit_length()  # and the field is no wider than needed


@given(N=world_sizes, levels=st.integers(min_value=1, max_value=2**20))
def test_l1_levels_fit_or_refuse(N, levels):
    try:
        lay = methods.get("l1-pbit").layout(N, levels)
    except ValueError as exc:
        assert (N * 2 * levels).bit_length() > wire.MAX_FIELD_WIDTH, exc
        return
    assert N * 2 * levels < 2**lay.width


@settings(max_examples=60, deadline=None)
@given(N=world_sizes, method=st.sampled_from(PBIT_METHODS), n=st.integers(1, 300),
       seed=st.integers(0, 2**31), extreme=st.booleans())
def test_summed_words_give_exact_per_field_counts(N, method, n, seed, extreme):
    """Pack N ranks' values (all at the maximum when `extreme`), sum the words in the word dtype as the
    all-reduce does, and compare the unpacked sums with exact integer sums."""
    lay = methods.get(method).layout(N)
    rng = np.random.default_rng(seed)
    reps = min(N, 64)  # N distinct ranks would be slow; repeat a few distinct contributions
    values = rng.integers(0, lay.max_value + 1, size=(reps, n))
    if extreme:
        values[:] = lay.max_value
    counts = np.bincount(np.arange(N) % reps, minlength=reps)  # rank r contributes values[r % reps]
    dtype = getattr(torch, lay.dtype)
    total = torch.zeros(lay.words(n), dtype=dtype)
    exact = np.zeros(n, dtype=object)
    for r in range(reps):
        words = ref.pack_fields(torch.from_numpy(values[r]), lay, torch.empty(lay.words(n), dtype=dtype))
        total += words * int(counts[r])  # the SUM all-reduce, in the word dtype
        exact += values[r].astype(object) * int(counts[r])
    # no word exceeded the usable range, so the dtype arithmetic equals exact arithmetic
    assert int(total.to(torch.int64).max()) < 2 ** (lay.word_bits - (lay.dtype != "uint8"))
    got = ref.unpack_fields(total, lay, n)
    assert got.tolist() == [int(x) for x in exact]


def test_field_width_follows_world_size():
    assert methods.get("vote-pbit").layout(4).width == 4  # sums 0..8
    assert methods.get("vote-pbit").layout(3).width == 3  # sums 0..6
    assert methods.get("l1-pbit").layout(8).width == 8  # levels 15: sums 0..240
    assert methods.get("vote-pbit").layout(4096).width == 14


def test_wire_volume_per_method():
    # fp32 ring all-reduce sends 2(N-1)/N*32 bits per parameter; the 1-bit all-reduce 1.5 bits (N even)
    assert methods.get("allreduce").wire_bits_per_element(4) == pytest.approx(48)
    assert methods.get("vote-1bit").wire_bits_per_element(4) == pytest.approx(0.75 * 3)
    assert methods.get("vote-1bit").wire_bits_per_element(5) == pytest.approx(0.8 * 2)
    assert methods.get("vote-allgather").wire_bits_per_element(8) == pytest.approx(7)
    onebit, dense = methods.get("vote-1bit"), methods.get("allreduce")
    assert 1 - onebit.wire_bits_per_element(4) / dense.wire_bits_per_element(4) >= 0.95


def test_bad_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown method 'sign'"):
        methods.check("sign")
    with pytest.raises(ValueError, match="choose one of: allreduce, vote-allgather"):
        methods.get(None)
