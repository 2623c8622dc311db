"""The schedule of streamed outer steps (LionCub(local=LocalSteps(H, fragments=F, delay=D))), shared by the
optimizer (lioncub.optim.local) and the step model (lioncub.simulator.localsteps): which buckets make each
fragment, and at which inner step each fragment's exchange is launched. Pure Python."""

from __future__ import annotations

import numbers


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


def check_options(fragments, outer_delay, local_steps, names=("fragments", "outer_delay", "local_steps")):
    """(fragments, outer_delay): (F, D), or None without fragments; one-line errors that call the three by
    `names` (the caller's spelling: LionCub's LocalSteps, simulate_step). D defaults to 1 when the fragments are
    staggered (1 < F < H), else 0."""
    f_name, d_name, h_name = names
    if fragments is None:
        if outer_delay is not None:
            raise ValueError(f"{d_name} applies only with {f_name}=F (streamed outer steps)")
        return None
    if local_steps is None:
        raise ValueError(f"{f_name} applies only with {h_name}=H (it streams the outer steps of local steps)")
    if isinstance(fragments, bool) or not isinstance(fragments, numbers.Integral) or not 1 <= fragments <= local_steps:
        raise ValueError(f"{f_name} must be an int in [1, {h_name}={local_steps}], got {fragments!r}")
    delay = int(1 < fragments < local_steps) if outer_delay is None else outer_delay
    if isinstance(delay, bool) or not isinstance(delay, numbers.Integral) or not 0 <= delay * fragments < local_steps:
        raise ValueError(f"{d_name} must be an int >= 0 below {h_name} / {f_name} = {local_steps}/{fragments}, "
                         f"got {outer_delay!r}")
    return int(fragments), int(delay)
