"""Sweeps: training-step speedup over a grid of bandwidths, rank counts, latencies, methods and K.

    rows = sweep(ranks=[8, 64], bandwidths=["1Gbit", "10Gbit"], methods=["vote-1bit"],
                 params="1.3B", compute_seconds=0.3)
    print(format_table(rows)); plot(rows, "speedup.png")

Collectives are memoized across the grid (one Cache), so a sweep costs one simulation per distinct
(cluster, collective, size), not one per row.
"""

from __future__ import annotations

import itertools
import sys

from .collectives.simulate import Cache
from .net.cluster import Cluster
from .profiles import get_profile
from .step.model import simulate_step
from .units import format_rate, format_size, format_time, parse_rate, parse_time

COLUMNS = ("ranks", "bandwidth", "latency", "method", "momentum_sync", "step_seconds",
           "baseline_step_seconds", "speedup", "exposed_communication_seconds", "bytes_sent_per_rank")


def sweep(*, ranks, bandwidths, methods=("vote-1bit",), latencies=("20us",), momentum_syncs=(None,),
          gpus_per_node: int = 1, backend="nccl", cluster_kwargs: dict | None = None, progress: bool | None = None,
          cache: Cache | None = None, **step_kwargs) -> list[dict]:
    """simulate_step over a grid of rank counts, bandwidths, latencies, methods and momentum-sync intervals K.

    Args:
        ranks: the rank counts (each a cluster of ranks / gpus_per_node nodes).
        bandwidths: the NIC line rates (bits/s or strings like "10Gbit").
        methods: the methods (names in lioncub.methods.NAMES).
        latencies: the one-way latencies between nodes (seconds or strings like "20us").
        momentum_syncs: the values of K (None: never).
        gpus_per_node: ranks per node.
        backend: "nccl", "gloo", "ideal" or a BackendProfile.
        cluster_kwargs: Cluster's other fields (intra_bandwidth, topology, ...).
        progress: a tqdm bar on stderr (default: on when the grid has more than 20 points and stderr is a
            terminal).
        cache: a memo of simulated collectives (default: one for the whole grid).
        **step_kwargs: simulate_step's options (params, compute_seconds or flops_per_second + tokens_per_step,
            bucket_mb, algorithm, grad_dtype, levels, memory_bandwidth, ...).

    Returns:
        One row per (ranks, bandwidth, latency, method, K): the grid point and simulate_step's numbers (COLUMNS).

    Example:
        >>> rows = sweep(ranks=[8], bandwidths=["1Gbit", "10Gbit"], params="124M", compute_seconds=0.2)
        >>> [row["bandwidth"] for row in rows]
        [1000000000.0, 10000000000.0]
    """
    profile = get_profile(backend)
    cache = cache if cache is not None else Cache()
    bws = [parse_rate(b) for b in bandwidths]
    lats = [parse_time(t) for t in latencies]
    grid = list(itertools.product(list(ranks), bws, lats, list(methods), list(momentum_syncs)))
    if not grid:
        raise ValueError("empty sweep: give at least one value of each axis")
    if progress is None:
        progress = len(grid) > 20 and sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(grid), desc="simulate sweep", unit="cfg", file=sys.stderr)
    rows = []
    try:
        for n, bw, lat, method, k in grid:
            cluster = Cluster.for_ranks(n, gpus_per_node, bandwidth=bw, latency=lat, **(cluster_kwargs or {}))
            r = simulate_step(cluster, method, momentum_sync=k, backend=profile, cache=cache, **step_kwargs)
            row = {"ranks": n, "gpus_per_node": gpus_per_node, "bandwidth": bw, "latency": lat}
            row.update({k2: v for k2, v in r.to_dict().items() if k2 not in ("baseline", "ranks")})
            row["algorithms"] = sorted({c["algorithm"] for c in r.collectives})
            rows.append(row)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["ranks", "bandwidth", "latency", "method", "K", "step", "baseline", "speedup", "exposed comm",
            "bytes/rank"]
    body = [
        [
            str(r["ranks"]), format_rate(r["bandwidth"]), format_time(r["latency"]), r["method"],
            str(r["momentum_sync"] or "-"), format_time(r["step_seconds"]),
            format_time(r["baseline_step_seconds"]), f"{r['speedup']:.2f}x",
            format_time(r["exposed_communication_seconds"]), format_size(r["bytes_sent_per_rank"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def plot(rows: list[dict], path) -> None:
    """Speedup over the fp32 allreduce baseline against bandwidth, one line per rank count (and per
    latency / K when those vary), one panel per method. Written as PNG with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    lats = sorted({r["latency"] for r in rows})
    ks = list(dict.fromkeys(r["momentum_sync"] for r in rows))
    fig, axes = plt.subplots(1, len(methods), figsize=(5.5 * len(methods), 4.2), squeeze=False)
    for ax, method in zip(axes[0], methods):
        series: dict = {}
        for r in rows:
            if r["method"] != method:
                continue
            label = f"{r['ranks']} ranks"
            if len(lats) > 1:
                label += f", {format_time(r['latency'])}"
            if len(ks) > 1:
                label += f", K={r['momentum_sync'] or '-'}"
            series.setdefault(label, []).append((r["bandwidth"], r["speedup"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] / 1e9 for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("NIC bandwidth (Gbit/s)")
        ax.set_ylabel("speedup over fp32 allreduce")
        ax.set_title(method)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
