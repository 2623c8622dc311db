"""The learning-rate sweep's pick, by a rule fixed before the sweep runs (scripts/gpu_evidence.sh).

    python -m research.lr_sweep MAP --seeds 0,1 --lrs 3e-5,6e-5,1.2e-4 [--output JSON]

MAP is the merged map of the sweep (allreduce at several lrs, `python -m research bench convergence-map --merge`).
The pick is the lr with the lowest mean final eval loss over the given seeds, a tie going to the lower lr; it is
made only when every lr of the sweep (--lrs: the lrs it was to run, not only those a run reached) has every one of
those seeds (exit status 3 and no output otherwise, so a sweep cut by a deadline is finished on the next run
before anything uses its lr). `at_edge` says when the pick is the sweep's lowest or highest lr: the best may lie
beyond it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from lioncub import methods


def select(map_res: dict, seeds: list[int], lrs: list[float] | None = None) -> dict:
    """{lr, complete, at_edge, table} of a sweep's merged map (allreduce runs); `lrs`: the sweep's planned lrs
    (default: those in the map), each of which must have every seed."""
    runs = [r for r in map_res["runs"] if r["config"] == methods.BASELINE]
    ran = sorted({r["lr"] for r in runs})
    if lrs is None:
        lrs = ran
    else:
        lrs = sorted({next((x for x in ran if math.isclose(x, lr, rel_tol=1e-6)), lr) for lr in lrs})
    table = []
    for lr in lrs:
        got = {r["seed"]: r["final_loss"] for r in runs if r["lr"] == lr and r["seed"] in seeds}
        losses = [got[s] for s in sorted(got)]
        table.append(dict(lr=lr, seeds=sorted(got), losses=losses, mean=statistics.fmean(losses) if losses else None,
                          worst=max(losses) if losses else None))
    complete = bool(table) and all(row["seeds"] == sorted(seeds) for row in table)
    if not complete:
        return dict(lr=None, complete=False, at_edge=None, table=table, seeds=sorted(seeds))
    best = min(table, key=lambda row: (row["mean"], row["lr"]))
    return dict(model=map_res["model"], steps=map_res["steps"], lr=best["lr"], complete=True,
                at_edge=len(lrs) > 1 and best["lr"] in (lrs[0], lrs[-1]), table=table, seeds=sorted(seeds),
                rule="the lowest mean final eval loss over the seeds, a tie to the lower lr")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.lr_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("map", help="the sweep's merged map (python -m research bench convergence-map --merge)")
    ap.add_argument("--seeds", required=True, help="comma-separated seeds every lr must have")
    ap.add_argument("--lrs", help="comma-separated lrs the sweep was to run (default: those in MAP)")
    ap.add_argument("--output", help="write the pick here (only when the sweep is complete)")
    args = ap.parse_args(argv)
    try:
        with open(args.map) as f:
            res = select(json.load(f), [int(s) for s in args.seeds.split(",")],
                         [float(x) for x in args.lrs.split(",")] if args.lrs else None)
    except (OSError, ValueError, KeyError) as exc:
        print(f"lr_sweep: error: {args.map}: {exc}", file=sys.stderr)
        return 2
    for row in res["table"]:
        mean = "-" if row["mean"] is None else f"{row['mean']:.4f}"
        print(f"  lr {row['lr']:.3g}: seeds {row['seeds']} mean {mean}")
    if not res["complete"]:
        print("lr_sweep: incomplete (some lr lacks a seed): no pick yet", file=sys.stderr)
        return 3
    print(f"pick: lr {res['lr']:.6g}" + (" (at the sweep's edge)" if res["at_edge"] else ""))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
