"""A run's measurement beside its forecast (issue 27): step, compute (forward + backward as they ran), codec and
exposed communication, which component differs most, whether the step fell inside the forecast's interval, and,
when a compressed step is measured slower than the forecast dense step, what to do about it."""

from __future__ import annotations

import statistics

COMPONENTS = ("step", "compute", "codec", "exposed communication")


def measured_components(summary: dict) -> dict:
    """Seconds per step of each component, medians over the timed steps (train.loop.summarize's)."""
    records = summary.get("records") or []
    timed = records[2:] if len(records) > 4 else records
    exposed = [r["exposed_s"] for r in timed if r.get("exposed_s") is not None]
    out = {"step": summary["mean_step_seconds"], "compute": summary["compute_seconds"],
           "codec": summary["codec_seconds"]}
    if exposed:
        out["exposed communication"] = statistics.median(exposed)
    return out


def forecast_components(result) -> dict:
    """The same components of a StepResult (with a host: compute as it ran beside the codec and collectives)."""
    c = result.contention or {}
    return {"step": result.step_seconds, "compute": c.get("compute", result.compute_seconds),
            "codec": result.codec_seconds, "exposed communication": result.exposed_communication_seconds}


def compare(summary: dict, result, compressed: bool) -> dict:
    """The comparison `lioncub train` prints: per component measured, forecast and their difference (seconds);
    the component that differs most; the step's place against the interval; a remedy where one is due."""
    meas, fore = measured_components(summary), forecast_components(result)
    rows = [dict(component=k, measured=meas[k], forecast=fore[k], difference=meas[k] - fore[k])
            for k in COMPONENTS if k in meas]
    parts = [r for r in rows if r["component"] != "step"] or rows
    worst = max(parts, key=lambda r: abs(r["difference"]))["component"]
    band = result.step_interval
    out = dict(rows=rows, differs_most=worst, step_error=meas["step"] / fore["step"] - 1, interval=band,
               inside=None if band is None else band[0] <= meas["step"] <= band[1], remedy=None)
    if compressed and meas["step"] > result.baseline_step_seconds:
        out["remedy"] = (f"the compressed step measured {1e3 * meas['step']:.1f} ms, slower than the forecast dense "
                         f"step ({1e3 * result.baseline_step_seconds:.1f} ms): calibrate this machine (`lioncub demo` "
                         f"or `lioncub calibrate`), or choose another method (`lioncub autotune`)")
    return out


def format_comparison(c: dict) -> str:
    lines = ["  forecast vs measured (per step):"]
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


__all__ = ["compare", "format_comparison", "forecast_components", "measured_components"]
