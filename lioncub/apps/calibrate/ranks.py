"""The rank side of a calibration: probes timed with torch.distributed already initialised.

Every rank runs `run(job)`; all ranks return the same measurements. In the lab the launcher starts
`python -m lioncub.apps.calibrate JOB_JSON` in every rank's namespace; under torchrun `lioncub calibrate`
calls `run` in-process. Rank 0 draws a progress bar on stderr and never writes to stdout.

Probes
------
* ``p2p``: ping-pong between ranks 0 and 1 (the others wait); a probe's time is half a round trip.
* ``allreduce``, ``allgather``, ``alltoall``, ``reduce_scatter``: one call on every rank, SIZE as in
  `lioncub simulate collective` (all-reduce input, all-gather output, all-to-all send buffer,
  reduce-scatter input), float32.

Each probe: `warmup` untimed calls, then `repeat` timed ones, each started right after a barrier; a call's
time is the slowest rank's. With `rounds` > 1 the whole list runs again, in reverse order every other
round, and the times of a probe are pooled: a load spike from elsewhere on a shared machine then hits
different probes in different rounds instead of one probe's every repetition.

Host kernels (`codec`): every rank times, at the same moment (so ranks that share CPU cores contend as
they do in training), the local work LionCub does per bucket: for each compressed method prepass,
quantize_pack, the vote (1-bit methods) and unpack_apply; the plain Lion update (kernels.lion_step);
the vote kernel alone; and a float32 sum (Gloo's reduction).
"""

from __future__ import annotations

import statistics
import sys
import time

from lioncub import methods

PROBE_OPS = ("p2p", "allreduce", "allgather", "alltoall", "reduce_scatter")
CODEC_METHODS = tuple(name for name, m in methods.REGISTRY.items() if not m.dense)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective(op: str, size: int, world: int, device):
    """(callable running one call, bytes per the SIZE convention)."""
    import torch
    import torch.distributed as dist

    n = max(world, size // 4)
    per = n // world
    f32 = dict(dtype=torch.float32, device=device)
    if op == "allreduce":
        x = torch.zeros(n, **f32)
        return (lambda: dist.all_reduce(x)), x.nbytes
    if op == "allgather":
        x, out = torch.zeros(per, **f32), torch.zeros(per * world, **f32)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(out, x)), out.nbytes
    if op == "alltoall":
        x, out = torch.zeros(per * world, **f32), torch.zeros(per * world, **f32)
        return (lambda: dist.all_to_all_single(out, x)), x.nbytes
    if op == "reduce_scatter":
        x, out = torch.zeros(per * world, **f32), torch.zeros(per, **f32)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(out, x)), x.nbytes
    raise ValueError(f"unknown probe op {op!r}; choose one of: {', '.join(PROBE_OPS)}")


def _p2p(size: int, rank: int, device):
    """Ping-pong between ranks 0 and 1: one call is a round trip (halved when reported)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)

    def call():
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return call, buf.nbytes


def _time(fn, repeat: int, warmup: int, device) -> list[float]:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _slowest(times: list[float]) -> list[float]:
    """Each call's time on the slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_probes(probes: list[dict], rounds: int, device, bar=None) -> list[dict]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    pooled: dict[int, list[float]] = {i: [] for i in range(len(probes))}
    nbytes: dict[int, int] = {}
    for rnd in range(rounds):
        order = list(range(len(probes)))
        if rnd % 2:
            order.reverse()
        for i in order:
            p = probes[i]
            if p["op"] == "p2p":
                fn, nb = _p2p(p["size"], rank, device)
            else:
                fn, nb = _collective(p["op"], p["size"], world, device)
            times = _slowest(_time(fn, p["repeat"], p["warmup"] if rnd == 0 else min(1, p["warmup"]), device))
            if p["op"] == "p2p":
                times = [t / 2 for t in times]  # one way
            pooled[i] += times
            nbytes[i] = nb
            if bar is not None:
                bar.update(1)
    out = []
    for i, p in enumerate(probes):
        times = pooled[i]
        out.append({
            "op": p["op"], "size": p["size"], "bytes": nbytes[i], "ranks": world, "times": times,
            "seconds": statistics.median(times), "min": min(times), "repeat": len(times),
        })
    return out


# ---- host kernels -----------------------------------------------------------------------------------
def _median_time(fn, repeat: int = 5) -> float:
    import torch.distributed as dist

    fn()  # warm-up: scratch buffers, page faults
    times = []
    for _ in range(repeat):
        dist.barrier()  # every rank at once: ranks sharing cores contend as in a training step
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _exchange(method: str, n: int, world: int, rank: int, device):
    """A method's exchange on n elements with a rank's gradients, momenta and parameters (seeded)."""
    import torch

    meth = methods.get(method)
    x = meth.exchange(n, device, None, levels=meth.resolve_levels(world), world_size=world)
    gen = torch.Generator().manual_seed(1234 + rank)
    g, m, p = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    return x, g, m, p, [0, n]


def method_work(method: str, n: int, world: int, rank: int, device):
    """The local work of one bucket of n elements as LionCub.step does it: the method's encode pipeline
    without its collectives (lioncub.methods.base.Exchange)."""
    x, g, m, p, offsets = _exchange(method, n, world, rank, device)

    def work():
        x.encode(g, m, beta1=0.9, beta2=0.99, offsets=offsets)
        x.vote()
        x.apply(p, x.agreed(), lr=1e-6, wd=0.0)

    return work


def method_parts(method: str, n: int, world: int, rank: int, device):
    """The two parts of `method_work` as an overlapped step runs them: (encode and vote, on the communication
    thread; apply with the deferred momentum update, in step() after the exchange), each a callable."""
    x, g, m, p, offsets = _exchange(method, n, world, rank, device)

    def encode():
        x.encode(g, m, beta1=0.9, beta2=0.99, offsets=offsets, update_momentum=False)
        x.vote()

    def apply():
        x.apply(p, x.agreed(), lr=1e-6, wd=0.0, momentum=(g, m, 0.99))

    encode()
    return encode, apply


def run_host_kernels(spec: dict, device, bar=None) -> dict:
    """Seconds per bucket of spec["elements"] elements, every rank at once: per method (its whole local
    work), "update" (kernels.lion_step), "sum" (x += y on float32, Gloo's reduction); and "vote", the
    vote kernel on world rows of spec["vote_bytes"] bytes in all."""
    import torch
    import torch.distributed as dist

    from lioncub import kernels

    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(spec["elements"])
    out: dict = {"elements": n, "world_size": world, "device": str(device), "seconds": {}}
    gen = torch.Generator().manual_seed(99 + rank)
    p, g, m = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    out["seconds"]["update"] = _median_time(lambda: (kernels.lion_step(p, g, m, lr=1e-6, wd=0.0, beta1=0.9,
                                                                       beta2=0.99), _sync(device)))
    y = torch.randn(n, generator=gen).to(device)
    out["seconds"]["sum"] = _median_time(lambda: (g.add_(y), _sync(device)))
    if bar is not None:
        bar.update(1)
    for method in spec.get("methods", CODEC_METHODS):
        work = method_work(method, n, world, rank, device)
        out["seconds"][method] = _median_time(lambda work=work: (work(), _sync(device)))
        if bar is not None:
            bar.update(1)
    # the vote kernel alone, on rows as large as a big bucket's (it slows down once they leave the cache)
    row = max(1, int(spec.get("vote_bytes", 8 << 20)) // world)
    rows = torch.randint(0, 256, (world, row), dtype=torch.uint8, generator=gen).to(device)
    sign = torch.empty(row, dtype=torch.uint8, device=device)
    nonzero = torch.empty(row, dtype=torch.uint8, device=device) if world % 2 == 0 else None
    out["seconds"]["vote"] = _median_time(lambda: (kernels.vote(rows, sign, nonzero), _sync(device)))
    out["vote_bytes"] = world * row
    # every rank's own figure; report the slowest (the step waits for it)
    keys = sorted(out["seconds"])
    t = torch.tensor([out["seconds"][k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["seconds"] = dict(zip(keys, t.tolist()))
    return out


def run(job: dict) -> dict:
    """Everything a calibration measures, on this rank (same result on every rank)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device(job.get("device", "cpu"))
    probes = job["probes"]
    rounds = int(job.get("rounds", 1))
    host = job.get("host_kernels")
    bar = None
    if rank == 0 and job.get("progress", True):
        from lioncub.optional import progress_bar

        total = rounds * len(probes) + ((1 + len(host.get("methods", CODEC_METHODS))) if host else 0)
        bar = progress_bar(total=total, desc="calibrate", unit="probe", file=sys.stderr, leave=False)
    try:
        measurements = run_probes(probes, rounds, device, bar)
        kernels_out = run_host_kernels(host, device, bar) if host else None
    finally:
        if bar is not None:
            bar.close()
    return {"measurements": measurements, "host_kernels": kernels_out}
