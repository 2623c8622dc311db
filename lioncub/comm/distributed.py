"""torch.distributed plumbing: initialise under torchrun, SLURM or MPI (lioncub.comm.launch reads which),
broadcast initial weights, end a run cleanly."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from collections.abc import Iterable

import torch
import torch.distributed as dist

from lioncub.comm import clean_exit
from lioncub.comm.launch import launch_env

log = logging.getLogger("lioncub")


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from the launcher's environment: torchrun's (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), else SLURM's (srun) or MPI's (mpirun), as `launch_env` reads them; for the
    latter it also exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun would.
    NCCL when CUDA is available (device LOCAL_RANK, modulo the visible devices), else Gloo. A collective
    that waits longer than `timeout` seconds (a dead or stalled rank) raises instead of hanging. Returns
    (rank, world_size); a plain process (no launcher) or a one-task SLURM/MPI job gets (0, 1) and
    torch.distributed stays uninitialised. A multi-task job it cannot join raises LaunchError."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    where = launch_env()
    if where is None or (where.launcher != "torchrun" and where.world_size == 1):
        return 0, 1
    if where.launcher != "torchrun":
        os.environ.update(RANK=str(where.rank), WORLD_SIZE=str(where.world_size), LOCAL_RANK=str(where.local_rank),
                          MASTER_ADDR=where.master_addr, MASTER_PORT=str(where.master_port))
        if where.rank == 0:
            log.info("lioncub: %s job of %d ranks, master %s:%d", where.launcher, where.world_size,
                     where.master_addr, where.master_port)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(where.local_rank % max(1, torch.cuda.device_count()))
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


def finish() -> None:
    """End a distributed run: wait for every rank, destroy all process groups, settle.

    Call it last in a torchrun script; a bare destroy_process_group(), or no teardown at all, also ends
    cleanly (lioncub.comm.clean_exit runs at exit). finish() adds the barrier, so that no rank tears its groups
    down while another still talks to it, and stops LionCub's communication threads first."""
    clean_exit.settle()  # (the communication threads end before the last collectives)
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    clean_exit.settle()


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
