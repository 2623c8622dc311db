"""Local Gloo ranks for tests and benchmarks: run a function on N processes of this machine and collect what
each returns."""

from __future__ import annotations

import datetime
import io
import math
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from lioncub.comm.distributed import free_port


def _worker(rank, world_size, port, fn, args, timeout, threads, queue, env, session):
    if session:
        os.setsid()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except BaseException as exc:  # (fn has not run: spawn may start over on another port)
        queue.put((rank, False, (traceback.format_exc(), False, str(exc), True)))
        return
    try:
        result = fn(rank, world_size, *args)
        # tensors go back as bytes: torch's shared-memory pickling needs the sender alive
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException as exc:
        queue.put((rank, False, (traceback.format_exc(), isinstance(exc, ValueError), str(exc), False)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class SpawnError(RuntimeError):
    pass


class RankInputError(SpawnError, ValueError):
    """A rank rejected its input (raised ValueError): lioncub's commands report it in one line, as bad input.
    `traceback` is the rank's."""

    def __init__(self, rank: int, message: str, tb: str):
        super().__init__(f"rank {rank}: {message}")
        self.traceback = tb


RENDEZVOUS_TRIES = 3


class _Rendezvous(SpawnError):
    """A rank could not join the process group (its port taken by another process between free_port and the
    store's bind, a peer's connection refused): nothing ran, so spawn starts over."""


def _failure(rank: int, tb: str, bad_input: bool, message: str, at_start: bool) -> SpawnError:
    if at_start:
        return _Rendezvous(f"rank {rank} could not join the process group:\n{tb}")
    return RankInputError(rank, message, tb) if bad_input else SpawnError(f"rank {rank} failed:\n{tb}")


def spawn(fn: Callable, world_size: int, *args, timeout: float | None = 120.0, pg_timeout: float = 60.0,
          threads: int | None = None, allow_failures: bool = False, env: dict | None = None,
          sessions: bool = False) -> list:
    """Run fn(rank, world_size, *args) on `world_size` local Gloo ranks; return their results by rank.

    Processes come from a forkserver that has torch imported already, so each rank starts in a fraction
    of a second. If a rank raises or dies, the others are stopped and SpawnError carries its traceback;
    with allow_failures=True the others run on, and a rank that failed, died or did not finish within
    `timeout` seconds (None: no limit) gets None. fn must be importable (defined at module level). The ranks
    fork from a server started once per parent process, so pass environment variables they need
    (LIONCUB_KERNELS, ...) in `env`; by default they get the caller's LIONCUB_* and TRITON_* variables.
    `sessions`: each rank in a session of its own, as torchrun and the lab start ranks (where the kernel groups
    scheduling by session, autogroup, each rank is then a scheduling group of its own). A rank that cannot join
    the process group (another process took the port) makes spawn start over on another port, up to 3 times.
    """
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"ranks must be at least 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    # torch.optim imports torch._dynamo on first use (1-2 s): preload it once in the server
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lioncub.optim.optimizer"])
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    if env is None:
        env = {k: v for k, v in os.environ.items() if k.startswith(("LIONCUB_", "TRITON_"))}
    for attempt in range(RENDEZVOUS_TRIES):
        try:
            return _run(ctx, fn, world_size, args, free_port(), timeout, pg_timeout, threads, allow_failures, env,
                        sessions)
        except _Rendezvous:
            if attempt + 1 == RENDEZVOUS_TRIES:
                raise


def _run(ctx, fn, world_size, args, port, timeout, pg_timeout, threads, allow_failures, env, sessions) -> list:
    """One try of spawn on `port`."""
    results_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, fn, args, pg_timeout, threads, results_q, env, sessions))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        _collect(procs, results_q, results, timeout, allow_failures)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results.get(r) for r in range(world_size)]


def _collect(procs: list, results_q, results: dict, timeout: float | None, allow_failures: bool) -> None:
    """Fill `results` (rank -> value) from the ranks' queue until every rank has answered, failed or died, or
    `timeout` seconds pass (see spawn)."""
    import queue as queue_mod
    import time

    world_size, failed = len(procs), set()
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
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
                    return
                raise SpawnError(f"ranks {sorted(set(range(world_size)) - set(results))} did not "
                                 f"finish within {timeout:.0f}s") from None
            continue
        if not ok:
            err = _failure(rank, *payload)
            if not allow_failures or isinstance(err, _Rendezvous):
                raise err
            failed.add(rank)
            continue
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
