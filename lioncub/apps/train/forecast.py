"""A run's measurement beside its forecast (issue 27): step, compute (forward + backward as they ran), codec and
exposed communication, which component differs most, whether the step fell inside the forecast's interval, and,
when a compressed step is measured slower than the forecast dense step, what to do about it."""

from __future__ import annotations

import statistics

COMPONENTS = ("step", "compute", "codec", "exposed communication")


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


def forecast_components(result) -> dict:
    """The same components of a StepResult (with a host: compute as it ran beside the codec and collectives)."""
    c = result.contention or {}
    return {"step": result.step_seconds, "compute": c.get("compute", result.compute_seconds),
            "codec": result.codec_seconds, "exposed communication": result.exposed_communication_seconds}


def forecast_of(result) -> dict:
    """What a run's ranks need of its forecast to compare as they go (JSON-able)."""
    return dict(components=forecast_components(result), interval=result.step_interval,
                dense_step=result.baseline_step_seconds)


def compare(summary: dict, result, compressed: bool) -> dict:
    """The comparison `lioncub train` prints at the end of a run (see compare_components)."""
    return compare_components(measured_components(summary), forecast_of(result), compressed)


def compare_components(meas: dict, forecast: dict, compressed: bool) -> dict:
    """Per component measured, forecast and their difference (seconds); the component that differs most; the
    step's place against the interval; a remedy where one is due."""
    fore, band, dense = forecast["components"], forecast["interval"], forecast["dense_step"]
    rows = [dict(component=k, measured=meas[k], forecast=fore[k], difference=meas[k] - fore[k])
            for k in COMPONENTS if k in meas]
    parts = [r for r in rows if r["component"] != "step"] or rows
    worst = max(parts, key=lambda r: abs(r["difference"]))["component"]
    out = dict(rows=rows, differs_most=worst, step_error=meas["step"] / fore["step"] - 1, interval=band,
               inside=None if band is None else band[0] <= meas["step"] <= band[1], remedy=None)
    if compressed and meas["step"] > dense:
        out["remedy"] = (f"the compressed step measured {1e3 * meas['step']:.1f} ms, slower than the forecast dense "
                         f"step ({1e3 * dense:.1f} ms): calibrate this machine (`lioncub demo` "
                         f"or `lioncub calibrate`), or choose another method (`lioncub autotune`)")
    return out


def format_comparison(c: dict, when: str = "per step") -> str:
    lines = [f"  forecast vs measured ({when}):"]
    for r in c["rows"]:
        lines.append(f"    {r['component']:<22} measured {1e3 * r['measured']:8.1f} ms   forecast "
                     f"{1e3 * r['forecast']:8.1f} ms   {1e3 * r['difference']:+8.1f} ms")
    where = ""
    if c["interval"]:
        lo, hi = c["interval"]
        where = f", {'inside' if c['inside'] else 'outside'} the forecast's {1e3 * lo:.1f}-{1e3 * hi:.1f} ms"
    lines.append(f"    step {c['step_error']:+.0%} against the forecast{where}; {c['differs_most']} differs most")
    if c["remedy"]:
        lines.append(f"    {c['remedy']}")
    return "\n".join(lines)


__all__ = ["compare", "compare_components", "forecast_components", "forecast_of", "format_comparison",
           "measured_components", "so_far"]
