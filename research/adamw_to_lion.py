"""Coming from AdamW: what lr and weight decay Lion wants on the built-in models, measured.

The Lion paper's rule of thumb is an lr 3-10x smaller than AdamW's and a weight decay 3-10x larger (so that
lr * wd, the decay per step, stays about the same). This sweeps it on one process (the rule is a property of
the optimizer, not of the data-parallel layout): AdamW over a few learning rates (the grid is widened by 3x
while the best is at its edge), then Lion at the best AdamW lr divided by F and AdamW's wd multiplied by W, same
model, data, schedule (lioncub train's: linear warm-up, cosine to 0.1x) and seeds; the held-out loss after the
last step (a fixed set of validation batches, the same for every run) is what is compared. Runs with the same
seed see the same initial weights and the same batches, so each Lion cell is also compared with AdamW seed by seed
(`paired`: Lion minus AdamW, mean and sd over the seeds).

    python -m research.adamw_to_lion --model char-tiny --steps 300 --seeds 3 --batch 16 --output out.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

ADAMW_LRS = (1e-3, 3e-3, 1e-2)
LR_DIVISORS = (1, 3, 10, 30)
WD_FACTORS = (1, 3, 10)
ADAMW_WD = 0.1
ADAMW_BETAS = (0.9, 0.95)  # nanoGPT's and most LM recipes'
LION_BETAS = (0.9, 0.99)  # Lion's (and lioncub train's) defaults
EVAL_BATCHES, EVAL_BATCH = 16, 32  # the held-out set: the same 16 x 32 sequences for every run, whatever --batch
MAX_WIDEN = 2  # times the AdamW grid is widened by 3x at an edge where the best lands
TEXT_MODELS = ("char-tiny", "char-small", "char-medium", "byte-30m", "byte-gpt2-small")


def _schedule(lr: float, step: int, steps: int, warmup: int) -> float:
    """lioncub train's schedule: linear warm-up, then cosine from lr to 0.1 lr."""
    if step <= warmup:
        return lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@functools.cache
def _dataset(name: str):
    from lioncub.apps.train.data import text_dataset

    return text_dataset(name, progress=False)


def run(model_name: str, optimizer: str, lr: float, wd: float, seed: int, steps: int, batch: int,
        warmup: int, eval_batches: int = EVAL_BATCHES, block: int | None = None) -> dict:
    """Train one model on one process; its held-out loss (mean over eval_batches fixed batches) and train tail."""
    import torch

    from lioncub import Lion
    from lioncub.apps.train.models import DEFAULTS, PRESETS, CharTransformer, GPTConfig

    if model_name not in TEXT_MODELS:
        raise ValueError(f"--model must be a built-in transformer ({', '.join(TEXT_MODELS)}), got {model_name!r}")
    if optimizer not in ("adamw", "lion"):
        raise ValueError(f"optimizer must be adamw or lion, got {optimizer!r}")
    dataset, default_block = DEFAULTS[model_name]
    block = block or default_block
    data = _dataset(dataset)
    torch.manual_seed(seed)
    model = CharTransformer(GPTConfig(vocab_size=data.vocab_size, block_size=block, **PRESETS[model_name]))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=ADAMW_BETAS)
    else:
        opt = Lion(model.parameters(), lr=lr, weight_decay=wd, betas=LION_BETAS)
    tail, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = _schedule(lr, step, steps, warmup)
        x, y = data.batch(batch, block, seed=seed, rank=0, step=step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step > steps - min(20, steps):
            tail.append(loss.item())
    model.eval()
    with torch.no_grad():  # (seed 10_000 is no training seed: the same held-out batches for every run)
        evals = [model(*data.batch(EVAL_BATCH, block, seed=10_000, rank=0, step=i, split="val"))[1].item()
                 for i in range(eval_batches)]
    return dict(model=model_name, optimizer=optimizer, lr=lr, weight_decay=wd, seed=seed, steps=steps,
                eval_loss=statistics.fmean(evals), train_loss=statistics.fmean(tail),
                finite=all(math.isfinite(v) for v in evals + tail), seconds=time.perf_counter() - t0)


def _lion_cell(adamw_lr: float, divisor, adamw_wd: float, factor) -> tuple[float, float]:
    """(Lion's lr, Lion's weight decay) of a grid cell, to 12 significant digits (0.3, not 0.30000000000000004)."""
    return float(f"{adamw_lr / divisor:.12g}"), float(f"{adamw_wd * factor:.12g}")


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def sweep(model_name: str, steps: int, seeds: int, batch: int, warmup: int, log=sys.stderr, *,
          adamw_lrs=ADAMW_LRS, lr_divisors=LR_DIVISORS, wd_factors=WD_FACTORS, adamw_wd: float = ADAMW_WD,
          eval_batches: int = EVAL_BATCHES, checkpoint=None) -> dict:
    """AdamW over adamw_lrs (widened while the best is at an edge), then Lion around the best of them; every
    run's record and the summary. `checkpoint(partial_result)` is called after each cell (for long sweeps)."""
    runs: list[dict] = []
    t_start = time.perf_counter()

    def cell(opt, lr, wd):
        return [r for r in runs if (r["optimizer"], r["lr"], r["weight_decay"]) == (opt, lr, wd)]

    def mean_eval(opt, lr, wd):
        xs = [r["eval_loss"] for r in cell(opt, lr, wd)]
        return statistics.fmean(xs), _sd(xs)

    def go(opt, lr, wd):
        if cell(opt, lr, wd):
            return
        for seed in range(seeds):
            runs.append(run(model_name, opt, lr, wd, seed, steps, batch, warmup, eval_batches))
        m, s = mean_eval(opt, lr, wd)
        print(f"{opt:5s} lr {lr:.2e} wd {wd:.3g}: eval {m:.4f} +- {s:.4f}  "
              f"({time.perf_counter() - t_start:.0f} s)", file=log, flush=True)
        if checkpoint is not None:
            checkpoint(dict(meta, complete=False, runs=runs))

    meta = dict(model=model_name, steps=steps, seeds=seeds, batch=batch, warmup=warmup, adamw_wd=adamw_wd,
                adamw_betas=list(ADAMW_BETAS), lion_betas=list(LION_BETAS), eval_batches=eval_batches,
                eval_batch=EVAL_BATCH, lr_divisors=list(lr_divisors), wd_factors=list(wd_factors))
    lrs = sorted(adamw_lrs)
    for lr in lrs:
        go("adamw", lr, adamw_wd)
    widened = 0
    while True:  # an optimum at the grid's edge is no optimum: widen by 3x on that side, at most MAX_WIDEN times
        best_lr = min(lrs, key=lambda lr: mean_eval("adamw", lr, adamw_wd)[0])
        if widened >= MAX_WIDEN or len(lrs) < 2 or best_lr not in (lrs[0], lrs[-1]):
            break
        new = float(f"{lrs[-1] * 3 if best_lr == lrs[-1] else lrs[0] / 3:.12g}")
        lrs = sorted(lrs + [new])
        go("adamw", new, adamw_wd)
        widened += 1
    for div in lr_divisors:
        for w in wd_factors:
            go("lion", *_lion_cell(best_lr, div, adamw_wd, w))
    adamw_runs = {r["seed"]: r["eval_loss"] for r in cell("adamw", best_lr, adamw_wd)}
    table = []
    for div in lr_divisors:
        for w in wd_factors:
            lr, wd = _lion_cell(best_lr, div, adamw_wd, w)
            rs = cell("lion", lr, wd)
            m, s = mean_eval("lion", lr, wd)
            diffs = [r["eval_loss"] - adamw_runs[r["seed"]] for r in rs]
            table.append(dict(lr_divisor=div, wd_factor=w, lr=lr, weight_decay=wd,
                              eval_loss=m, eval_sd=s, paired_vs_adamw=statistics.fmean(diffs),
                              paired_sd=_sd(diffs), finite=all(r["finite"] for r in rs)))
    adamw_table = [dict(zip(("lr", "eval_loss", "eval_sd"), (lr, *mean_eval("adamw", lr, adamw_wd)))) for lr in lrs]
    adamw_best, adamw_sd = mean_eval("adamw", best_lr, adamw_wd)
    return dict(meta, complete=True, adamw=adamw_table, adamw_lr=best_lr, adamw_widened=widened,
                adamw_eval_loss=adamw_best, adamw_eval_sd=adamw_sd, lion=table,
                guidance=guidance(table, lr_divisors, wd_factors), runs=runs,
                seconds=round(time.perf_counter() - t_start, 1))


def guidance(table: list[dict], lr_divisors=LR_DIVISORS, wd_factors=WD_FACTORS) -> dict:
    """What the grid says: the best cell (lowest mean eval loss), whether it sits on the grid's edge, and the cells
    within noise of it (mean within the larger of the two cells' sds of the best's)."""
    ok = [r for r in table if r["finite"]]
    best = min(ok, key=lambda r: r["eval_loss"])
    near = [dict(lr_divisor=r["lr_divisor"], wd_factor=r["wd_factor"]) for r in ok
            if r["eval_loss"] - best["eval_loss"] <= max(best["eval_sd"], r["eval_sd"])]
    return dict(lr_divisor=best["lr_divisor"], wd_factor=best["wd_factor"], eval_loss=best["eval_loss"],
                eval_sd=best["eval_sd"], paired_vs_adamw=best["paired_vs_adamw"], paired_sd=best["paired_sd"],
                lr_at_edge=best["lr_divisor"] in (min(lr_divisors), max(lr_divisors)),
                wd_at_edge=best["wd_factor"] in (min(wd_factors), max(wd_factors)), within_noise=near)


def _write(path: str, res: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _floats(text: str) -> list:
    """'1,3,10' -> [1, 3, 10] (ints where they are whole numbers, as the table's keys)."""
    out = [float(t) for t in text.split(",") if t.strip()]
    if not out or any(not x > 0 for x in out):
        raise SystemExit(f"expected positive numbers, got {text!r}")
    return [int(x) if x.is_integer() and x >= 1 else x for x in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.adamw_to_lion", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="char-tiny", choices=TEXT_MODELS)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16, lioncub train's)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--adamw-lrs", default=",".join(f"{x:g}" for x in ADAMW_LRS),
                   help="AdamW's lrs (comma-separated; widened by 3x while the best is at an edge)")
    p.add_argument("--lr-divisors", default=",".join(map(str, LR_DIVISORS)), help="Lion's lr = AdamW's best / F")
    p.add_argument("--wd-factors", default=",".join(map(str, WD_FACTORS)), help="Lion's weight decay = AdamW's x W")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    if args.steps < 1 or args.seeds < 1 or args.batch < 1 or not 0 <= args.warmup < args.steps:
        p.error("--steps, --seeds and --batch must be >= 1, and 0 <= --warmup < --steps")
    import torch

    torch.set_num_threads(args.threads)
    stamp = dict(command="python -m research.adamw_to_lion " + " ".join(argv if argv is not None else sys.argv[1:]),
                 date=datetime.date.today().isoformat(), torch=torch.__version__, threads=args.threads,
                 cpus=os.cpu_count())
    grid = dict(adamw_lrs=_floats(args.adamw_lrs), lr_divisors=_floats(args.lr_divisors),
                wd_factors=_floats(args.wd_factors))
    res = sweep(args.model, args.steps, args.seeds, args.batch, args.warmup, **grid,
                checkpoint=lambda part: _write(args.output, {**stamp, **part}))
    _write(args.output, {**stamp, **res})
    g = res["guidance"]
    print(f"AdamW lr {res['adamw_lr']:.1e} wd {res['adamw_wd']:g}: eval {res['adamw_eval_loss']:.4f} "
          f"+- {res['adamw_eval_sd']:.4f}; best Lion: lr /{g['lr_divisor']} wd x{g['wd_factor']}: eval "
          f"{g['eval_loss']:.4f} +- {g['eval_sd']:.4f} (Lion - AdamW, paired: {g['paired_vs_adamw']:+.4f} "
          f"+- {g['paired_sd']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
