"""How much the ranks agreed on a step, read off the agreed code (no extra communication).

The statistic is a function of the agreed code alone, which is identical on every rank, so every rank
computes the same number (`LionCub.stats.last_agreement`) and can take decisions on it without talking
(`momentum_sync="adaptive"`). It is computed in torch on a strided sample of the code (about
`SAMPLE` elements per bucket), beside the kernels, whose fast path it does not touch.

* p-bit fields of votes (vote-pbit, avg-pbit): the vote margin |sum of signs| / N, averaged over the
  sampled coordinates (1: every rank voted the same sign everywhere; 0: every coordinate tied).
* p-bit fields of L1 levels (l1-pbit): |sum of levels| / (N s), the same margin weighted by each rank's
  magnitude level (1: every rank at its top level with the same sign).
* 1-bit votes (vote-1bit, vote-allgather): the agreed code holds only the majority sign and, for an even
  N, the not-a-tie plane, so the margin is not there; the tie fraction is. With independent fair-coin votes
  a share t0 = C(N, N/2) / 2^N of the coordinates tie (0.5 at N = 2, 0.375 at N = 4, 0.27 at N = 8), with
  unanimous ranks none: agreement = 1 - ties / t0, clipped to [0, 1]. For an odd N nothing in the code
  tells a 3:2 vote from a 5:0 one, and the statistic is None.
"""

from __future__ import annotations

import math

import torch

SAMPLE = 4096  # coordinates per bucket the statistic reads (strided; all of them in smaller buckets)
_POPCOUNT: dict = {}


def tie_share_at_random(world_size: int) -> float:
    """The share of ties among N independent fair-coin votes (0 for odd N)."""
    N = world_size
    return 0.0 if N % 2 else math.comb(N, N // 2) / 2**N


def _popcount_table(device) -> torch.Tensor:
    t = _POPCOUNT.get(device)
    if t is None:
        t = _POPCOUNT[device] = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32,
                                             device=device)
    return t


def bucket_sums(codec, code, n: int, world_size: int, levels: int = 0, layout=None,
                sample: int = SAMPLE) -> tuple[float, int] | None:
    """(sum of the per-coordinate statistic, coordinates read) for one bucket's agreed code, or None where
    the code carries no agreement information (1-bit votes of an odd number of ranks)."""
    N = world_size
    if n <= 0:
        return 0.0, 0
    if codec.kind == "signs":
        nonzero = code[1]
        if nonzero is None:
            return None
        full = n // 8  # whole bytes (the last partial byte and the padding are left out)
        if full == 0:
            return 0.0, 0
        stride = max(1, full * 8 // sample)
        picked = nonzero[:full:stride]
        ones = int(_popcount_table(picked.device)[picked.long()].sum())
        read = picked.numel() * 8
        ties = read - ones
        share = ties / read / tie_share_at_random(N)
        return max(0.0, 1.0 - share) * read, read
    W = code.numel()
    stride = max(1, (W * layout.per_word) // sample)
    idx = torch.arange(0, W, stride, device=code.device)
    words = code[idx]
    mask = (1 << layout.width) - 1
    offset = codec.offset(N, levels)
    scale = N * (levels if codec.l1 else 1)
    total, count = 0.0, 0
    for j in range(layout.per_word):
        valid = idx + j * W < n
        if not bool(valid.any()):
            break
        f = torch.bitwise_right_shift(words, layout.width * j).bitwise_and_(mask)[valid]
        total += float((f.double() - offset).abs_().sum()) / scale
        count += f.numel()
    return total, count


def agreement(codec, codes, sizes, world_size: int, levels: int = 0, layouts=None) -> float | None:
    """The step's agreement in [0, 1] over its buckets' agreed codes (weighted by coordinates read)."""
    if codec is None or world_size < 2:
        return None
    total, count = 0.0, 0
    for i, (code, n) in enumerate(zip(codes, sizes)):
        got = bucket_sums(codec, code, n, world_size, levels, None if layouts is None else layouts[i])
        if got is None:
            return None
        total, count = total + got[0], count + got[1]
    return min(1.0, total / count) if count else None
