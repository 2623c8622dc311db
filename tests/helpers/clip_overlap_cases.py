"""Multi-rank scenarios of clipping with the overlap (issue 51, item 2; lioncub.optim.clipping)."""

from __future__ import annotations

import torch
from dist_cases import flat
from safe_cases import BUCKET_MB, LR, _layout, batch, listen, model, momenta, replicas_equal

from lioncub import LionCub


def run(rank, world_size, method, exact, clips=(1e-3, 1e-3, 1e-3), overlap=True):
    """One step per entry of `clips`: opt.clip_grad_norm_(max_norm, exact=exact) before it, or no clip (None)."""
    log = listen()
    net = model()
    name, layout = _layout(method)
    opt = LionCub(net.parameters(), lr=LR, method=name, overlap=overlap, bucket_mb=BUCKET_MB, **layout)
    for step, max_norm in enumerate(clips, 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if max_norm is not None:
            assert opt.clip_grad_norm_(max_norm, exact=exact) > max_norm  # (it bites)
        opt.step()
    params = flat(net.parameters())
    return dict(params=params, momenta=momenta(opt, net), replicas_equal=replicas_equal(params),
                overlapped=opt.stats.overlapped_steps, warned=any("changed after backward" in m for m in log.messages))


def both(rank, world_size, method, clips):
    return {exact: run(rank, world_size, method, exact, clips) for exact in (False, True)}
