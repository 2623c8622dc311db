"""The rank side of a host calibration (issue 27): what the step model's contention needs, measured on R local
Gloo ranks that share this machine as the run's ranks do (one torch thread each, as in training), in seconds.

Every rank runs `probe(rank, world, cfg_dict, spec)`; the phases, every rank at once unless said:

1. compute: forward + backward of the run's model, every rank computing (no communication), for at least
   `compute_steps` steps and `compute_seconds` (a small model's step is a few of the scheduler's time slices
   long, so a few steps of it say little about its mean or its spread);
1b. paced: as many steps again, each followed by an all-reduce of the control message, as a training step
   ends: when each rank left each all-reduce, on the machine's one clock (time.monotonic), and its compute;
2. alone: rank 0 runs one bucket's codec for each method (and its parts: encode and vote; the apply with the
   momentum update on the whole model), and the Lion update on the whole model, while the others wait (each
   kernel's speed on one device of the host, and the CPU time it got over the wall time: its share);
3. collectives on idle cores: all-reduces of the control message itself, of `fit_sizes` and of `sizes` bytes
   (loopback), their time and the CPU time they take (every thread of the rank: Python, the process group, Gloo's
   own threads);
4. under compute: a second thread on every rank runs forward + backward in a loop (as the main thread of a
   training rank does while its communication thread works); the main thread runs the codec for a while
   (`codec_window` compute steps, at least `codec_seconds`; the compute steps inside that window are timed
   too), then the same all-reduces;
5. the optimizers' steps alone, last (run before phase 4, once a LionCub had made its own process group, phase 4
   took 49 s and char-small's calibration 50-54 s instead of 24 on this machine): for plain Lion ("lion", the
   ddp+lion baseline's step) and LionCub with each method (overlapped, its buckets as the run cuts them), a copy of
   the model trains a few steps on every rank; after each backward rank 0 times its step() while the others wait at
   a barrier: its kernel calls per tensor or bucket, the agreement and the bookkeeping, on the caches backward
   left, on one device.

A collective's time is the slowest rank's mean over a loop of calls (consecutive all-reduces keep the
ranks in step), the least of three passes. hostfit.py turns the figures into a HostModel and the held-out residuals.
"""

from __future__ import annotations

import math
import resource
import statistics
import threading
import time
from copy import deepcopy as copy_module

from lioncub.comm import wire

CPU_CALLS = 4  # the idle loops' length over the timed loops', for the CPU time per call (see _collectives)
MAX_COMPUTE_STEPS = 400


def _compute_step(cfg, model, data, rank):
    step = [0]

    def run():
        step[0] += 1
        x, y = data.batch(cfg.batch_size, cfg.block_size, seed=cfg.seed, rank=rank, step=step[0])
        model.zero_grad()
        model(x, y)[1].backward()
    return run


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _compute(step, spec: dict) -> list[float]:
    """Phase 1: every rank's compute steps, as many on every rank: `compute_count` of the slowest rank's first
    two (agreed by an all-reduce, a MAX)."""
    import torch
    import torch.distributed as dist

    first = _timed(step, 2)
    slowest = torch.tensor([max(first)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return first + _timed(step, compute_count(float(slowest), spec) - len(first))


def compute_count(step_seconds: float, spec: dict) -> int:
    """How many compute steps of `step_seconds` each to time: at least `compute_steps` and `compute_seconds`, at
    most MAX_COMPUTE_STEPS."""
    want = math.ceil(spec.get("compute_seconds", 0.0) / max(step_seconds, 1e-9))
    return max(2, int(spec["compute_steps"]), min(MAX_COMPUTE_STEPS, want))


def _paced(step, n: int) -> dict:
    """Phase 1b: `n` compute steps each followed by an all-reduce of the control message: when this rank left each
    all-reduce (time.monotonic, one clock for every process of the machine) and each step's compute seconds."""
    import torch.distributed as dist

    t = _buffer(wire.CONTROL.nbytes)
    dist.all_reduce(t)
    exits, compute = [], []
    for _ in range(n):
        t0 = time.monotonic()
        step()
        compute.append(time.monotonic() - t0)
        dist.all_reduce(t)
        exits.append(time.monotonic())
    return dict(exits=exits, compute=compute)


def _process_cpu() -> float:
    """CPU seconds of this process, every thread (the library's own included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def probe_dtype(size: int) -> str:
    """The dtype of the probe of `size` bytes: a probe of the control message's size is LionCub's control message
    itself (wire.CONTROL, whose element size decides which of Gloo's segments it fills), float32 otherwise."""
    return wire.CONTROL.dtype if int(size) == wire.CONTROL.nbytes else "float32"


def element_of(size: int) -> int:
    """Bytes per element of the probe of `size` bytes (`probe_dtype`)."""
    return wire.DTYPE_BYTES[probe_dtype(size)]


def _buffer(size: int):
    """The tensor of a probe of `size` bytes (`probe_dtype`)."""
    import torch

    return torch.zeros(max(1, int(size) // element_of(size)), dtype=getattr(torch, probe_dtype(size)))


def _sizes(spec: dict) -> list:
    """The all-reduces probed, idle and under compute: the control message, `fit_sizes` and `sizes` (bytes)."""
    return [wire.CONTROL.nbytes] + list(spec.get("fit_sizes", [])) + list(spec["sizes"])


def _collectives(sizes, calls: int, rounds: int = 3, cpu: dict | None = None) -> dict:
    """Seconds per all-reduce of each size (bytes, `_buffer`): the mean over a loop of calls (after one warm-up
    call), the least over `rounds` passes over the sizes, every other pass in reverse order (a load spike from elsewhere
    on a shared machine hits one pass of a probe, not all of them). `cpu`: filled with the process's CPU seconds
    per call of each size, the median over the passes (meaningful only while nothing else runs in the process).
    Linux accounts CPU time by sampling at each timer tick (4 ms at HZ=250) unless it is built for precise
    accounting, so a loop that takes a few ticks of CPU reads it to within a tick: with `cpu` the loops are
    CPU_CALLS times longer (about a quarter of a second)."""
    import torch.distributed as dist

    out, used = {}, {}
    for k in range(rounds):
        for size in (sizes if k % 2 == 0 else list(reversed(sizes))):
            t = _buffer(size)
            dist.all_reduce(t)
            n = calls if size < 2**20 else max(3, calls // 6)
            n = n if cpu is None else max(n * CPU_CALLS, calls * 2)
            c0, t0 = _process_cpu(), time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            key = str(int(size))
            out[key] = min(out.get(key, float("inf")), (time.perf_counter() - t0) / n)
            used.setdefault(key, []).append((_process_cpu() - c0) / n)
    if cpu is not None:
        cpu.update({key: statistics.median(v) for key, v in used.items()})
    return out


def _alone(spec, rank, world, model_elements: int) -> dict:
    """Rank 0's local work per method (one bucket's: encode, vote, apply), its encode and vote alone (the
    communication thread's part), its apply with the deferred momentum update on the whole model's elements (what
    step() runs after an overlapped exchange, out of the caches), and the Lion update on the whole model; the
    other ranks wait (phase 2)."""
    import torch
    import torch.distributed as dist

    from lioncub import kernels
    from lioncub.apps.calibrate.ranks import method_parts, method_work

    n, out, cpu, wall = int(spec["elements"]), {}, 0.0, 0.0
    dist.barrier()
    if rank == 0:
        for method in spec["methods"]:
            work = method_work(method, n, world, rank, torch.device("cpu"))
            work()
            c0, w0 = time.thread_time(), time.perf_counter()
            out[method] = statistics.median(_timed(work, 5))
            cpu, wall = cpu + time.thread_time() - c0, wall + time.perf_counter() - w0
            encode, _ = method_parts(method, n, world, rank, torch.device("cpu"))
            _, apply = method_parts(method, model_elements, world, rank, torch.device("cpu"))
            for part, fn in ((f"encode:{method}", encode), (f"apply:{method}", apply)):
                fn()
                out[part] = statistics.median(_timed(fn, 5))
        p, g, m = (torch.randn(model_elements) for _ in range(3))
        out["update"] = statistics.median(_timed(lambda: kernels.lion_step(p, g, m, lr=1e-6, wd=0.0, beta1=0.9,
                                                                            beta2=0.99), 5))
    dist.barrier()
    return dict(seconds=out, share=min(1.0, cpu / wall) if wall > 0 else 1.0, model_elements=model_elements)


def _updates(cfg, model, data, spec, rank) -> dict:
    """Phase 5: seconds of step() alone per optimizer of spec["update_configs"] (rank 0's, the median of
    `update_steps`; None on the other ranks)."""
    import torch.distributed as dist

    from lioncub.optim import LionCub
    from lioncub.optim.lion import Lion

    out = {}
    for name in spec.get("update_configs", ()):
        copy = copy_module(model)  # (parameters of its own, none of another optimizer's hooks)
        opt = Lion(copy.parameters(), lr=cfg.lr) if name == "lion" else \
            LionCub(copy.parameters(), lr=cfg.lr, method=name, bucket_mb=cfg.bucket_mb, overlap=True)
        step, times = _compute_step(cfg, copy, data, rank), []
        for k in range(1 + int(spec["update_steps"])):
            step()  # (overlapped: the exchange is over when backward returns)
            if k == 0:  # every rank at once: LionCub's first step checks that the replicas agree (a collective)
                opt.step()
                continue
            if rank == 0:
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            dist.barrier()
            if rank != 0:
                opt.step()
        out[name] = statistics.median(times) if times else None
        del opt, copy  # (a LionCub dropped ends its communication thread)
    return out


def _under_compute(step, spec, rank, world, compute_s: float) -> dict:
    """Phase 4: the codec and the collectives while a second thread computes."""
    import torch

    from lioncub.apps.calibrate.ranks import method_work

    stop, steps = threading.Event(), []

    def loop():
        while not stop.is_set():
            t0 = time.perf_counter()
            step()
            steps.append((t0, time.perf_counter()))

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        time.sleep(compute_s)  # let the compute loop reach its pace
        work = method_work(spec["busy_method"], int(spec["elements"]), world, rank, torch.device("cpu"))
        w0, count = time.perf_counter(), 0
        window = max(spec["codec_window"] * compute_s, spec.get("codec_seconds", 0.0))
        while time.perf_counter() - w0 < window:
            work()
            count += 1
        w1 = time.perf_counter()
        colls = _collectives(_sizes(spec), spec["calls"])
    finally:
        stop.set()
        worker.join()
    inside = [b - a for a, b in steps if a >= w0 and b <= w1]
    return dict(codec=(w1 - w0) / count, compute_under_codec=statistics.median(inside) if inside else None,
                collectives=colls)


def probe(rank: int, world: int, cfg_dict: dict, spec: dict) -> dict:
    """Every phase of the module's docstring on this rank; the slowest rank's figures are what count."""
    import torch.distributed as dist

    from .loop import TrainConfig, build

    cfg = TrainConfig.from_dict(cfg_dict)
    model, data = build(cfg)
    step = _compute_step(cfg, model, data, rank)
    step()
    dist.barrier()
    compute = _compute(step, spec)
    paced = _paced(step, len(compute))
    alone = _alone(spec, rank, world, sum(p.numel() for p in model.parameters()))
    idle_cpu: dict = {}
    idle = _collectives(_sizes(spec), spec["calls"], cpu=idle_cpu)
    dist.barrier()
    busy = _under_compute(step, spec, rank, world, statistics.median(compute))
    dist.barrier()
    updates = _updates(cfg, model, data, spec, rank)  # last: a LionCub's process group slows the probes after it
    return dict(rank=rank, compute=compute, paced=paced, alone=alone, updates=updates, idle=idle, idle_cpu=idle_cpu,
                busy=busy)
