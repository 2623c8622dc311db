"""`lioncub lab bench`: time real collectives in the lab.

SIZE means what it means in `lioncub simulate collective`: the bytes of each rank's whole buffer
(all-reduce input, all-gather output, all-to-all send buffer, reduce-scatter input). For the lioncub
composite ops it is the bytes of the fp32 bucket synchronized, and they run the optimizer's real
transport (`lioncub.transport.composite_op`): exactly one bucket's collectives, as LionCub.step does.

Each probe: warm-up calls, then `repeat` timed calls, each started right after a barrier; a call's
time is the slowest rank's, and `seconds` is the median over the repetitions.

From Python (the calibration calls this; the lab stays up between probes):

    with Lab(hosts=4, bandwidth="1Gbit") as lab:
        lab.bench_many([{"op": "allreduce", "size": "4MiB"}, {"op": "l1-pbit", "size": "64MiB"}])
    bench(op="allreduce", size="4MiB", ranks=4, bandwidth="100Mbit")   # builds its own lab
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import statistics
import sys
import time

from lioncub.simulator.units import format_rate, parse_rate, parse_size

from .. import wire

PLAIN_OPS = ("allreduce", "allgather", "alltoall", "reduce_scatter")
COMPOSITE_OPS = tuple(op for op in wire.COMPOSITE_OPS if op not in PLAIN_OPS)
OPS = PLAIN_OPS + COMPOSITE_OPS
DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "uint8")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}
DEFAULTS = {"repeat": 5, "warmup": 1, "dtype": "float32", "levels": None}


def _transport_missing(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"op {op!r} runs the optimizer's real transport, lioncub.transport.composite_op, which is "
        f"not in this build yet; the plain ops ({', '.join(PLAIN_OPS)}) work"
    )


def normalize(probe: dict) -> dict:
    """Check a probe and fill defaults: op, size (bytes), repeat, warmup, dtype, levels, and optionally
    ranks and bandwidth (bit/s) when the probe wants a different setting than the lab's."""
    unknown = set(probe) - {"op", "size", "repeat", "warmup", "dtype", "levels", "ranks", "bandwidth"}
    if unknown:
        raise ValueError(f"unknown probe keys {sorted(unknown)}")
    p = dict(DEFAULTS, **probe)
    if p["op"] not in OPS:
        raise ValueError(f"unknown op {p['op']!r}; choose one of: {', '.join(OPS)}")
    if p["op"] in COMPOSITE_OPS and importlib.util.find_spec("lioncub.transport") is None:
        raise _transport_missing(p["op"])
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
        try:
            from lioncub.transport import composite_op
        except ModuleNotFoundError as exc:
            if exc.name != "lioncub.transport":
                raise
            raise _transport_missing(op) from None
        n = wire.composite_elements(size)
        return composite_op(op, n, group=None, levels=p["levels"]), 4 * n, {"n_elements": n}
    dtype = getattr(torch, p["dtype"])
    n = max(1, size // _ITEMSIZE[p["dtype"]])
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
        out = lab.run([sys.executable, "-m", "lioncub.lab.worker", job], ranks=ranks, timeout=budget)
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
    from .lab import Lab

    rph = _ranks_per_host(ranks, hosts, ranks_per_host)
    probe = normalize(dict(op=op, size=size, repeat=repeat, warmup=warmup, dtype=dtype, levels=levels,
                           ranks=ranks))
    with Lab(ranks=ranks, ranks_per_host=rph, bandwidth=bandwidth, burst=burst) as lab:
        return lab.bench_many([probe])[0]


def _ranks_per_host(ranks: int, hosts: int | None, ranks_per_host: int | None) -> int:
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}")
    if hosts is not None and ranks_per_host is not None:
        if hosts * ranks_per_host != ranks:
            raise ValueError(f"--ranks {ranks} differs from --hosts {hosts} x --ranks-per-host "
                             f"{ranks_per_host}; give two of the three")
        return ranks_per_host
    if hosts is not None:
        if hosts < 1 or ranks % hosts:
            raise ValueError(f"--ranks {ranks} must be a multiple of --hosts {hosts}")
        return ranks // hosts
    rph = ranks_per_host or 1
    if rph < 1 or ranks % rph:
        raise ValueError(f"--ranks {ranks} must be a multiple of --ranks-per-host {rph}")
    return rph
