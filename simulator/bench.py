"""`lioncub bench simulator`: wall time of the simulator on a large collective and a large training step.

Target: a 1024-rank ring allreduce of 256 MiB simulates in under 10 s on a 2-core machine.
"""

from __future__ import annotations

import json
import time

TARGET_SECONDS = 10.0


def add_arguments(parser) -> None:
    parser.add_argument("--ranks", type=int, default=1024, help="ranks of the collective benchmark")
    parser.add_argument("--size", default="256MiB", help="allreduce size")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--bandwidth", default="10Gbit")
    parser.add_argument("--latency", default="20us")
    parser.add_argument("--step-ranks", type=int, default=256, help="ranks of the training-step benchmark")
    parser.add_argument("--params", default="1.3B", help="parameters of the training-step benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from .cluster import Cluster
    from .collectives import simulate_collective
    from .step import simulate_step
    from .units import format_time

    rows = []
    for backend in ("nccl", "gloo"):
        cluster = Cluster.for_ranks(args.ranks, args.gpus_per_node, bandwidth=args.bandwidth,
                                    latency=args.latency)
        t0 = time.perf_counter()
        r = simulate_collective(cluster, "allreduce", "ring", args.size, backend)
        wall = time.perf_counter() - t0
        rows.append({"bench": f"{args.ranks}-rank ring allreduce {args.size}", "backend": backend,
                     "wall_seconds": wall, "simulated_seconds": r.seconds, "messages": r.messages,
                     "simulated_ranks": r.simulated_ranks, "target_seconds": TARGET_SECONDS})
    cluster = Cluster.for_ranks(args.step_ranks, args.gpus_per_node, bandwidth=args.bandwidth,
                                latency=args.latency)
    for method in ("vote-1bit", "l1-pbit"):
        t0 = time.perf_counter()
        s = simulate_step(cluster, method, params=args.params, momentum_sync=100, compute_seconds=0.5,
                          backend="nccl")
        wall = time.perf_counter() - t0
        rows.append({"bench": f"{args.step_ranks}-rank {method} step, {args.params} params (+ baseline)",
                     "backend": "nccl", "wall_seconds": wall, "simulated_seconds": s.step_seconds,
                     "speedup": s.speedup})
    ok = all(r["wall_seconds"] < TARGET_SECONDS for r in rows if "target_seconds" in r)
    if args.json:
        print(json.dumps({"seconds": sum(r["wall_seconds"] for r in rows), "ok": ok, "rows": rows}, indent=2))
        return 0 if ok else 1
    for r in rows:
        extra = f"  (target < {TARGET_SECONDS:g} s)" if "target_seconds" in r else ""
        print(f"{r['bench']:<58} {r['backend']:<5} wall {r['wall_seconds']:7.3f} s   "
              f"simulated {format_time(r['simulated_seconds'])}{extra}")
    print("PASS" if ok else "FAIL: over the wall-time target")
    return 0 if ok else 1
