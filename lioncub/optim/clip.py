"""Gradient clipping by one coefficient that is the same on every rank (LionCub.clip_grad_norm_)."""

from __future__ import annotations

import math

import torch

from lioncub.comm.transport import agree_control
from lioncub.optim.passes import total_sum_squares


@torch.no_grad()
def clip_grad_norm_(engine, max_norm: float, eps: float = 1e-6) -> float:
    """See LionCub.clip_grad_norm_."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    buckets = engine.buckets
    if not buckets:
        return 0.0
    engine.wants_sumsq = True
    dense = engine.next_method().dense
    done = engine.pending_pass()
    if done is None:
        if dense and engine.world_size > 1:
            engine.average_now()
            done = engine.pending_pass()
        else:
            buckets.collect()
    copies = engine.layout.norm_copies(dense)
    if copies is None:
        norm = math.sqrt(float(total_sum_squares(buckets)))
    else:
        total = None if done is None or dense else done.sumsq_total  # (a dense pass's sums precede its mean)
        if total is None:
            _, total, _ = agree_control(0, total_sum_squares(buckets), engine.layout.group, buckets.device)
        norm = math.sqrt(total / copies)
    coef = max_norm / (norm + eps)
    if math.isfinite(norm) and coef < 1.0:
        if engine.backward_check is not None:
            engine.backward_check.scale(buckets, coef)
        else:
            buckets.scale_(coef)
        engine.rescaled(done)
    return norm
