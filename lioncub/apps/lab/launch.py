"""Start one process per rank inside its host's namespace and collect what each reports.

Rank r runs on host r // ranks_per_host under `ip netns exec`, with the torchrun-style environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR on host 0, ...) and GLOO_SOCKET_IFNAME naming the host's
lab interface. Ranks of one host talk to each other over the namespace's loopback: they share the host's
address, which the kernel delivers locally, so only traffic between hosts crosses the shaped link (as
NVLink keeps a node's traffic off its NIC; tests/apps/test_lab_local.py measures it). A rank reports a result
by writing JSON to $LIONCUB_LAB_RESULT (see `report`) and reads its host link's counters with
`link_counters`.

The first rank that exits non-zero or is killed fails the whole run at once: the launcher kills every
other rank (each in its own process group) and raises LabError naming the rank and quoting its
stderr. Ranks also get SIGKILL from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .netns import LabError, Network

MASTER_PORT = 29500  # each lab has its own namespaces, so a fixed port never collides with other runs
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def report(result) -> None:
    """Called inside a rank: hand a JSON-serializable result back to the launcher (no-op elsewhere)."""
    path = os.environ.get("LIONCUB_LAB_RESULT")
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)


def link_counters() -> dict[str, int] | None:
    """Called inside a rank: its host's link counters (see `netns.link_counters`), or None outside a lab.
    The ranks of one host share its link, so they read the same counters."""
    run, host = os.environ.get("LIONCUB_LAB_RUN"), os.environ.get("GROUP_RANK")
    if not run or host is None:
        return None
    from .netns import Network
    from .netns import link_counters as read

    return read(Network.load(run), [int(host)])[0]


@dataclass
class RankResult:
    rank: int
    host: int
    returncode: int
    stdout: str
    stderr: str
    result: object = None


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def launch(
    net: Network,
    argv: list[str],
    ranks: int,
    ranks_per_host: int = 1,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    port: int = MASTER_PORT,
    stream_rank0: bool = False,
) -> list[RankResult]:
    """Run `argv` as `ranks` ranks on the lab's first ceil(ranks / ranks_per_host) hosts: start every rank,
    wait for all of them (the first failure stops the run), then collect what each left."""
    if ranks < 1 or ranks_per_host < 1:
        raise ValueError("ranks and ranks_per_host must be positive")
    if -(-ranks // ranks_per_host) > len(net.hosts):
        raise ValueError(
            f"{ranks} ranks at {ranks_per_host} per host need {-(-ranks // ranks_per_host)} hosts; "
            f"the lab has {len(net.hosts)}"
        )
    if argv and argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    with tempfile.TemporaryDirectory(prefix=f"lioncub-lab-{net.run_id}-") as tmp:
        logs = Path(tmp)
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(ranks):
                renv = _rank_env(net, rank, ranks, ranks_per_host, env, port, logs)
                quiet = rank > 0 or not stream_rank0
                procs.append(_start_rank(net.hosts[rank // ranks_per_host], argv, renv, logs, rank, quiet))
            _wait(procs, logs, ranks_per_host, timeout)
        finally:
            _kill_all(procs)
        return [_result(logs, rank, rank // ranks_per_host, proc.returncode) for rank, proc in enumerate(procs)]


def _rank_env(net: Network, rank: int, ranks: int, ranks_per_host: int, env, port: int, logs: Path) -> dict:
    """The environment of one rank: ours, `env`, and the torchrun-style variables of its place in the lab."""
    host = net.hosts[rank // ranks_per_host]
    renv = dict(os.environ)
    renv.update(env or {})
    renv.update(
        RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_RANK=str(rank % ranks_per_host),
        LOCAL_WORLD_SIZE=str(ranks_per_host),
        GROUP_RANK=str(host.index),
        MASTER_ADDR=net.hosts[0].addr,
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=host.ifname,
        LIONCUB_LAB_RUN=net.run_id,
        LIONCUB_LAB_RESULT=str(logs / f"result{rank}.json"),
    )
    renv.setdefault("OMP_NUM_THREADS", "1")  # ranks share the machine's few cores
    return renv


def _start_rank(host, argv: list[str], renv: dict, logs: Path, rank: int, quiet: bool) -> subprocess.Popen:
    """One rank inside its host's namespace; unless `quiet`, its output goes to our terminal."""
    with open(logs / f"out{rank}", "w") as out, open(logs / f"err{rank}", "w") as err:
        return subprocess.Popen(
            ["ip", "netns", "exec", host.netns, *argv],
            env=renv,
            stdin=subprocess.DEVNULL,
            stdout=out if quiet else None,
            stderr=err if quiet else None,
            start_new_session=True,  # the whole rank, children included, can be killed
            preexec_fn=_die_with_parent,
        )


def _result(logs: Path, rank: int, host: int, returncode: int) -> RankResult:
    """What a finished rank left: its exit status, the tails of its output and the result it reported."""
    out = logs / f"result{rank}.json"
    return RankResult(
        rank,
        host,
        returncode,
        _tail(logs / f"out{rank}", 1 << 20),
        _tail(logs / f"err{rank}", 1 << 20),
        json.loads(out.read_text()) if out.exists() else None,
    )


def _wait(procs, logs: Path, ranks_per_host: int, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # several ranks may fail in one poll: the one killed by a signal is the cause, the rest
            # usually died of the broken connections it left
            rank = min(failed, key=lambda r: (codes[r] >= 0, r))
            others = [r for r in failed if r != rank]
            msg = (
                f"rank {rank} (host {rank // ranks_per_host}) {_describe_exit(codes[rank])}; "
                f"the run was stopped"
            )
            if others:
                msg += f" (ranks {others} failed too)"
            tail = _tail(logs / f"err{rank}")
            raise LabError(msg + (f"\n--- rank {rank} stderr (tail) ---\n{tail}" if tail else ""))
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise LabError(f"timed out after {timeout:g}s; ranks {running} still running")
        time.sleep(0.02)


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        _reap(p)


def _reap(p, patience: float = 5.0) -> None:
    """Wait for a killed rank. Popen.wait blocks for ever on Popen's wait lock if a signal handler (the Lab's, which
    raises KeyboardInterrupt) fired inside Popen.poll after the lock was taken (seen once in CI: the owner, sent
    SIGTERM, never exited); then reap the process directly."""
    try:
        p.wait(timeout=patience)
    except subprocess.TimeoutExpired:
        try:
            p.returncode = os.waitstatus_to_exitcode(os.waitpid(p.pid, 0)[1])
        except ChildProcessError:  # (reaped meanwhile)
            p.returncode = -signal.SIGKILL

