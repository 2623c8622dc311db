"""torch.distributed plumbing: initialise under torchrun, broadcast initial weights, spawn local ranks."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). NCCL when CUDA is available, else Gloo. A collective that waits longer than `timeout`
    seconds (a dead or stalled rank) raises instead of hanging. Returns (rank, world_size); without
    torchrun's variables it returns (0, 1) and leaves torch.distributed uninitialised."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def broadcast_parameters(module_or_tensors, src: int = 0, group=None) -> None:
    """Make every rank start from rank `src`'s parameters and buffers (one broadcast per dtype)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if isinstance(module_or_tensors, torch.nn.Module):
        tensors: Iterable[torch.Tensor] = list(module_or_tensors.parameters()) + list(
            module_or_tensors.buffers())
    else:
        tensors = list(module_or_tensors)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    seen = set()
    for t in tensors:
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def finish(grace_s: float = 0.1) -> None:
    """End a distributed run: wait for every rank, destroy all process groups, let Gloo settle.

    Call it last in a torchrun script instead of a bare destroy_process_group(). Gloo's worker threads
    free each collective's Work (and the tensor references it holds) shortly *after* the collective
    completes. If that happens while the interpreter is already shutting down, the thread cannot take
    the GIL and torch aborts the process ("terminate called without an active exception", exit -6)
    although all work finished. The barrier makes every rank finish every collective; the grace
    period lets the workers drop them before Python starts finalising.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    slow = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if slow:
        time.sleep(grace_s)


@contextlib.contextmanager
def gloo_rank(timeout_s: float):
    """One lab rank's process group: Gloo from the launcher's environment, one thread; finish() after
    the body, or a bare destroy if it raised (its peers may be gone, so no barrier)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, timeout, threads, queue, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        # tensors go back as bytes: torch's shared-memory pickling needs the sender alive
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class SpawnError(RuntimeError):
    pass


def spawn(fn: Callable, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
          threads: int | None = None, allow_failures: bool = False, env: dict | None = None) -> list:
    """Run fn(rank, world_size, *args) on `world_size` local Gloo ranks; return their results by rank.

    Processes come from a forkserver that has torch imported already, so each rank starts in a fraction
    of a second. If a rank raises or dies, the others are stopped and SpawnError carries its traceback;
    with allow_failures=True the others run on, and a rank that failed, died or did not finish within
    `timeout` gets None. fn must be importable (defined at module level). The ranks fork from a server
    started once per parent process, so pass environment variables they need (LIONCUB_KERNELS, ...)
    in `env`; by default they get the caller's LIONCUB_* and TRITON_* variables.
    """
    import multiprocessing as mp
    import queue as queue_mod
    import time

    ctx = mp.get_context("forkserver")
    # torch.optim imports torch._dynamo on first use (1-2 s): preload it once in the server
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lioncub.optim"])
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    if env is None:
        env = {k: v for k, v in os.environ.items() if k.startswith(("LIONCUB_", "TRITON_"))}
    port = free_port()
    results_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, fn, args, pg_timeout, threads, results_q, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, failed, deadline = {}, set(), time.monotonic() + timeout
    try:
        while len(results) + len(failed) < world_size:
            try:
                rank, ok, payload = results_q.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in results and r not in failed and p.exitcode not in (None, 0)]
                if dead and not allow_failures:
                    raise SpawnError(f"rank(s) {dead} died (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}) without a result") from None
                failed.update(dead)
                if time.monotonic() > deadline:
                    if allow_failures:
                        break
                    raise SpawnError(f"ranks {sorted(set(range(world_size)) - set(results))} did not "
                                     f"finish within {timeout:.0f}s") from None
                continue
            if not ok:
                if not allow_failures:
                    raise SpawnError(f"rank {rank} failed:\n{payload}")
                failed.add(rank)
                continue
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results.get(r) for r in range(world_size)]
