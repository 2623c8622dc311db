"""Runs: adjacent buckets exchanged as one when nothing can overlap.

The automatic buckets (about 8 of 1-25 MiB, lioncub.comm.wire.auto_bucket_mb) are cut so that the first ones'
exchange overlaps the rest of backward. When step() itself communicates (overlap=False, or gradients set
without a backward), nothing overlaps and every extra bucket only adds its collectives' fixed costs, so
step() exchanges runs of adjacent buckets of up to wire.STEP_RUN_MB as one.

A run is its buckets' own memory: they lie back to back in one flat buffer per param group, dtype and device,
each starting on a multiple of BUCKET_ALIGN elements, where the kernels start their pieces and tiles; a gap
between two buckets is a segment of its own (zero gradient, zero momentum, no parameter). Every method's code
is per coordinate and its L1 scales are per segment, so each coordinate gets the bits it gets when its bucket
is exchanged alone, in fewer collectives (tested). Only the agreement statistic differs: it samples the run.
The dense method's fp32 all-reduce of a run sums each coordinate in another order than its bucket's (the
collective cuts its buffer into per-rank chunks), so a dense step over runs is equal to rounding, and, as
always, identical on every rank.
"""

from __future__ import annotations

import torch

from lioncub.optim.buckets import BUCKET_ALIGN


class Run:
    """Buckets `members` (consecutive indices, back to back in memory) as one exchange: the fields of a
    Bucket that an exchange, the codec and the update read."""

    shards = None

    def __init__(self, buckets, members: list[int]):
        first, last = buckets[members[0]], buckets[members[-1]]
        P, G, M = first.base
        lo, hi = first.start, last.start + last.n
        self.members, self.group_index, self.order = tuple(members), first.group_index, first.order
        self.p, self.g, self.m = P[lo:hi], G[lo:hi], M[lo:hi]
        self.n = self.shard = hi - lo
        bounds, self._parts = [0], []  # _parts, in order: each bucket's index, None for the padding before one
        for k in members:
            b = buckets[k]
            at = b.start - lo
            if at > bounds[-1]:
                bounds.append(at)  # the padding before bucket k: a segment of its own
                self._parts.append(None)
            bounds += [at + o for o in b.offsets[1:]]
            self._parts.append(k)
        self.offsets = bounds

    def joined(self, per_bucket: list) -> torch.Tensor:
        """A per-segment tensor of the run from its buckets' (`per_bucket[k]`: one value per parameter tensor of
        bucket k), 0 for the padding between them."""
        zero = per_bucket[self.members[0]].new_zeros(1)
        return torch.cat([zero if k is None else per_bucket[k] for k in self._parts])


def plan(buckets, cap_bytes: int) -> list[list[int]] | None:
    """The runs of `buckets` (lists of bucket indices, ordered by their first bucket), each at most `cap_bytes`
    of parameters unless one bucket alone is larger; None where the buckets are not flat slices of shared
    buffers (node layout, FSDP). Param groups and dtypes interleave in backward's order, so a run collects the
    next buckets of its own buffer."""
    if not buckets or any(b.base is None for b in buckets):
        return None
    runs: list[list[int]] = []
    open_runs: dict[int, tuple[list[int], int]] = {}  # buffer -> (its latest run, that run's bytes)
    for k, b in enumerate(buckets):
        run, size = open_runs.get(id(b.base[0]), (None, 0))
        if run is not None and b.start == _align_up(buckets[run[-1]].start + buckets[run[-1]].n) \
                and size + _bytes(b) <= cap_bytes:
            run.append(k)
        else:
            run, size = [k], 0
            runs.append(run)
        open_runs[id(b.base[0])] = (run, size + _bytes(b))
    return runs


def _bytes(b) -> int:
    return b.n * b.p.element_size()


def _align_up(n: int) -> int:
    return -(-n // BUCKET_ALIGN) * BUCKET_ALIGN
