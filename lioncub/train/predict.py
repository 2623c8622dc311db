"""Predicted step time of a training run, from the calibrated simulator (what `lioncub train --json` reports
as `predicted_step_seconds`)."""

from __future__ import annotations

from lioncub import schedules


def momentum_interval(spec: str, steps: int) -> int | None:
    """The every-K interval with the same sync rate as the schedule `spec` over `steps` steps."""
    schedule = schedules.resolve(schedules.parse(spec))
    rate = schedule.rate(steps)
    return None if rate <= 0 else max(1, round(1 / rate))


def predict_step(cfg, params: int, compute_seconds: float, *, ranks: int, bandwidth, ranks_per_host: int = 1,
                 latency=0.0, profile=None):
    """simulate_step for a LionCub run of `cfg` (a TrainConfig) on `ranks` ranks over links of `bandwidth`:
    communication inside step() (no overlap with backward), the lab's calibrated Gloo profile by default."""
    from lioncub.simulator import Cluster, simulate_step

    if profile is None:
        from lioncub.calibrate import default_lab_profile

        profile = default_lab_profile()
    cluster = Cluster.for_ranks(ranks, ranks_per_host, bandwidth=bandwidth, latency=latency)
    return simulate_step(cluster, cfg.method, params, momentum_interval(cfg.momentum_sync, cfg.steps),
                         cfg.bucket_mb, compute_seconds, backend=profile, levels=cfg.levels,
                         grad_dtype=cfg.grad_wire_dtype, overlap=False)
