"""A `lioncub train` run's measurement beside its forecast (the comparison itself: lioncub.optim.stats)."""

from __future__ import annotations

import statistics

from lioncub.optim.stats import compare_components, forecast_components, forecast_of, format_comparison


def measured_components(summary: dict) -> dict:
    """Seconds per step of each component, medians over the timed steps (train.loop.summarize's)."""
    out = so_far(summary.get("records") or [])
    out.update({"step": summary["mean_step_seconds"], "compute": summary["compute_seconds"],
                "codec": summary["codec_seconds"]})
    return out


def so_far(records: list[dict]) -> dict:
    """The components of the steps recorded so far (train.loop's records; the first two skipped once there are
    more than four): the mean step, the other components' medians."""
    timed = records[2:] if len(records) > 4 else records
    if not timed:
        return {}
    out = {"step": statistics.fmean(r["step_s"] for r in timed),
           "compute": statistics.median(r["compute_s"] for r in timed),
           "codec": statistics.median(r["codec_s"] for r in timed)}
    exposed = [r["exposed_s"] for r in timed if r.get("exposed_s") is not None]
    if exposed:
        out["exposed communication"] = statistics.median(exposed)
    return out


def compare(summary: dict, result, compressed: bool) -> dict:
    """The comparison `lioncub train` prints at the end of a run (see compare_components)."""
    return compare_components(measured_components(summary), forecast_of(result), compressed)


__all__ = ["compare", "compare_components", "forecast_components", "forecast_of", "format_comparison",
           "measured_components", "so_far"]
