"""Golden digests: what LionCub and the simulator compute, hashed, so a refactor can show its outputs unchanged.

Each case trains a small model on a few Gloo ranks (real backward, so the overlapped exchange runs) and
hashes every rank's parameters, momenta and the deterministic counters of `opt.stats` (bytes, collectives,
steps; not times). The simulator grid hashes `simulate_step` and `simulate_collective` over methods, links,
ranks and layouts. `python tests/golden/golden_cases.py` prints the digests; tests/golden/digests.json holds
the ones recorded before the layout change of issue 49, and tests/golden/test_golden.py compares them.
"""

from __future__ import annotations

import hashlib
import json

# (name, world size, options); every method flat, and the option families on the ones they apply to
METHODS = ("allreduce", "vote-allgather", "vote-1bit", "vote-pbit", "avg-pbit", "l1-pbit")
CASES = [(f"{m}-w{w}", w, dict(method=m)) for m in METHODS for w in (3, 4)]
CASES += [(f"{m}-sync2", 4, dict(method=m, momentum_sync=2)) for m in ("vote-1bit", "l1-pbit", "vote-pbit")]
CASES += [(f"{m}-warmup2", 3, dict(method=m, dense_warmup=2)) for m in ("vote-1bit", "l1-pbit")]
CASES += [(f"{m}-clip", 4, dict(method=m, clip=0.05)) for m in ("vote-1bit", "l1-pbit", "allreduce")]
CASES += [(f"{m}-nooverlap", 3, dict(method=m, overlap=False)) for m in ("vote-1bit", "avg-pbit")]
CASES += [(f"{m}-hier2", 4, dict(method=m, node_size=2)) for m in ("vote-1bit", "l1-pbit")]
CASES += [(f"{m}-local3", 4, dict(method=m, local_steps=3, outer="nesterov")) for m in ("vote-1bit", "allreduce")]
CASES += [("vote-1bit-local3-frag", 4, dict(method="vote-1bit", local_steps=4, fragments=2))]
CASES += [("l1-pbit-adaptive", 4, dict(method="l1-pbit", momentum_sync="adaptive"))]
STEPS = 6
COLLECTIVES = (("allreduce", "256MiB"), ("allgather", "16MiB"), ("reducescatter", "64MiB"), ("alltoall", "8MiB"),
               ("vote-1bit", "32MiB"), ("l1-pbit", "32MiB"))


def make_optimizer(model, options: dict):
    """LionCub from a case's options: the one place that spells the constructor (a layout change edits this,
    never the digests)."""
    from lioncub import LionCub, LocalSteps

    o = dict(options)
    o.pop("clip", None)
    if "local_steps" in o:
        o["local"] = LocalSteps(o.pop("local_steps"), outer=o.pop("outer", "avg"), fragments=o.pop("fragments", None))
    return LionCub(model.parameters(), lr=0.01, weight_decay=0.1, bucket_mb=1024 / 2**20, **o)


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 5))


def _counters(stats) -> dict:
    return {k: v for k, v in sorted(vars(stats).items())
            if not k.startswith("_") and isinstance(v, int) and not isinstance(v, bool)}


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def run_case(rank, world_size, options):
    """One case on one rank: STEPS steps of a small MLP on this rank's own data; its digests."""
    import torch

    model = _model()
    opt = make_optimizer(model, options)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if "clip" in options:
            # exact=True: the clip these digests were recorded with (issue 51 made the overlapped vote read the
            # previous step's coefficient by default; tests/optim/test_clip_overlap.py tests that one)
            opt.clip_grad_norm_(options["clip"], exact=True)
        opt.step()
    params = list(model.parameters())
    momenta = [opt.state[p]["exp_avg"] for p in params if "exp_avg" in opt.state[p]]
    return dict(params=_digest(params), momenta=_digest(momenta), stats=_counters(opt.stats))


def optimizer_digests(cases=CASES) -> dict:
    from lioncub.comm.spawn import spawn

    out = {}
    for name, world, options in cases:
        ranks = spawn(run_case, world, options, threads=1, timeout=300)
        out[name] = dict(params=[r["params"] for r in ranks], momenta=[r["momenta"] for r in ranks],
                         stats=ranks[0]["stats"])
    return out


def simulator_grid() -> dict:
    """simulate_step and simulate_collective over a grid of methods, links, ranks and layouts (repr of floats)."""
    from lioncub.simulator import Cluster, simulate_collective, simulate_step

    out = {}
    for ranks, gpn in ((4, 1), (16, 4), (64, 8)):
        for bw in ("100Mbit", "1Gbit", "10Gbit", "100Gbit"):
            cluster = Cluster.for_ranks(ranks, gpus_per_node=gpn, bandwidth=bw, latency="50us")
            for m in METHODS:
                for extra in ({}, dict(momentum_sync=10), dict(hierarchical=gpn > 1), dict(local_steps=10)):
                    if m == "allreduce" and extra.get("hierarchical"):
                        continue
                    r = simulate_step(cluster, method=m, params="124M", compute_seconds=0.2, **extra)
                    out[f"step/{ranks}x{gpn}/{bw}/{m}/{sorted(extra.items())}"] = [
                        repr(r.seconds), repr(r.speedup)]
            for op, size in COLLECTIVES:
                for backend in ("nccl", "gloo"):
                    r = simulate_collective(cluster, op, "auto", size, backend=backend)
                    out[f"coll/{ranks}x{gpn}/{bw}/{op}/{backend}"] = repr(r.seconds)
    return out


def all_digests() -> dict:
    grid = simulator_grid()
    return dict(optimizer=optimizer_digests(),
                simulator=hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest()[:16],
                simulator_rows=len(grid))


if __name__ == "__main__":
    print(json.dumps(all_digests(), indent=1, sort_keys=True))
