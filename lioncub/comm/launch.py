"""Who this process is in its job, read from the launcher's environment (torchrun, SLURM's srun, Open MPI,
MPICH / Intel MPI) and nothing else. Imports no torch."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500  # torchrun's; under SLURM without MASTER_PORT: DEFAULT_PORT + SLURM_JOB_ID % 1000


class LaunchError(RuntimeError):
    """This process is one task of a multi-task job whose process group cannot be formed from its environment."""


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in its job, as the launcher's environment variables say."""

    launcher: str  # "torchrun", "slurm", "openmpi" or "pmi"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None  # None under torchrun (its own variables stay in charge)
    master_port: int | None


def _int(env: Mapping[str, str], key: str, launcher: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"{launcher}: {key}={env[key]!r} is not an integer") from None


def _first(env: Mapping[str, str], *keys: str) -> str | None:
    return next((env[k] for k in keys if env.get(k)), None)


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """This process's place in its job, read from `env` (default os.environ) and nothing else; None if no
    launcher's variables are there (a plain single process). In order of precedence:

    * torchrun (or any launcher that sets RANK and WORLD_SIZE): as is.
    * SLURM (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS, SLURM_NPROCS), SLURM_LOCALID;
      master: MASTER_ADDR if set, else the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST,
      SLURM_NODELIST; compressed lists such as "node[01-04,07]" are expanded): where srun starts task 0 with
      its default distributions. Port: MASTER_PORT if set, else 29500 + SLURM_JOB_ID % 1000 (two jobs
      sharing their first node get different ports).
    * Open MPI (mpirun): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK; MPICH / Intel MPI (hydra): PMI_RANK,
      PMI_SIZE, MPI_LOCALRANKID. Master: MASTER_ADDR, or 127.0.0.1 when every rank is on this host (local
      size = size); port: MASTER_PORT or 29500.

    A multi-task job that cannot be joined raises LaunchError (never a silent single-rank run): SLURM's task
    count above 1 without SLURM_PROCID (the batch script itself, not a task srun started), a node list that
    cannot be parsed, an MPI job over several hosts without MASTER_ADDR, a rank outside [0, world size)."""
    env = os.environ if env is None else env
    for read in (_torchrun_env, _slurm_env, _mpi_env):
        found = read(env)
        if found is not None:
            return found
    return None


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv | None:
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK", "torchrun"), _int(env, "WORLD_SIZE", "torchrun")
        local = _int(env, "LOCAL_RANK", "torchrun") if env.get("LOCAL_RANK") else 0
        return _checked(LaunchEnv("torchrun", rank, world, local, None, None))
    return None


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv | None:
    ntasks_key = next((k for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(k)), None)
    if ntasks_key is None:
        return None
    world = _int(env, ntasks_key, "SLURM")
    if world <= 1:
        return LaunchEnv("slurm", 0, 1, 0, None, None)
    if not env.get("SLURM_PROCID"):
        raise LaunchError(
            f"SLURM: {ntasks_key}={world} but this process has no SLURM_PROCID, so it is not one of the "
            f"job's tasks (is this the batch script itself?). Start the ranks with `srun python ...` (or "
            f"torchrun), or run one process alone with --ntasks=1 (or SLURM_NTASKS unset).")
    rank = _int(env, "SLURM_PROCID", "SLURM")
    local = _int(env, "SLURM_LOCALID", "SLURM") if env.get("SLURM_LOCALID") else 0
    master = env.get("MASTER_ADDR")
    if not master:
        nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise LaunchError(f"SLURM: {world} tasks but no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST to find "
                              f"the master host in; set MASTER_ADDR")
        master = expand_hostlist(nodelist)[0]
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT", "SLURM")
    else:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
        port = DEFAULT_PORT + (int(job) % 1000 if job.isdigit() else 0)
    return _checked(LaunchEnv("slurm", rank, world, local, master, port))


# launcher -> its variables: rank, size, local rank, local size
_MPI_KEYS = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def _mpi_env(env: Mapping[str, str]) -> LaunchEnv | None:
    for launcher, (rank_key, size_key, local_key, local_size_key) in _MPI_KEYS.items():
        if not env.get(size_key):
            continue
        world = _int(env, size_key, launcher)
        if world <= 1:
            return LaunchEnv(launcher, 0, 1, 0, None, None)
        if not env.get(rank_key):
            raise LaunchError(f"{launcher}: {size_key}={world} but no {rank_key}")
        rank = _int(env, rank_key, launcher)
        local = _int(env, local_key, launcher) if env.get(local_key) else 0
        master = env.get("MASTER_ADDR")
        if not master:
            local_size = _int(env, local_size_key, launcher) if env.get(local_size_key) else None
            if local_size != world:
                raise LaunchError(f"{launcher}: {world} ranks over several hosts (or an unknown local size) and no "
                                  f"MASTER_ADDR: MPI does not say where rank 0 runs; export MASTER_ADDR=<its host> "
                                  f"(e.g. mpirun -x MASTER_ADDR=...)")
            master = "127.0.0.1"
        port = _int(env, "MASTER_PORT", launcher) if env.get("MASTER_PORT") else DEFAULT_PORT
        return _checked(LaunchEnv(launcher, rank, world, local, master, port))
    return None


def _checked(e: LaunchEnv) -> LaunchEnv:
    if e.world_size < 1 or not 0 <= e.rank < e.world_size or e.local_rank < 0:
        raise LaunchError(f"{e.launcher}: rank {e.rank} (local {e.local_rank}) of world size {e.world_size} is "
                          f"not a valid place in the job")
    if e.master_port is not None and not 0 < e.master_port < 65536:
        raise LaunchError(f"{e.launcher}: port {e.master_port} is not a TCP port")
    return e


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: "node[01-03,07],gpu5" -> node01, node02, node03,
    node07, gpu5 (zero padding kept; several bracket groups in one name, such as "r[1-2]-n[1-2]", multiply).
    Raises LaunchError for anything else."""
    hosts = []
    for item in _split_top(text.strip(), text):
        hosts += _expand(item, text)
    if not hosts:
        raise LaunchError(f"SLURM: empty node list {text!r}")
    return hosts


def _split_top(text: str, whole: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (brackets)")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (brackets)")
    items.append(text[start:])
    if any(not item or item.isspace() for item in items):
        raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (an empty name)")
    return [item.strip() for item in items]


def _expand(item: str, whole: str) -> list[str]:
    open_ = item.find("[")
    if open_ < 0:
        if "]" in item:
            raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (brackets)")
        return [item]
    close = item.index("]", open_)
    prefix, body, rest = item[:open_], item[open_ + 1 : close], item[close + 1 :]
    values = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (range {part!r})")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"SLURM: cannot parse the node list {whole!r} (range {part!r} runs backwards)")
        values += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    tails = _expand(rest, whole) if rest else [""]
    return [prefix + v + t for v in values for t in tails]
