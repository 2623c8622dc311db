"""`Lab`: the emulated cluster as a Python context manager.

    with Lab(hosts=4, bandwidth="100Mbit") as lab:
        ranks = lab.run(["train.py", "--steps", "10"])      # one process per rank, torchrun-style env
        lab.set_bandwidth("1Gbit")                           # reshape every link in place

Timing collectives in a lab is `lioncub.apps.lab.probes`' job.

The lab is torn down on leaving the block, whatever the reason: normal exit, an exception, a failed
rank, Ctrl-C, or SIGTERM (turned into KeyboardInterrupt while the lab is up). If the Python process
is SIGKILLed, its ranks die with it and `lioncub lab clean` removes the namespaces it left.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

from lioncub.simulator.units import format_rate, parse_rate, parse_time

from . import netns
from .launch import RankResult, launch
from .netns import LabError, Network


def check_latency(latency) -> None:
    if parse_time(latency or 0) != 0:
        raise ValueError(
            "the lab cannot add latency: this kernel has no netem qdisc (sch_netem), only tbf/htb "
            "shaping; links have the namespaces' native delay (tens of microseconds). Use --latency 0."
        )


def ranks_per_host_for(ranks: int, hosts: int | None = None, ranks_per_host: int | None = None) -> int:
    """Ranks per host for `ranks` ranks given --hosts and/or --ranks-per-host (two of the three determine
    the third; default one rank per host)."""
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}")
    if hosts is not None and ranks_per_host is not None:
        if hosts * ranks_per_host != ranks:
            raise ValueError(f"--ranks {ranks} differs from --hosts {hosts} x --ranks-per-host "
                             f"{ranks_per_host}; give two of the three")
        return ranks_per_host
    if hosts is not None:
        if hosts < 1 or ranks % hosts:
            raise ValueError(f"--ranks {ranks} must be a multiple of --hosts {hosts}")
        return ranks // hosts
    rph = ranks_per_host or 1
    if rph < 1 or ranks % rph:
        raise ValueError(f"--ranks {ranks} must be a multiple of --ranks-per-host {rph}")
    return rph


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


class Lab:
    def __init__(
        self,
        hosts: int | None = None,
        bandwidth: str | float = "1Gbit",
        ranks_per_host: int = 1,
        ranks: int | None = None,
        latency: str | float = 0,
        attach: str | None = None,
        burst: str | float | None = None,
        congestion: str | None = None,
    ):
        """`hosts` hosts (or enough for `ranks` at `ranks_per_host` each), every link shaped to
        `bandwidth` both ways. With `attach`, use the persistent lab of that run id (from `lioncub lab
        up`) instead of building one; it is left standing on exit. `burst` is the tbf bucket as line
        time (default one 4 ms timer tick; see netns.py and docs/lab.md). `congestion`: the hosts' TCP
        congestion control (default netns.CONGESTION, cubic; "system" keeps the machine's)."""
        check_latency(latency)
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        if hosts is None:
            hosts = -(-(ranks or 2) // ranks_per_host)
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate_bps = parse_rate(bandwidth)
        self.attach = attach
        self.burst_s = netns.TICK_S if burst is None else parse_time(burst)
        self.congestion = netns.check_congestion(congestion or netns.CONGESTION)
        self.net: Network | None = None
        self._old_sigterm = None
        self._launches = 0

    # -- life cycle -------------------------------------------------------------------------------
    def up(self) -> Lab:
        netns.require_privileges()
        if self.attach:
            self.net = Network.load(self.attach)
            self.hosts, self.rate_bps = len(self.net.hosts), self.net.rate_bps
            return self
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.net = netns.create(self.hosts, self.rate_bps, burst_s=self.burst_s, congestion=self.congestion)
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def down(self) -> None:
        if self.net is None or self.attach:
            self.net = None
            return
        # no signal may interrupt the teardown itself; pending ones are delivered after it
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            netns.destroy(self.net)
            self.net = None
        finally:
            self._restore_sigterm()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- using it ---------------------------------------------------------------------------------
    @property
    def network(self) -> Network:
        if self.net is None:
            raise LabError("the lab is not up (use `with Lab(...) as lab:` or lab.up())")
        return self.net

    @property
    def max_ranks(self) -> int:
        return len(self.network.hosts) * self.ranks_per_host

    def set_bandwidth(self, bandwidth: str | float) -> None:
        """Reshape every link in place (no new namespaces)."""
        rate = parse_rate(bandwidth)
        if rate != self.network.rate_bps:
            netns.reshape(self.network, rate)
        self.rate_bps = rate

    def run(
        self,
        argv: list[str],
        ranks: int | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stream_rank0: bool = False,
    ) -> list[RankResult]:
        """Run `argv` once per rank (a script path gets this Python prepended); raises LabError when a
        rank fails or the timeout passes. Each rank's `lioncub.apps.lab.report(...)` value is its `.result`."""
        self._launches += 1
        return launch(
            self.network,
            list(argv),
            ranks or self.max_ranks,
            self.ranks_per_host,
            env=env,
            timeout=timeout,
            port=29500 + self._launches % 1000,  # never reuse a port a previous run left in TIME_WAIT
            stream_rank0=stream_rank0,
        )

    def link_counters(self) -> list[dict[str, int]]:
        """Each host's link counters now (tx/rx bytes and packets at the host's veth end; see
        netns.link_counters). Ranks read their own host's with `lioncub.apps.lab.link_counters()`."""
        return netns.link_counters(self.network)

    def measure_rate(
        self, nbytes: int, src: int = 0, dst: int = 1, port: int = 5201, start_at: float | None = None
    ) -> dict:
        """One TCP transfer of `nbytes` from host `src` to host `dst`: {"bytes", "seconds", "bps",
        "start", "end"} (time.monotonic() values). With `start_at`, sending starts at that time."""
        net = self.network
        rx = subprocess.Popen(
            ["ip", "netns", "exec", net.hosts[dst].netns, sys.executable, "-m", "lioncub.apps.lab.tcp",
             "recv", str(port)],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            if rx.stdout.readline().strip() != "ready":
                raise LabError("the TCP receiver did not start")
            tx = subprocess.run(
                ["ip", "netns", "exec", net.hosts[src].netns, sys.executable, "-m", "lioncub.apps.lab.tcp",
                 "send", net.hosts[dst].addr, str(port), str(int(nbytes)),
                 *([] if start_at is None else [repr(start_at)])],
                capture_output=True, text=True, timeout=300,
            )
            if tx.returncode != 0:
                raise LabError(f"TCP sender failed: {tx.stderr.strip()[-2000:]}")
            rx.wait(timeout=30)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
            rx.stdout.close()
        return dict(json.loads(tx.stdout), rate_bps=net.rate_bps)

    def describe(self) -> dict:
        net = self.network
        return {
            "run_id": net.run_id,
            "bandwidth": format_rate(net.rate_bps),
            "bandwidth_bps": net.rate_bps,
            "tbf_burst_bytes": net.burst,
            "tbf_limit_bytes": net.limit,
            "congestion_control": netns.system_congestion() if net.congestion == "system" else net.congestion,
            "ranks_per_host": self.ranks_per_host,
            "hosts": [
                {"index": h.index, "netns": h.netns, "ifname": h.ifname, "addr": h.addr}
                for h in net.hosts
            ],
            "switch_netns": net.switch_netns,
        }
