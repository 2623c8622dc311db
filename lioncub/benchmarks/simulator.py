"""`lioncub bench simulator`: wall time of the simulator on a large collective and a large training step.

Target: a 1024-rank ring allreduce of 256 MiB simulates in under 10 s on a 2-core machine.
"""

from __future__ import annotations

import json
import time

from lioncub.simulator.cluster import Cluster
from lioncub.simulator.collectives import simulate_collective
from lioncub.simulator.step import simulate_step
from lioncub.simulator.units import format_time

TARGET_SECONDS = 10.0


def run(args) -> int:
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
