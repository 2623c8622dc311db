"""Multi-rank scenarios for the agreement statistic and momentum_sync="adaptive" (spawned ranks import
this module)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lioncub import LionCub
from lioncub.optim import schedules

SHAPES = [(64, 33), (257,), (9, 9)]


def _model_and_opt(method: str, sync: str, overlap: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = LionCub(params, lr=0.01, weight_decay=0.1, method=method,
                  momentum_sync=schedules.parse(sync) if sync != "none" else None,
                  bucket_mb=4096 / 2**20, overlap=overlap)
    return params, opt


def _grads(params, rank: int, step: int, spread: float):
    """A shared signal plus a per-rank noise of `spread`: agreement falls as spread grows."""
    shared = torch.Generator().manual_seed(step)
    mine = torch.Generator().manual_seed(1000 * step + rank + 1)
    for p in params:
        g = torch.randn(p.shape, generator=shared) + spread * torch.randn(p.shape, generator=mine)
        p.grad = g


def _run(params, opt, rank, first, last, spread_of):
    out = []
    for step in range(first, last + 1):
        opt.zero_grad()
        _grads(params, rank, step, spread_of(step))
        opt.step()
        out.append(dict(agreement=opt.stats.last_agreement, syncs=opt.stats.momentum_syncs,
                        sent=opt.stats.last_bytes_sent))
    return out


def _spread(step: int) -> float:  # agree early, then disagree: adaptive must start syncing
    return 0.2 if step <= 8 else 6.0


def adaptive_run(rank, world_size, method, sync, steps, overlap=False):
    params, opt = _model_and_opt(method, sync, overlap)
    log = _run(params, opt, rank, 1, steps, _spread)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    out = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(out, flat)
    return dict(log=log, params=flat, replicas_equal=all(torch.equal(out[0], o) for o in out),
                total_sent=opt.stats.total_bytes_sent, state=opt.schedule.state_dict()
                if hasattr(opt.schedule, "state_dict") else None)


def adaptive_resume(rank, world_size, method, sync, steps, cut):
    params, opt = _model_and_opt(method, sync, False)
    _run(params, opt, rank, 1, cut, _spread)
    sd = opt.state_dict()
    saved = [p.detach().clone() for p in params]
    params2, opt2 = _model_and_opt(method, sync, False)
    with torch.no_grad():
        for p, s in zip(params2, saved):
            p.copy_(s)
    opt2.load_state_dict(sd)
    log = _run(params2, opt2, rank, cut + 1, steps, _spread)
    return dict(log=log, params=torch.cat([p.detach().reshape(-1) for p in params2]),
                state=opt2.schedule.state_dict())


def start_run(rank, world_size, method, sync, steps, snapshot):
    """A run's per-step log, its parameters after step `snapshot` and the guard's credit after each step."""
    params, opt = _model_and_opt(method, sync, True)
    log, snap = [], None
    for step in range(1, steps + 1):
        log += _run(params, opt, rank, step, step, _spread)
        log[-1]["credit"] = getattr(opt.schedule, "credit", None)
        if step == snapshot:
            snap = torch.cat([p.detach().reshape(-1) for p in params])
    return dict(log=log, snapshot=snap)
