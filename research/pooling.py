"""`python -m research bench pool RUN.json ...`: several `bench train` runs pooled, row by row.

One lab run is one draw: the same command on the same machine gave vote-1bit 6.7x to 9.0x over torch DDP + Lion
at 100 Mbit/s, mostly because the compute per step moved (86 to 174 ms). This reports each configuration at each
link rate as the median and range over the runs given, beside the compute per step they were measured at (each
run's calibrated compute, every rank computing), the measured step and, where the runs forecast it, the forecast's
error; `--plot` draws each configuration's speedup against the compute per step.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

from lioncub.apps.benchmarks.train import row_label
from lioncub.files import read_json


def load(paths: list[str]) -> list[tuple[str, dict, dict]]:
    """(path, the JSON, one of its results) for every result of every `bench train` JSON in `paths`; one-line
    errors for a missing file or one that is not a `bench train` JSON."""
    out = []
    for path in paths:
        data = read_json(path, "bench train result")
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) and "rows" in r for r in results):
            raise ValueError(f"{path}: not a `lioncub bench train --json` result (no results with rows)")
        out += [(path, data, r) for r in results]
    if not out:
        raise ValueError("no runs to pool: give one or more `lioncub bench train --json` files")
    return out


def _row_label(row: dict) -> str:
    label = row_label(row["method"], row.get("momentum_sync", "none"), row.get("hierarchical", False))
    return label + (" in DDP" if row.get("ddp_hook") else "")


def _spread(values: list[float]) -> dict | None:
    return dict(median=statistics.median(values), low=min(values), high=max(values)) if values else None


def pool(runs: list[tuple[str, dict, dict]]) -> list[dict]:
    """One entry per (model, ranks, ranks per host, link rate, configuration) in the order first met: its runs, the
    spread (median, low, high) of its speedup over its run's baseline row, measured step, the run's compute per
    step and the forecast's error (predicted / measured - 1), and the files."""
    groups: dict[tuple, dict] = {}
    for path, data, res in runs:
        base = res.get("baseline")
        if isinstance(base, str) and "@" not in base:  # JSON before the labels named the momentum sync
            base += "@none"
        for row in res["rows"]:
            label = _row_label(row)
            key = (data.get("model"), res.get("ranks"), res.get("ranks_per_host", 1), res["bandwidth"], label)
            g = groups.setdefault(key, dict(model=key[0], ranks=key[1], ranks_per_host=key[2], bandwidth=key[3],
                                            config=label, baseline=base, speedup=[], step=[], compute=[],
                                            error=[], files=[], points=[]))
            if g["baseline"] is None:
                g["baseline"] = base
            elif base is not None and g["baseline"] != base:
                g["baseline"] = "mixed"
            step, pred = row.get("mean_step_seconds"), row.get("predicted_step_seconds")
            if not (isinstance(step, (int, float)) and step > 0):
                continue  # a row whose run failed
            g["step"].append(step)
            g["files"].append(path)
            compute, speedup = res.get("compute_seconds"), row.get("speedup")
            if isinstance(compute, (int, float)):
                g["compute"].append(compute)
            if isinstance(speedup, (int, float)) and math.isfinite(speedup):
                g["speedup"].append(speedup)
                if isinstance(compute, (int, float)):
                    g["points"].append((compute, speedup))  # the plot's: both from the same run
            if isinstance(pred, (int, float)) and pred > 0:
                g["error"].append(pred / step - 1)
    out = []
    for g in groups.values():
        if not g["step"]:
            continue
        within = sum(abs(e) <= 0.10 for e in g["error"])
        out.append(dict(g, runs=len(g["step"]), speedup=_spread(g["speedup"]), step=_spread(g["step"]),
                        compute=_spread(g["compute"]), error=_spread(g["error"]), within_10pct=within,
                        forecasts=len(g["error"])))
    return out


def _x(s: dict | None, fmt: str, scale: float = 1.0) -> str:
    if s is None:
        return "-"
    mid, lo, hi = (scale * s[k] for k in ("median", "low", "high"))
    return f"{mid:{fmt}} ({lo:{fmt}}-{hi:{fmt}})" if lo != hi else f"{mid:{fmt}}"


def format_table(groups: list[dict]) -> str:
    lines = ["| model | ranks | link | configuration | runs | speedup over the baseline | step, ms | "
             "compute per step, ms | forecast error (as forecast then) | forecasts within 10% |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for g in groups:
        ranks = f"{g['ranks']}" + (f" ({g['ranks_per_host']}/host)" if g["ranks_per_host"] != 1 else "")
        err = "-" if g["error"] is None else (f"{100 * g['error']['median']:+.1f}% "
                                              f"({100 * g['error']['low']:+.1f}..{100 * g['error']['high']:+.1f}%)")
        within = f"{g['within_10pct']} of {g['forecasts']}" if g["forecasts"] else "-"
        lines.append(f"| {g['model']} | {ranks} | {g['bandwidth']} | {g['config']} | {g['runs']} | "
                     f"{_x(g['speedup'], '.2f')}x | {_x(g['step'], '.0f', 1e3)} | {_x(g['compute'], '.0f', 1e3)} | "
                     f"{err} | {within} |")
    bases = sorted({str(g["baseline"]) for g in groups if g["baseline"] is not None})
    lines.append(f"\nspeedup: the run's baseline row ({', '.join(bases) or 'unnamed'}) over the row, each run on its "
                 "own; median (least-greatest) over the runs; forecast error: predicted / measured - 1 by the step "
                 "model of the run's day")
    return "\n".join(lines)


def plot(groups: list[dict], path: str, configs: list[str] | None = None) -> None:
    """Each configuration's speedup against its runs' compute per step, one panel per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [g for g in groups if g["points"] and (configs is None or g["config"].split("@")[0] in configs)]
    rates = list(dict.fromkeys(g["bandwidth"] for g in shown))
    if not rates:
        raise ValueError("nothing to plot: no configuration with both a speedup and a compute per step"
                         + (f" among {', '.join(configs)}" if configs else ""))
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for g in (g for g in shown if g["bandwidth"] == rate):
            xs, ys = zip(*g["points"])
            ax.scatter([1e3 * x for x in xs], ys, s=18, label=f"{g['config']} ({g['runs']} runs)")
        ax.set_title(f"{rate}: speedup over the baseline vs compute per step", fontsize=9)
        ax.set_xlabel("compute per step, every rank computing (ms)")
        ax.set_ylabel("measured speedup (x)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    try:
        groups = pool(load(args.files))
        if args.model:
            groups = [g for g in groups if g["model"] == args.model]
        if args.plot:
            plot(groups, args.plot, args.configs.split(",") if args.configs else None)
    except ValueError as exc:
        print(f"python -m research bench pool: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dict(groups=[{k: v for k, v in g.items() if k != "points"} for g in groups]), indent=1))
    else:
        print(format_table(groups))
    return 0


__all__ = ["format_table", "load", "plot", "pool", "run"]
