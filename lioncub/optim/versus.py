"""A measured step beside its forecast: step, compute, codec and exposed communication, which component differs
most, whether the step fell inside the forecast's interval, and, when a compressed step is measured slower than
the forecast dense step, what to do about it. `lioncub train` prints it (lioncub.apps.train.forecast);
`opt.stats.versus(forecast)` gives it for any loop with LionCub(timing=True)."""

from __future__ import annotations

COMPONENTS = ("step", "compute", "codec", "exposed communication")


class Comparison(dict):
    """compare_components' dict, printed as format_comparison's lines."""

    def __str__(self) -> str:
        return format_comparison(self)


def forecast_components(result) -> dict:
    """The same components of a StepResult (with a host: compute as it ran beside the codec and collectives)."""
    c = result.contention or {}
    return {"step": result.step_seconds, "compute": c.get("compute", result.compute_seconds),
            "codec": result.codec_seconds, "exposed communication": result.exposed_communication_seconds}


def forecast_of(result) -> dict:
    """What a run's ranks need of its forecast to compare as they go (JSON-able)."""
    return dict(components=forecast_components(result), interval=result.step_interval,
                dense_step=result.baseline_step_seconds)


def compare_components(meas: dict, forecast: dict, compressed: bool) -> dict:
    """Per component measured, forecast and their difference (seconds); the component that differs most; the
    step's place against the interval; a remedy where one is due."""
    fore, band, dense = forecast["components"], forecast["interval"], forecast["dense_step"]
    rows = [dict(component=k, measured=meas[k], forecast=fore[k], difference=meas[k] - fore[k])
            for k in COMPONENTS if k in meas]
    parts = [r for r in rows if r["component"] != "step"] or rows
    worst = max(parts, key=lambda r: abs(r["difference"]))["component"]
    out = Comparison(rows=rows, differs_most=worst, step_error=meas["step"] / fore["step"] - 1, interval=band,
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
