"""`lioncub advise`: which method to use, by link speed and compute per step, forecast by the simulator.

For each link speed and each compute time per step it runs autotune's search (`lioncub.apps.autotune.search`,
every configuration costed by `lioncub.simulator.simulate_step` on a `lioncub.simulator.Cluster`) and prints
what autotune recommends: the method, its momentum sync and the dense warm-up it prescribes, with the
forecast speedup over torch DDP + Lion. `--markdown` prints the table README.md shows (a test checks they
are equal), so the README's advice is the simulator's.

    lioncub advise --markdown
    lioncub advise --params 1.3B --ranks 64 --bandwidth 10Gbit,25Gbit --compute-seconds 0.5,2
"""

from __future__ import annotations

from dataclasses import dataclass

from lioncub.apps.options import at_least

DEFAULTS = dict(params="124M", ranks=16, gpus_per_node=1, latency="50us", backend="nccl", steps=10_000,
                max_risk="medium", bandwidth="1Gbit,10Gbit,25Gbit,100Gbit", compute_seconds="0.05,0.3,1")
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_HEAD = ("link", "compute per step", "method", "momentum sync", "dense warm-up", "step speedup", "run speedup")


@dataclass
class Advice:
    """autotune's recommendation for one link speed and compute time per step."""

    bandwidth: str
    compute_seconds: float
    method: str
    momentum_sync: str
    dense_warmup: int
    speedup: float  # the step's, over torch DDP + Lion
    run_speedup: float  # over the planned run, the dense steps included


def parse_count(text: str) -> int:
    """'124M' -> 124000000 (k, M, B suffixes), '1e9' -> 1000000000."""
    t = str(text).strip()
    scale = _SUFFIX.get(t[-1:].lower(), 1.0) if t and t[-1].isalpha() else 1.0
    value = float(t[:-1] if scale != 1.0 else t) * scale
    if not value >= 1:
        raise ValueError(f"--params must be at least 1, got {text!r}")
    return int(round(value))


def advise(bandwidths, computes, *, params: int, ranks: int, gpus_per_node: int = 1, latency="50us",
           backend: str = "nccl", steps: int = 10_000, max_risk: str = "medium") -> list[Advice]:
    """autotune's recommendation for every (link speed, compute per step) pair, link speed major."""
    from lioncub.apps.autotune import parse_max_risk, recommend, search
    from lioncub.simulator import Cluster

    bound = parse_max_risk(max_risk)
    out = []
    for bw in bandwidths:
        cluster = Cluster.for_ranks(ranks, gpus_per_node=gpus_per_node, bandwidth=bw, latency=latency)
        for compute in computes:
            result = search(cluster, params, compute, backend=backend, steps=steps, max_risk=bound)
            best, _ = recommend(result)
            if best is None:
                raise ValueError(f"no configuration within --max-risk {max_risk} at {bw}, {compute:g} s")
            out.append(Advice(bw, compute, best.method, "-" if best.dense else best.momentum_sync,
                              best.dense_steps, best.speedup, best.run_speedup))
    return out


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--compute-seconds: not a number: {text!r}") from None
    if not value > 0:
        raise ValueError(f"--compute-seconds must be positive, got {text!r}")
    return value


def _rate(text: str) -> str:
    """'100Mbit' -> '100 Mbit/s'."""
    t = text.strip()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ/")
    return f"{num} {t[len(num):]}/s" if t[len(num):].lower().endswith("bit") else t


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:g} ms" if seconds < 1 else f"{seconds:g} s"


def rows(advice: list[Advice]) -> list[list[str]]:
    return [[_rate(a.bandwidth), _time(a.compute_seconds), f"`{a.method}`", a.momentum_sync,
             f"{a.dense_warmup} steps" if a.dense_warmup else "-", f"{a.speedup:.2f}x", f"{a.run_speedup:.2f}x"]
            for a in advice]


def caption(args) -> str:
    return (f"Forecast by `lioncub advise --markdown`: {args.params} parameters on {args.ranks} ranks "
            f"({args.gpus_per_node} per node), {args.latency} latency, {args.backend}, a {args.steps:,}-step run, "
            f"autotune's `--max-risk {args.max_risk}`; speedups over torch DDP + Lion's step (\"run\": "
            "the dense warm-up included).")


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "|".join(["---"] * 2 + ["---"] * 3 + ["---:"] * 2) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in table])


def plain(table: list[list[str]]) -> str:
    body = [list(_HEAD)] + [[c.strip("`") for c in r] for r in table]
    widths = [max(len(r[j]) for r in body) for j in range(len(_HEAD))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(body[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in body[1:]])


def render(args) -> str:
    """What the command prints: the caption, a blank line, the table."""
    bws = [b.strip() for b in args.bandwidth.split(",") if b.strip()]
    computes = [_seconds(c) for c in args.compute_seconds.split(",") if c.strip()]
    adv = advise(bws, computes, params=parse_count(args.params), ranks=args.ranks, gpus_per_node=args.gpus_per_node,
                 latency=args.latency, backend=args.backend, steps=args.steps, max_risk=args.max_risk)
    table = rows(adv)
    return caption(args) + "\n\n" + (markdown(table) if args.markdown else plain(table))


def register(sub) -> None:
    p = sub.add_parser("advise", help="which method to use, by link speed and compute per step (the simulator's)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (README.md's)")
    p.add_argument("--params", default=DEFAULTS["params"], help="parameters of the model (default 124M)")
    p.add_argument("--ranks", type=at_least(2, " (ranks that communicate)"), default=DEFAULTS["ranks"])
    p.add_argument("--gpus-per-node", type=at_least(1), default=DEFAULTS["gpus_per_node"])
    p.add_argument("--latency", default=DEFAULTS["latency"], help="one-way latency between nodes (default 50us)")
    p.add_argument("--backend", default=DEFAULTS["backend"], choices=("nccl", "gloo", "ideal"))
    p.add_argument("--steps", type=at_least(1), default=DEFAULTS["steps"], help="planned run length (default 10000)")
    p.add_argument("--max-risk", default=DEFAULTS["max_risk"], help="autotune's risk bound (default medium)")
    p.add_argument("--bandwidth", default=DEFAULTS["bandwidth"], help="comma-separated link speeds per node")
    p.add_argument("--compute-seconds", default=DEFAULTS["compute_seconds"],
                   help="comma-separated forward + backward seconds per step")
    p.set_defaults(func=run)


def run(args) -> int:
    print(render(args))
    return 0
