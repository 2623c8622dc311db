"""Multi-rank scenarios of tests/optim/test_runs.py: step() exchanging runs of adjacent automatic buckets
against the same buckets exchanged one by one."""

from __future__ import annotations

import dist_cases
import torch

from lioncub import LionCub
from lioncub.comm import wire


def steps(rank: int, world_size: int, method: str, merged: bool, overlap: bool, n_steps: int = 3,
          run_bytes: float = 1e6, momentum_sync=None) -> dict:
    """n_steps of LionCub over dist_cases' parameters (several tiny buckets per group), gradients set by hand.
    merged: the buckets are automatic (so step() may exchange runs of them, of at most run_bytes); else the
    same buckets are given explicitly (bucket_mb), which step() exchanges one by one."""
    wire.auto_bucket_mb = lambda total: dist_cases.BUCKET_MB  # the automatic buckets: as many as the explicit
    wire.STEP_RUN_MB = run_bytes / 2**20
    params, groups = dist_cases.make_params()
    opt = LionCub(groups, lr=dist_cases.LR, weight_decay=dist_cases.WD, method=method, overlap=overlap,
                  bucket_mb=None if merged else dist_cases.BUCKET_MB, momentum_sync=momentum_sync)
    collectives = []
    for step in range(1, n_steps + 1):
        dist_cases.assign(params, dist_cases.make_grads(params, rank, step), step)
        opt.step()
        collectives.append(opt.stats.last_collectives)
    return dict(params=[p.detach().clone() for p in params],
                momenta=[opt.state[p]["exp_avg"].clone() for p in params],
                buckets=len(opt.engine.buckets), collectives=collectives,
                replicas_equal=all(torch.equal(a, dist_cases.flat(params))
                                   for a in dist_cases.gather(dist_cases.flat(params))))
