"""Probes: real collectives timed in the lab (`lioncub lab bench`, and the held-out settings of the research
tools' `python -m research lab validate`).

SIZE means what it means in `lioncub simulate collective`: the bytes of each rank's whole buffer
(all-reduce input, all-gather output, all-to-all send buffer, reduce-scatter input). For the lioncub
composite ops it is the bytes of the fp32 bucket synchronized, and they run the optimizer's real
transport (`lioncub.methods.probe.composite_op`): exactly one bucket's collectives, as LionCub.step does.

Each probe: warm-up calls, then `repeat` timed calls, each started right after a barrier; a call's
time is the slowest rank's, and `seconds` is the median over the repetitions.

From Python (the lab stays up between probes):

    from lioncub.apps.lab import Lab, probes
    with Lab(hosts=4, bandwidth="1Gbit") as lab:
        probes.bench_many(lab, [{"op": "allreduce", "size": "4MiB"}, {"op": "l1-pbit", "size": "64MiB"}])
    probes.bench(op="allreduce", size="4MiB", ranks=4, bandwidth="100Mbit")   # builds its own lab

Each group of probes runs as one launch of `python -m lioncub.apps.lab.worker` per rank (worker.py), which
calls `run_probe` on every probe of the group.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

from lioncub.comm.wire import DTYPE_BYTES
from lioncub.simulator.collectives.simulate import COMPOSITES, composite_elements
from lioncub.simulator.units import format_rate, parse_rate, parse_size

from .lab import Lab, ranks_per_host_for

PLAIN_OPS = ("allreduce", "allgather", "alltoall", "reduce_scatter")
COMPOSITE_OPS = COMPOSITES
OPS = PLAIN_OPS + COMPOSITE_OPS
DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "uint8")
DEFAULTS = {"repeat": 5, "warmup": 1, "dtype": "float32", "levels": None}


def normalize(probe: dict) -> dict:
    """Check a probe and fill defaults: op, size (bytes), repeat, warmup, dtype, levels, and optionally
    ranks and bandwidth (bit/s) when the probe wants a different setting than the lab's."""
    unknown = set(probe) - {"op", "size", "repeat", "warmup", "dtype", "levels", "ranks", "bandwidth"}
    if unknown:
        raise ValueError(f"unknown probe keys {sorted(unknown)}")
    p = dict(DEFAULTS, **probe)
    if p["op"] not in OPS:
        raise ValueError(f"unknown op {p['op']!r}; choose one of: {', '.join(OPS)}")
    p["size"] = int(parse_size(p["size"]))
    if p["size"] < 1:
        raise ValueError(f"size must be at least 1 byte, got {p['size']}")
    if p["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {p['dtype']!r}; choose one of: {', '.join(DTYPES)}")
    if p["repeat"] < 1 or p["warmup"] < 0:
        raise ValueError("repeat must be >= 1 and warmup >= 0")
    if p.get("bandwidth") is not None:
        p["bandwidth"] = parse_rate(p["bandwidth"])
    if p.get("ranks") is not None and p["ranks"] < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got {p['ranks']}")
    return p


# -- inside a rank --------------------------------------------------------------------------------
def _make_op(p: dict, world: int):
    """(callable running one collective, bytes per SIZE convention, extra fields)."""
    import torch
    import torch.distributed as dist

    op, size = p["op"], p["size"]
    if op in COMPOSITE_OPS:
        from lioncub.methods.probe import composite_op

        n = composite_elements(size)
        return composite_op(op, n, group=None, levels=p["levels"]), 4 * n, {"n_elements": n}
    dtype = getattr(torch, p["dtype"])
    n = max(1, size // DTYPE_BYTES[p["dtype"]])
    per = max(1, n // world)  # the per-rank share of gathered/scattered buffers
    if op == "allreduce":
        x = torch.zeros(n, dtype=dtype)
        return (lambda: dist.all_reduce(x)), x.nbytes, {}
    if op == "allgather":
        x, out = torch.zeros(per, dtype=dtype), torch.zeros(per * world, dtype=dtype)
        return (lambda: dist.all_gather_into_tensor(out, x)), out.nbytes, {}
    if op == "alltoall":
        x, out = torch.zeros(per * world, dtype=dtype), torch.zeros(per * world, dtype=dtype)
        return (lambda: dist.all_to_all_single(out, x)), x.nbytes, {}
    x, out = torch.zeros(per * world, dtype=dtype), torch.zeros(per, dtype=dtype)
    return (lambda: dist.reduce_scatter_tensor(out, x)), x.nbytes, {}


def run_probe(p: dict) -> dict:
    """Time one probe on the current (initialized) process group; every rank returns the same dict."""
    import torch
    import torch.distributed as dist

    fn, nbytes, extra = _make_op(p, dist.get_world_size())
    for _ in range(p["warmup"]):
        fn()
    times = []
    for _ in range(p["repeat"]):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = slowest.tolist()
    return {
        "op": p["op"],
        "seconds": statistics.median(times),
        "times": times,
        "min": min(times),
        "bytes": nbytes,
        "size": p["size"],
        "dtype": "float32" if p["op"] in COMPOSITE_OPS else p["dtype"],
        "levels": p["levels"],
        "repeat": p["repeat"],
        "warmup": p["warmup"],
        **extra,
    }


# -- from the launcher ----------------------------------------------------------------------------
def _estimate_seconds(p: dict, rate_bps: float) -> float:
    return (p["warmup"] + p["repeat"]) * (0.05 + 3 * 8 * p["size"] / rate_bps)


def bench_many(lab, probes: list[dict], timeout: float | None = None) -> list[dict]:
    """Time many collectives in `lab` (a Lab that is up); consecutive probes with the same `ranks` and
    `bandwidth` share one launch (one process group). See `normalize` for the probe keys."""
    probes = [normalize(p) for p in probes]
    for p in probes:
        ranks = p.get("ranks") or lab.max_ranks
        if ranks > lab.max_ranks:
            raise ValueError(f"{ranks} ranks asked for; this lab has room for {lab.max_ranks}")
    results: list[dict] = []
    setting = lambda p: (p.get("ranks"), p.get("bandwidth"))
    for (ranks, bandwidth), group in itertools.groupby(probes, key=setting):
        group = list(group)
        if bandwidth is not None:
            lab.set_bandwidth(bandwidth)
        ranks = ranks or lab.max_ranks
        rate = lab.network.rate_bps
        budget = timeout or (120 + 10 * sum(_estimate_seconds(p, rate) for p in group))
        job = json.dumps({"probes": group, "pg_timeout": budget})
        out = lab.run([sys.executable, "-m", "lioncub.apps.lab.worker", job], ranks=ranks, timeout=budget)
        for res in out[0].result:
            res.update(
                ranks=ranks,
                ranks_per_host=lab.ranks_per_host,
                hosts=-(-ranks // lab.ranks_per_host),
                bandwidth=format_rate(rate),
                bandwidth_bps=rate,
                tbf_burst_bytes=lab.network.burst,
                backend="gloo",
            )
            results.append(res)
    return results


def bench(
    op: str,
    size,
    ranks: int,
    bandwidth="1Gbit",
    hosts: int | None = None,
    ranks_per_host: int | None = None,
    repeat: int = 5,
    warmup: int = 1,
    dtype: str = "float32",
    levels: int | None = None,
    burst=None,
) -> dict:
    """Build a lab for this one measurement, take it, tear the lab down; returns the result dict."""
    rph = ranks_per_host_for(ranks, hosts, ranks_per_host)
    probe = normalize(dict(op=op, size=size, repeat=repeat, warmup=warmup, dtype=dtype, levels=levels,
                           ranks=ranks))
    with Lab(ranks=ranks, ranks_per_host=rph, bandwidth=bandwidth, burst=burst) as lab:
        return bench_many(lab, [probe])[0]

