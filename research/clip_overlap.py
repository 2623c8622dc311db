"""Clipping and the overlap (issue 51, item 2): `lioncub train`'s loop with opt.clip_grad_norm_(max_norm) before
each step, the approximate clip (the default: the vote reads the previous step's coefficient) against the exact one
(exact=True: step() exchanges the clipped gradients again). Per run: the steps overlapped, the steps the clip bit,
the eval loss.

    python research/clip_overlap.py --model char-small --steps 200 --seeds 0 1 2 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from lioncub.apps.train import loop
from lioncub.comm.spawn import spawn


def rank_run(rank, world_size, cfg_dict, max_norm, exact):
    cfg = loop.TrainConfig.from_dict(cfg_dict)
    torch.set_num_threads(1)
    model, data = loop.build(cfg)
    loop.broadcast_parameters(model)
    opt = loop.make_optimizer(cfg, model)
    bit, t0 = 0, time.perf_counter()
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = loop._lr(cfg, step)
        x, y = data.batch(cfg.batch_size, cfg.block_size, seed=cfg.seed, rank=rank, step=step)
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        bit += opt.clip_grad_norm_(max_norm, exact=exact) > max_norm
        opt.step()
    return dict(eval_loss=loop.evaluate(model, data, cfg), overlapped=opt.stats.overlapped_steps, steps=cfg.steps,
                clipped=bit, seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="char-small")
    ap.add_argument("--methods", nargs="+", default=["vote-1bit", "l1-pbit"])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--clips", nargs="+", default=["approximate", "exact"], choices=["approximate", "exact"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.model}-{args.steps}.jsonl")
    done = set()
    if os.path.exists(path):  # resume: a run is a line
        with open(path) as f:
            done = {(r["method"], r["seed"], r["exact"]) for r in map(json.loads, f)}
    for method in args.methods:
        for seed in args.seeds:
            for exact in (c == "exact" for c in args.clips):
                if (method, seed, exact) in done:
                    continue
                cfg = loop.TrainConfig(model=args.model, method=method, steps=args.steps, seed=seed)
                r = spawn(rank_run, args.ranks, dataclasses.asdict(cfg), args.max_norm, exact, timeout=None)[0]
                r.update(method=method, seed=seed, exact=exact, model=args.model, ranks=args.ranks,
                         max_norm=args.max_norm)
                print(json.dumps(r), flush=True)
                with open(path, "a") as f:
                    f.write(json.dumps(r) + "\n")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for method in args.methods:
        for exact in (False, True):
            losses = [r["eval_loss"] for r in rows if r["method"] == method and r["exact"] == exact]
            if len(losses) > 1:
                print(f"{method} exact={exact}: eval loss {statistics.fmean(losses):.4f} +- "
                      f"{statistics.stdev(losses):.4f} over {len(losses)} seeds")


if __name__ == "__main__":
    main()
