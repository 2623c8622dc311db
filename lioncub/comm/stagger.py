"""The schedule of streamed outer steps (LionCub(local_steps=H, fragments=F, outer_delay=D)), shared by the
optimizer (lioncub.optim.streaming) and the step model (lioncub.simulator.localsteps): which buckets make each
fragment, and at which inner step each fragment's exchange is launched. Pure Python."""

from __future__ import annotations


def split(sizes: list[int], F: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 cut into F non-empty runs whose sums are about total / F each: cut j falls
    where the running sum is nearest j * total / F."""
    if F > len(sizes):
        raise ValueError(f"fragments={F} is more than the optimizer's {len(sizes)} buckets: use fewer fragments or a "
                         "smaller bucket_mb")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cuts = [0]
    for j in range(1, F):
        lo, hi = cuts[-1] + 1, len(sizes) - (F - j)
        cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] * F - j * prefix[-1]), i)))
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]


def offsets(H: int, F: int) -> list[int]:
    """Fragment f is launched after every inner step t with t % H == offsets(H, F)[f]."""
    return [((f + 1) * H // F) % H for f in range(F)]


def default_delay(H: int, F: int) -> int:
    """outer_delay when none is given: 1 when the fragments are staggered (1 < F < H), else 0."""
    return int(1 < F < H)
