"""Ranks in the lab: placement, failure, teardown on every exit path, `lab bench` and the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo import HELPERS

from lioncub.apps.lab import Lab, LabError, missing_privileges, netns, probes

WHY = missing_privileges()
RANK = str(HELPERS / "lab_rank.py")
LIONCUB = [sys.executable, "-m", "lioncub.cli"]
pytestmark = pytest.mark.timeout(240)


def residue(rid: str) -> list[str]:
    return [name for names in netns.leftovers().values() for name in names if rid in name]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LIONCUB, *args], capture_output=True, text=True, timeout=timeout)


def needs_root(fn):
    return pytest.mark.root(pytest.mark.skipif(WHY is not None, reason=WHY or "")(fn))


def test_latency_is_rejected_and_help_says_why():
    out = cli("lab", "bench", "--op", "allreduce", "--ranks", "2", "--size", "1MiB", "--latency", "1ms")
    assert out.returncode == 2 and "netem" in out.stderr
    assert "netem" in cli("lab", "up", "--help").stdout
    assert "netem" in cli("lab", "--help").stdout
    with pytest.raises(ValueError, match="netem"):
        Lab(hosts=2, latency="20us")


def _without_privileges() -> list[str]:
    """A command prefix that runs lioncub without the lab's privileges, wherever the checkout lives: as root,
    root stripped of every capability (it still owns, so still reads, its checkout, even under a 0700
    directory; the lab's check reads the capability bits, which are now empty); as anyone else, nothing."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop root's capabilities")
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    probe = subprocess.run([*drop, *LIONCUB, "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"lioncub does not start without capabilities here: {probe.stderr.strip()[-300:]}")
    return drop


def test_without_privileges_every_command_fails_at_once():
    drop = _without_privileges()
    before = set(netns.list_namespaces())
    for args in (["up", "--hosts", "2"], ["down", "--all"], ["clean"], ["list"],
                 ["bench", "--op", "allreduce", "--ranks", "2", "--size", "1MiB"],
                 ["run", "--ranks", "2", "--", "true"]):
        start = time.monotonic()
        out = subprocess.run([*drop, *LIONCUB, "lab", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, (args, out.stderr)
        assert "needs root" in out.stderr and "CAP_NET_ADMIN" in out.stderr, out.stderr
        assert time.monotonic() - start < 30
    assert set(netns.list_namespaces()) == before


@needs_root
def test_ranks_run_in_their_hosts_namespaces_over_gloo():
    with Lab(hosts=2, ranks_per_host=2, bandwidth="1Gbit") as lab:
        out = lab.run([RANK, "gloo_sum"], timeout=120)
        net = lab.network
    assert [r.rank for r in out] == [0, 1, 2, 3] and [r.host for r in out] == [0, 0, 1, 1]
    for r in out:
        got = r.result
        assert got["sum"] == 6 and got["world"] == 4 and got["local_rank"] == r.rank % 2
        ifname = net.hosts[r.host].ifname
        assert got["ifname"] == ifname and sorted(got["interfaces"]) == sorted(["lo", ifname])
        assert got["master"] == "198.18.0.1"
    assert residue(net.run_id) == []


@needs_root
def test_a_killed_rank_fails_the_run_fast_and_nothing_is_left():
    with Lab(hosts=3, bandwidth="1Gbit") as lab:
        start = time.monotonic()
        with pytest.raises(LabError, match=r"rank 1 \(host 1\) was killed by SIGKILL"):
            lab.run([RANK, "die", "1"], timeout=120)
        assert time.monotonic() - start < 60  # startup included; a hang would hit the timeout
        net = lab.network
        assert all(netns.netns_pids(ns) == [] for ns in net.namespaces)  # the survivors were killed
    assert residue(net.run_id) == []


OWNER = """
import sys
from lioncub.apps.lab import Lab
with Lab(hosts=2, bandwidth="100Mbit") as lab:
    print(lab.network.run_id, flush=True)
    lab.run([sys.argv[1], "hang"])
"""


@contextlib.contextmanager
def owned_lab():
    """A separate Python process that owns a lab with two sleeping ranks; on the way out, whatever the
    test did, the owner gets SIGTERM (which tears its lab down)."""
    # as at a terminal: a shell running the suite in the background would have it ignore SIGINT
    owner = subprocess.Popen([sys.executable, "-c", OWNER, RANK], stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        rid = owner.stdout.readline().strip()
        assert rid, "the owner did not build its lab"
        hosts = [f"lioncub-{rid}-h0", f"lioncub-{rid}-h1"]
        pids = wait_for(lambda: (p := [x for h in hosts for x in netns.netns_pids(h)]) and len(p) == 2 and p,
                        30, "both ranks to start")
        yield owner, rid, pids
    finally:
        if owner.poll() is None:
            owner.terminate()
            owner.wait(timeout=30)
        owner.stdout.close()


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_owner_tears_everything_down(sig):
    with owned_lab() as (owner, rid, pids):
        owner.send_signal(sig)
        assert owner.wait(timeout=30) != 0
        assert not any(alive(p) for p in pids)
        assert residue(rid) == []


@needs_root
def test_a_sigkilled_owner_takes_its_ranks_along_and_clean_removes_the_rest():
    with owned_lab() as (owner, rid, pids):
        out = cli("lab", "clean")  # a live run belongs to someone: clean leaves it alone
        assert out.returncode == 0 and rid not in out.stdout and all(alive(p) for p in pids), out
        owner.kill()
        owner.wait()
    wait_for(lambda: not any(alive(p) for p in pids), 10, "the orphaned ranks to die")
    assert residue(rid)  # nothing could tear the namespaces down...
    out = cli("lab", "clean")
    assert out.returncode == 0 and rid in out.stdout, out
    assert residue(rid) == []  # ...until `lab clean`


def line_bound(sent: float, r: dict) -> float:
    """Least time for a rank to send `sent` bytes through its shaped link: the bucket's burst leaves at
    once after an idle period, the rest at the line rate."""
    return max(0.0, sent - r["tbf_burst_bytes"]) * 8 / r["bandwidth_bps"]


@needs_root
def test_bench_many_in_one_lab():
    wanted = [
        {"op": "allreduce", "size": "4MiB", "repeat": 3},
        {"op": "allreduce", "size": "4MiB", "repeat": 3, "ranks": 2, "bandwidth": "1Gbit"},
        {"op": "alltoall", "size": "8MiB", "repeat": 3, "ranks": 2, "bandwidth": "1Gbit"},
    ] + [{"op": op, "size": "4MiB", "repeat": 2, "ranks": 2, "bandwidth": "1Gbit"} for op in ("vote-1bit", "l1-pbit")]
    with Lab(hosts=3, bandwidth="100Mbit") as lab:
        res = probes.bench_many(lab, wanted)
        rid = lab.network.run_id
    first, second = res[0], res[1]
    assert (first["ranks"], first["bandwidth_bps"], second["ranks"], second["bandwidth_bps"]) == (
        3, 1e8, 2, 1e9)
    for r in res:
        assert r["seconds"] == statistics.median(r["times"]) > 0
    # the shaped line is the bottleneck: never faster than the ring's bandwidth bound, not far slower
    for r in res[:2]:
        bound = line_bound(2 * (r["ranks"] - 1) / r["ranks"] * r["bytes"], r)
        assert bound <= r["seconds"] <= 3 * bound, (r, bound)
    assert res[2]["seconds"] >= line_bound(res[2]["bytes"] / 2, res[2])
    for r in res[3:]:  # 1-bit and p-bit votes move far fewer bytes than the fp32 all-reduce
        assert r["n_elements"] == 2**20 and r["seconds"] < second["seconds"], r
    assert residue(rid) == []


@needs_root
def test_cli_up_bench_down():
    out = cli("lab", "up", "--hosts", "2", "--bandwidth", "20Mbit", "--json")
    assert out.returncode == 0, out.stderr
    rid = json.loads(out.stdout)["run_id"]
    try:
        assert rid in cli("lab", "list").stdout
        assert rid not in cli("lab", "clean").stdout and residue(rid)  # `lab up` labs are not debris
        out = cli("lab", "bench", "--lab", rid, "--op", "allgather", "--ranks", "2", "--size", "256KiB",
                  "--repeat", "3", "--json")
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["bandwidth_bps"] == 20e6 and got["bytes"] == 256 * 1024 and len(got["times"]) == 3
        assert got["seconds"] >= line_bound(got["bytes"] / 2, got) > 0
        assert residue(rid)  # still up after the bench
    finally:
        out = cli("lab", "down", rid)
    assert out.returncode == 0 and residue(rid) == [], out.stderr


@needs_root
def test_cli_run_reports_a_failing_rank():
    out = cli("lab", "run", "--ranks", "2", "--", sys.executable, "-c",
              "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)")
    assert out.returncode == 1 and "rank 1 (host 1) exited with code 3" in out.stderr, out.stderr


def test_teardown_reaps_a_rank_whose_wait_lock_a_signal_left_taken():
    """The Lab's handler raises KeyboardInterrupt; raised inside Popen.poll after Popen took its wait lock, it left
    the lock taken, and the teardown's wait() blocked for ever (CI saw a lab's owner never exit after SIGTERM)."""
    from lioncub.apps.lab import launch

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert p._waitpid_lock.acquire(False)  # where the interrupted poll left it
    t0 = time.monotonic()
    launch._kill_all([p])
    assert p.returncode == -signal.SIGKILL and time.monotonic() - t0 < 30
