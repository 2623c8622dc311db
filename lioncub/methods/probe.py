"""One bucket of a method exactly as LionCub runs it, on a realistic random payload: what the lab's probes
(`lioncub lab bench`) and calibration time."""

from __future__ import annotations

from collections.abc import Callable

from lioncub.methods import get

MOMENTUM_SYNC = "momentum-sync"  # the fp32 all-reduce of a bucket's momenta (not a method)


def composite_op(method: str, n_elements: int, group=None, levels: int | None = None,
                 device="cpu") -> Callable[[], None]:
    """A callable running one bucket's collectives (after encoding the payload once with the method's own
    pipeline); for MOMENTUM_SYNC the fp32 all-reduce of the bucket."""
    import torch

    from lioncub.comm import transport

    rank, N = transport.group_rank_size(group)
    gen = torch.Generator().manual_seed(1234 + rank)
    g = torch.randn(n_elements, generator=gen).to(device)
    if method == MOMENTUM_SYNC:
        return lambda: transport.allreduce_mean_(g, group)
    spec = get(method)
    lv = spec.resolve_levels(N, levels if spec.uses_levels else None)
    x = spec.exchange(n_elements, device, group, levels=lv, grads=g)
    if not spec.dense:
        m = torch.randn(n_elements, generator=gen).to(device)
        x.encode(g, m, beta1=0.9, beta2=0.99, offsets=[0, n_elements])
    return x
