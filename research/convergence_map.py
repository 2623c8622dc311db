"""`python -m research bench convergence-map`: the convergence map.

Regimes (world size x per-rank batch x learning rate, each at several seeds) x configurations (method and
momentum-sync schedule): each run's final eval loss over the allreduce baseline's of the same regime and
seed. The runs are in a fixed order, configuration by configuration (the baseline first), so the grid
runs in parts (`--part i/n`: the i-th of n contiguous slices), each written to its own JSON as it goes
(a part that is stopped and started again skips what it has). `--merge` joins the parts into the map:
per (regime, configuration) the mean ratio, its standard error and range over seeds, and a heat map.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time

from lioncub.apps.train.configs import parse as configuration
from lioncub.apps.train.configs import split_local, split_run, split_stream
from lioncub.apps.tuned_lr import DEFAULT_LR
from lioncub.files import write_json

# The grid, sized for a 2-core machine: char-tiny, 200 steps, block 64 (TrainConfig's defaults otherwise).
# The regimes' learning rates: TrainConfig's default (the tuned one) times LR_FACTORS.
MODEL, STEPS = "char-tiny", 200
WORLDS = (2, 4)
BATCHES = (8, 16)
LR_FACTORS = (1.0, 2.0)
SEEDS = (0, 1)
CONFIGS = ("allreduce", "vote-1bit", "vote-pbit", "l1-pbit", "vote-1bit@adaptive", "l1-pbit@every:10",
           "vote-1bit@every:10")


def _default_lr(model: str = MODEL) -> float:
    return DEFAULT_LR[model]


def regimes(lr: float | None = None, worlds=WORLDS, batches=BATCHES, lr_factors=LR_FACTORS) -> list[dict]:
    lr = _default_lr() if lr is None else lr
    return [dict(ranks=n, batch_size=b, lr=round(lr * f, 10))
            for n, b, f in itertools.product(worlds, batches, lr_factors)]


def regime_key(r: dict) -> str:
    return f"N{r['ranks']}-b{r['batch_size']}-lr{r['lr']:g}"


def split_config(config: str) -> tuple[str, str]:
    """(method, momentum sync) of a cell's configuration (its dense warm-up, if any: configs.split_run)."""
    method, sync, _ = split_run(config)
    return method, sync


def is_baseline(config: str) -> bool:
    """Whether `config` is the map's reference: LionCub's dense method (averaged gradients), without momentum
    sync."""
    method, sync, warmup = split_run(config)
    return configuration(method).dense and sync == "none" and not warmup and split_local(config)[1] is None


def runs(configs=CONFIGS, seeds=SEEDS, lr: float | None = None, **grid) -> list[dict]:
    """Every run of the grid, in order: configuration by configuration, then regime, then seed."""
    return [dict(config=c, seed=s, **r) for c in configs for r in regimes(lr, **grid) for s in seeds]


def part_of(items: list, spec: str | None) -> list:
    if not spec:
        return items
    i, _, n = spec.partition("/")
    i, n = int(i), int(n)
    if not 1 <= i <= n:
        raise ValueError(f"--part must be i/n with 1 <= i <= n, got {spec!r}")
    size = -(-len(items) // n)
    return items[(i - 1) * size: i * size]


def _key(run: dict) -> tuple:
    return (run["config"], run["ranks"], run["batch_size"], run["lr"], run["seed"])


# what a part records of its training set-up beyond model, steps and device, with the value every part written
# before it was recorded had (the char models on pydoc-topics, block 64, fp32, 8 eval batches)
SETUP = dict(data="pydoc-topics", block_size=64, amp="none", eval_batches=8)


def _setting(d: dict) -> dict:
    """What must match for two parts' runs to be compared (parts written before `device` was recorded ran on
    the CPU; before the rest of SETUP, with SETUP's values)."""
    return dict(model=d["model"], steps=d["steps"], device=d.get("device", "cpu"),
                **{k: d.get(k, v) for k, v in SETUP.items()})


def _predicted_seconds(res: dict, run: dict, steps: int) -> float | None:
    """How long `run` should take, from this part's finished runs of the same configuration and world size
    (their start-up and steps); None before there is one."""
    same = [r for r in res["runs"] if (r["config"], r["ranks"]) == (run["config"], run["ranks"])]
    return max(r["wall_seconds"] for r in same) if same else None


def run_grid(part: str | None, output: str | None, configs=CONFIGS, steps: int = STEPS, model: str = MODEL,
             seeds=SEEDS, lr: float | None = None, device: str = "cpu", deadline: float | None = None,
             setup: dict | None = None, **grid) -> dict:
    """Run the grid's runs not yet in `output`, in order. `setup` sets TrainConfig's data, block_size, amp and
    eval_batches (None: the model's defaults); with `deadline` (a time.time()), a run is not started when a
    finished run of the same configuration and world size took longer than what is left."""
    from lioncub.apps.train.loop import TrainConfig

    lr = _default_lr(model) if lr is None else lr
    todo = part_of(runs(configs, seeds, lr, **grid), part)
    base = TrainConfig(model=model, device=device, **(setup or {}))  # resolves the model's data and block
    res = dict(model=model, steps=steps, device=device, part=part,
               **{k: getattr(base, k) for k in SETUP}, runs=[])
    if output and os.path.exists(output):
        with open(output) as f:
            prev = json.load(f)
        if _setting(prev) != _setting(res):
            raise ValueError(f"{output} holds runs of {_setting(prev)}, not {_setting(res)}: "
                             "give another --output")
        res["runs"] = prev.get("runs", [])
    have = {_key(r) for r in res["runs"]}
    for run in todo:
        if _key(run) in have:
            continue
        need = _predicted_seconds(res, run, steps)
        if deadline is not None and need is not None and time.time() + need > deadline:
            print(f"  deadline: {run['config']} {regime_key(run)} seed {run['seed']} not started (its kind took "
                  f"{need:.0f} s, {max(0.0, deadline - time.time()):.0f} s left)", file=sys.stderr, flush=True)
            continue
        _run_one(res, run, steps, base, output)
    return res


def _run_one(res: dict, run: dict, steps: int, base, output: str | None) -> None:
    """Train one run of the grid and record it in `res` (and in `output`, atomically)."""
    from lioncub.apps.train.loop import TrainConfig, train_local
    from lioncub.optim import schedules

    method, sync, warmup = split_run(run["config"])
    _, local_steps, outer = split_local(run["config"])
    _, fragments, outer_delay = split_stream(run["config"])
    cfg = TrainConfig(**dict(dataclasses.asdict(base), method=method, momentum_sync=sync, dense_warmup=warmup,
                             steps=steps, lr=run["lr"], batch_size=run["batch_size"], seed=run["seed"],
                             local_steps=local_steps, outer=outer, fragments=fragments, outer_delay=outer_delay))
    t0 = time.perf_counter()
    s = train_local(cfg, run["ranks"], progress=False)
    sched = schedules.resolve(schedules.parse(sync))
    row = dict(run, method=method, momentum_sync=sync, final_loss=s["final_loss"], train_loss=s["train_loss"],
               bytes_per_step=s["total_bytes_sent"] / steps, momentum_syncs=s["momentum_syncs"],
               agreement=s.get("agreement"), final_agreement=s.get("final_agreement"),
               mean_step_seconds=s["mean_step_seconds"], wall_seconds=time.perf_counter() - t0,
               threshold=getattr(sched, "threshold", None))
    res["runs"].append(row)
    print(f"  {run['config']} {regime_key(run)} seed {run['seed']}: loss {s['final_loss']:.4f}"
          f" ({row['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
    if output:
        write_json(output, res)


def merge(paths: list[str]) -> dict:
    """Join part files: per (regime, configuration) the ratio to the baseline of the same regime and seed."""
    rows, meta = {}, None
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read map part {p}: {exc.strerror}") from None
        if meta is not None and _setting(d) != meta:
            raise ValueError(f"{p} holds runs of {_setting(d)}, the parts before it {meta}: merge each apart")
        meta = _setting(d)
        for r in d["runs"]:
            rows[_key(r)] = r
    base = {(r["ranks"], r["batch_size"], r["lr"], r["seed"]): r for r in rows.values() if is_baseline(r["config"])}
    cells: dict = {}
    for r in rows.values():
        b = base.get((r["ranks"], r["batch_size"], r["lr"], r["seed"]))
        if b is None:
            continue
        r["ratio"] = r["final_loss"] / b["final_loss"]
        r["bytes_vs_baseline"] = r["bytes_per_step"] / b["bytes_per_step"] if b["bytes_per_step"] else None
        cells.setdefault((r["config"], r["ranks"], r["batch_size"], r["lr"]), []).append(r)
    out = []
    for (config, n, bsz, lr), rs in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:])):
        ratios = [r["ratio"] for r in rs]
        agreed = [r["agreement"] for r in rs if r.get("agreement") is not None]
        out.append(dict(config=config, ranks=n, batch_size=bsz, lr=lr, regime=regime_key(rs[0]),
                        seeds=sorted(r["seed"] for r in rs), ratio=statistics.fmean(ratios),
                        ratio_min=min(ratios), ratio_max=max(ratios),
                        spread=(max(ratios) - min(ratios)) / 2,
                        se=statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0,
                        baseline_loss=statistics.fmean(base[(n, bsz, lr, r["seed"])]["final_loss"] for r in rs),
                        final_loss=statistics.fmean(r["final_loss"] for r in rs),
                        bytes_per_step=statistics.fmean(r["bytes_per_step"] for r in rs),
                        bytes_vs_baseline=rs[0].get("bytes_vs_baseline"),
                        momentum_syncs=statistics.fmean(r["momentum_syncs"] for r in rs),
                        agreement=statistics.fmean(agreed) if agreed else None,
                        final_agreement=statistics.fmean(r["final_agreement"] for r in rs
                                                         if r.get("final_agreement") is not None)
                        if agreed else None))
    present = list(rows.values())
    grid = dict(worlds=sorted({r["ranks"] for r in present}), batches=sorted({r["batch_size"] for r in present}),
                lrs=sorted({r["lr"] for r in present}), seeds=sorted({r["seed"] for r in present}),
                configs=ordered_configs(out))
    return dict(**meta, grid=grid,
                cells=out, runs=sorted(rows.values(), key=lambda r: tuple(map(str, _key(r)))))


def ordered_configs(cells) -> list[str]:
    """The configurations present, in CONFIGS order, then any others (e.g. adaptive:T variants) sorted."""
    present = {x["config"] for x in cells}
    return [c for c in CONFIGS if c in present] + sorted(present - set(CONFIGS))


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = res["cells"]
    configs = ordered_configs(cells)
    regs = sorted({(x["ranks"], x["batch_size"], x["lr"]) for x in cells})
    grid = np.full((len(configs), len(regs)), np.nan)
    spread = np.full_like(grid, np.nan)
    for x in cells:
        i, j = configs.index(x["config"]), regs.index((x["ranks"], x["batch_size"], x["lr"]))
        grid[i, j], spread[i, j] = 100 * (x["ratio"] - 1), 100 * x["se"]
    fig, ax = plt.subplots(figsize=(1.0 * len(regs) + 3, 0.6 * len(configs) + 2))
    im = ax.imshow(grid, cmap="RdYlGn_r", vmin=-10, vmax=10, aspect="auto")
    for i, j in itertools.product(range(len(configs)), range(len(regs))):
        if not math.isnan(grid[i, j]):
            ax.text(j, i, f"{grid[i, j]:+.1f}\n±{spread[i, j]:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(regs)), [f"N={n}\nb={b}\nlr={lr:g}" for n, b, lr in regs], fontsize=7)
    ax.set_yticks(range(len(configs)), configs, fontsize=8)
    fig.colorbar(im, ax=ax, label="final eval loss vs allreduce (%)", fraction=0.025, pad=0.01)
    counts = sorted({len(x["seeds"]) for x in cells})  # cells may have different seed counts
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    ax.set_title(f"{res['model']}, {res['steps']} steps: loss vs the allreduce baseline (mean ± standard error over "
                 f"{seeds} seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def format_map(res: dict) -> str:
    lines = ["| configuration | regime | seeds | vs allreduce | std. error | range | agreement | syncs "
             "| bytes vs fp32 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in res["cells"]:
        a = "-" if x["agreement"] is None else f"{x['agreement']:.3f}"
        bv = "-" if x["bytes_vs_baseline"] is None else f"{100 * x['bytes_vs_baseline']:.1f}%"
        lines.append(f"| {x['config']} | {x['regime']} | {len(x['seeds'])} | {100 * (x['ratio'] - 1):+.1f}% | "
                     f"±{100 * x['se']:.1f}% | {100 * (x['ratio_min'] - 1):+.1f}.."
                     f"{100 * (x['ratio_max'] - 1):+.1f}% | {a} | {x['momentum_syncs']:.0f} | {bv} |")
    return "\n".join(lines)


def run(args) -> int:
    """`python -m research bench convergence-map`: run (a part of) the grid, or with --merge join parts into the map."""
    if args.merge:
        res = merge(args.merge)
        if args.plot:
            plot(res, args.plot)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1) if args.json else format_map(res))
        return 0
    configs = tuple(args.configs.split(",")) if args.configs else CONFIGS
    grid = {}
    for name, cast in (("worlds", int), ("batches", int), ("lr_factors", float)):
        if getattr(args, name, None):
            grid[name] = tuple(cast(x) for x in getattr(args, name).split(","))
    seeds = tuple(int(x) for x in args.seeds.split(",")) if getattr(args, "seeds", None) else SEEDS
    setup = {k: getattr(args, k) for k in SETUP if getattr(args, k, None) is not None}
    res = run_grid(args.part, args.output, configs, args.steps or STEPS, args.model or MODEL, seeds,
                   lr=args.lr, device=args.device or "cpu", deadline=args.deadline, setup=setup, **grid)
    if args.json:
        print(json.dumps(res, indent=1))
    return 0
