"""Emulated Ethernet: one switch namespace with a bridge, N host namespaces each with a shaped veth.

Everything a run creates lives inside namespaces named `lioncub-<run id>-...`; the veth pairs are
created directly in the switch and host namespaces, so nothing is added to the root namespace and
deleting a run's namespaces (after killing the processes inside) removes every link it made. A state
file per run (`/run/lioncub-lab/<run id>.json`) records the owner process, so `clean` can tell a
crashed run's leftovers from a live run of someone else.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NS_PREFIX = "lioncub-"
SUBNET = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range; the lab uses nothing else
MAX_HOSTS = 250
_RUN_RE = re.compile(r"^lioncub-([0-9a-f]{6})-(sw|h\d+)$")
_LINK_RE = re.compile(r"^lc[0-9a-f]{6}(br|[ph]\d+)$")

# tbf sizing. Tokens accrue at the rate up to `burst` bytes; data leaves only when the qdisc is
# serviced (a softirq). When the CPUs are busy, softirqs are deferred to ksoftirqd, which may wait for
# the next scheduler tick: 4 ms on this kernel (CONFIG_HZ=250). Tokens that would accrue beyond a full
# bucket during such a gap are lost, so the bucket must hold about one tick of data (rate x 4 ms) or a
# loaded machine never reaches the rate. Measured (research/notebook/LAB-notes.md), single TCP flow at 1 Gbit/s: with
# 1 ms of burst 95.5% goodput idle but 93% with the two cores oversubscribed; with 2 ms, 89-95% at 3x
# oversubscription; with one tick, 95-96% in every case (95.6% is the TCP/IP-over-Ethernet ceiling).
# A larger bucket only hurts: after an idle period the first `burst` bytes leave at memory speed, so a
# transfer of S bytes takes (S - burst)/rate. One tick is the smallest bucket that holds the rate
# under load; `burst_s` can lower it on a quiet machine when short transfers matter more.
TICK_S = 0.004
FRAME = 1514  # Ethernet frame without FCS: what tc accounts per packet on a veth


# TCP congestion control of the hosts' connections, set on their route (so the machine's own default, which
# a namespace inherits, does not decide it): Linux's default, cubic, which clusters keep unless changed. Some
# machines default to bbr (this project's 2-core VMs do); measured on the lab at 1 Gbit/s, 4 ranks, char-small,
# l1-pbit: with bbr about 8% of the step's all-reduces stall 57-123 ms with every rank inside the call (also
# without overlap, not in Python's GC, no queue drops), with cubic none (research/notebook/LAB-notes.md).
# "system": the default.
CONGESTION = "cubic"


def tbf_burst(rate_bps: float, burst_s: float = TICK_S) -> int:
    return int(rate_bps / 8 * burst_s) + FRAME  # + one frame: tbf must always be able to pass a packet


def tbf_limit(rate_bps: float) -> int:
    """Queue bytes behind the bucket: ~20 ms of data, at least 64 frames. Enough that a lone TCP flow
    is never tail-dropped (it runs at the line rate), small enough that incast queues stay realistic."""
    return max(int(rate_bps / 8 * 0.020), 64 * FRAME)


class LabError(RuntimeError):
    """A lab could not be built, a rank failed, or a run timed out."""


class LabPermissionError(LabError):
    pass


def missing_privileges() -> str | None:
    """Why this process cannot build a lab, or None when it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"lioncub lab needs the iproute2 tools ({', '.join(missing)} not found on PATH)"
    try:
        status = Path("/proc/self/status").read_text()
        caps = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    except (OSError, AttributeError):
        caps = -1 if os.geteuid() == 0 else 0
    need = {12: "CAP_NET_ADMIN", 21: "CAP_SYS_ADMIN"}
    lacking = [name for bit, name in need.items() if not caps >> bit & 1]
    if lacking:
        return (
            f"lioncub lab needs root: creating network namespaces, veth links and tc shapers requires "
            f"{' and '.join(lacking)} (run as root, e.g. with sudo)"
        )
    return None


def require_privileges() -> None:
    why = missing_privileges()
    if why:
        raise LabPermissionError(why)


def _run(cmd: list[str], stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _batch(tool: str, netns: str, lines: list[str]) -> None:
    """One `ip`/`tc` process per namespace instead of one per command."""
    _run([tool, "-n", netns, "-batch", "-"], "\n".join(lines) + "\n")


def state_dir() -> Path:
    return Path(os.environ.get("LIONCUB_LAB_STATE", "/run/lioncub-lab"))


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Host:
    index: int
    netns: str
    ifname: str
    addr: str


@dataclass
class Network:
    run_id: str
    rate_bps: float
    hosts: list[Host]
    switch_netns: str
    persistent: bool = False
    owner_pid: int = 0
    owner_start: str | None = None
    burst_s: float = TICK_S
    burst: int = 0
    limit: int = 0
    congestion: str = CONGESTION

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_netns] + [h.netns for h in self.hosts]

    def port(self, index: int) -> str:
        """The switch-side end of host `index`'s veth (a bridge port)."""
        return f"lc{self.run_id}p{index}"

    @property
    def state_file(self) -> Path:
        return state_dir() / f"{self.run_id}.json"

    def save(self) -> None:
        state_dir().mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, run_id: str) -> Network:
        path = state_dir() / f"{run_id}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise LabError(f"no lab {run_id!r} (state file {path}: {exc})") from None
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        return cls(**data)

    def owner_alive(self) -> bool:
        return self.owner_start is not None and _start_time(self.owner_pid) == self.owner_start


def _check_rate(rate_bps: float) -> None:
    if not 1e5 <= rate_bps <= 1e12:
        raise ValueError(f"bandwidth must be between 100kbit and 1Tbit, got {rate_bps:g} bit/s")


def host_addr(index: int) -> str:
    return str(SUBNET[index + 1])


def check_congestion(name: str) -> str:
    """`name` if this kernel has that TCP congestion control (or it is "system"), else a clear error."""
    if name == "system":
        return name
    try:
        available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    except OSError:
        available = []
    if name not in available:
        raise ValueError(f"congestion control {name!r} is not available on this kernel (it has: "
                         f"{', '.join(available) or 'none listed'}; or use 'system')")
    return name


def system_congestion() -> str:
    """The machine's default TCP congestion control (what a namespace inherits)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def create(hosts: int, rate_bps: float, persistent: bool = False, burst_s: float = TICK_S,
           congestion: str = CONGESTION) -> Network:
    """Build a switch and `hosts` shaped hosts; on any failure, remove what was built and raise."""
    require_privileges()
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    _check_rate(rate_bps)
    if not 0 <= burst_s <= 1:
        raise ValueError(f"burst must be between 0 and 1 s of line time, got {burst_s:g} s")
    check_congestion(congestion)
    existing = set(list_namespaces())
    while True:
        rid = secrets.token_hex(3)
        if not any(name.startswith(f"{NS_PREFIX}{rid}-") for name in existing) and not (
            state_dir() / f"{rid}.json"
        ).exists():
            break
    net = Network(
        run_id=rid,
        rate_bps=float(rate_bps),
        hosts=[
            Host(i, f"{NS_PREFIX}{rid}-h{i}", f"lc{rid}h{i}", host_addr(i)) for i in range(hosts)
        ],
        switch_netns=f"{NS_PREFIX}{rid}-sw",
        persistent=persistent,
        owner_pid=os.getpid(),
        owner_start=_start_time(os.getpid()),
        burst_s=burst_s,
        burst=tbf_burst(rate_bps, burst_s),
        limit=tbf_limit(rate_bps),
        congestion=congestion,
    )
    net.save()  # before anything exists, so a crash mid-build is still found by `clean`
    try:
        _build(net)
    except BaseException:
        destroy(net)
        raise
    return net


def _build(net: Network) -> None:
    rid, sw = net.run_id, net.switch_netns
    bridge = f"lc{rid}br"
    for ns in net.namespaces:
        _run(["ip", "netns", "add", ns])
    # no STP, no br_netfilter hooks: a plain learning switch
    sw_ip = [
        "link set lo up",
        f"link add {bridge} type bridge stp_state 0 nf_call_iptables 0 nf_call_ip6tables 0 "
        "nf_call_arptables 0",
        f"link set {bridge} addrgenmode none",
        f"link set {bridge} up",
    ]
    shape = _tbf(net)
    sw_tc = []
    for h in net.hosts:
        port = net.port(h.index)
        sw_ip += [
            f"link add {port} type veth peer name {h.ifname} netns {h.netns}",
            f"link set {port} addrgenmode none",
            f"link set {port} master {bridge}",
            f"link set {port} up",
        ]
        sw_tc.append(f"qdisc add dev {port} {shape}")  # switch -> host: the host's download
    _batch("ip", sw, sw_ip)
    _batch("tc", sw, sw_tc)
    for h in net.hosts:
        congestion = [] if net.congestion == "system" else [
            f"route replace {SUBNET} dev {h.ifname} proto kernel scope link src {h.addr} congctl {net.congestion}"]
        _batch("ip", h.netns, [
            "link set lo up",
            f"link set {h.ifname} addrgenmode none",  # no IPv6 link-local chatter on the wire
            f"addr add {h.addr}/{SUBNET.prefixlen} dev {h.ifname}",
            f"link set {h.ifname} up",
            *congestion,
        ])
        _batch("tc", h.netns, [f"qdisc add dev {h.ifname} {shape}"])  # host -> switch: upload


def _tbf(net: Network) -> str:
    return f"root tbf rate {int(net.rate_bps)}bit burst {net.burst} limit {net.limit}"


def reshape(net: Network, rate_bps: float) -> None:
    """Change every link's rate in place (both directions)."""
    _check_rate(rate_bps)
    net.rate_bps, net.burst, net.limit = (
        float(rate_bps), tbf_burst(rate_bps, net.burst_s), tbf_limit(rate_bps))
    _batch("tc", net.switch_netns,
           [f"qdisc replace dev {net.port(h.index)} {_tbf(net)}" for h in net.hosts])
    for h in net.hosts:
        _batch("tc", h.netns, [f"qdisc replace dev {h.ifname} {_tbf(net)}"])
    net.save()


def _qdisc_sent(netns: str) -> dict[str, tuple[int, int, int]]:
    """dev -> (bytes, packets, drops) of its root qdisc, for every device of a namespace (one `tc`)."""
    found = json.loads(_run(["tc", "-n", netns, "-s", "-j", "qdisc", "show"]) or "[]")
    return {q["dev"]: (int(q["bytes"]), int(q["packets"]), int(q.get("drops", 0)))
            for q in found if q.get("root", True)}


def link_counters(net: Network, hosts: list[int] | None = None) -> list[dict[str, int]]:
    """Counters of each host's link (all hosts, or those indexed by `hosts`), as monotonic totals:

    * `tx_bytes`/`tx_frames`: Ethernet frames the host sent up its link, as its upload shaper (tbf)
      accounted them: 14-byte header + IP packet per frame, a GSO burst counted as the frames it becomes
      (the bytes a real Ethernet wire carries, less preamble, FCS and gap). `rx_bytes`/`rx_frames`: the
      same from the switch port's shaper, the host's download. `tx_drops`/`rx_drops`: frames the shapers
      dropped because their queue was full (TCP then retransmits and backs off).
    * `veth_tx_bytes`, `veth_rx_bytes`, `veth_tx_packets`, `veth_rx_packets`: the host's veth counters.
      The kernel hands a veth GSO bursts of up to 64 KiB with one header each, so these count about one
      header per 64 KiB: the payload plus ~0.1%, where the frames above add ~4.6% (1514 per 1448 bytes of
      TCP payload).

    Traffic between two processes of one host never appears here: it stays on the namespace's loopback
    (tests/apps/test_lab_local.py). Three `ip`/`tc` calls per host: read them around a window, not every step."""
    ports = _qdisc_sent(net.switch_netns)
    out = []
    for i in range(len(net.hosts)) if hosts is None else hosts:
        h = net.hosts[i]
        [link] = json.loads(_run(["ip", "-n", h.netns, "-j", "-s", "link", "show", "dev", h.ifname]))
        up, down = _qdisc_sent(h.netns)[h.ifname], ports[net.port(i)]
        stats = link["stats64"]
        out.append(dict(tx_bytes=up[0], rx_bytes=down[0], tx_frames=up[1], rx_frames=down[1], tx_drops=up[2],
                        rx_drops=down[2],
                        **{f"veth_{d}_{k}": int(stats[d][k]) for d in ("tx", "rx") for k in ("bytes", "packets")}))
    return out


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    try:
        return [int(p) for p in _run(["ip", "netns", "pids", netns]).split()]
    except LabError:
        return []


def kill_netns_processes(namespaces: list[str], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process still inside these namespaces (only a lab's own ranks and
    probes ever run there)."""
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        pids = [p for ns in namespaces for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL and time.monotonic() > deadline + 3:
            raise LabError(f"processes {pids} in the lab's namespaces do not die")
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.05)


def destroy(net: Network) -> None:
    """Remove a run completely; safe to call twice and on a half-built run."""
    remove_run(net.run_id, net.namespaces)


def remove_run(rid: str, namespaces: list[str]) -> None:
    present = set(list_namespaces())
    namespaces = [ns for ns in namespaces if ns in present]
    errors = []
    try:
        kill_netns_processes(namespaces)
    except LabError as exc:
        errors.append(str(exc))
    # hosts first: deleting a host namespace takes its veth pair (and the switch port) with it
    for ns in sorted(namespaces, key=lambda n: n.endswith("-sw")):
        try:
            _run(["ip", "netns", "del", ns])
        except LabError as exc:
            errors.append(str(exc))
    (state_dir() / f"{rid}.json").unlink(missing_ok=True)
    if errors:
        raise LabError("teardown incomplete: " + "; ".join(errors))


def leftovers() -> dict[str, list[str]]:
    """Everything with the lioncub prefix: namespaces, root-namespace links, state files."""
    links = [
        name.split("@")[0]
        for name in re.findall(r"^\d+: (\S+):", _run(["ip", "-o", "link", "show"]), re.M)
    ]
    files = sorted(p.stem for p in state_dir().glob("*.json")) if state_dir().is_dir() else []
    return {
        "namespaces": [ns for ns in list_namespaces() if ns.startswith(NS_PREFIX)],
        "links": [name for name in links if _LINK_RE.match(name)],
        "state_files": files,
    }


def runs() -> dict[str, dict]:
    """run id -> {"namespaces": [...], "network": Network | None, "live": bool}."""
    found: dict[str, dict] = {}
    for ns in list_namespaces():
        m = _RUN_RE.match(ns)
        if m:
            found.setdefault(m.group(1), {"namespaces": []})["namespaces"].append(ns)
    if state_dir().is_dir():
        for path in state_dir().glob("*.json"):
            found.setdefault(path.stem, {"namespaces": []})
    for rid, info in found.items():
        try:
            net = Network.load(rid)
        except (LabError, TypeError):
            net = None
        info["network"] = net
        info["live"] = net is not None and (net.persistent or net.owner_alive())
    return found


def clean(everything: bool = False) -> list[str]:
    """Remove the runs whose owner is gone (crashed or killed), or with `everything` every lioncub run,
    live or persistent. Returns the run ids removed."""
    require_privileges()
    removed = []
    for rid, info in sorted(runs().items()):
        if info["live"] and not everything:
            continue
        remove_run(rid, info["namespaces"])
        removed.append(rid)
    for name in leftovers()["links"]:  # never made by lioncub in the root namespace, but be thorough
        if everything or name[2:8] in removed:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    return removed
