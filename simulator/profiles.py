"""Backend profiles: how a communication library runs on the wire, as physically meaningful parameters.

A profile is a plain dataclass. Every field is a mechanism the simulator models (not a fudge factor on
the final answer), so that a calibration run can fit it from measurements and write a JSON file that
`BackendProfile.load(path, base=...)` (CLI: `--calibration FILE`) lays over a built-in profile.

Built-in profiles
-----------------
* `ideal`: nominal link rates, no overheads, no window limit, no pipelining, free reductions. The
  simulator then reproduces the textbook alpha-beta(-gamma) formulas exactly (set `reduce_bandwidth` to
  add the gamma term).
* `nccl`: NCCL's socket transport. Ring and tree run **pipelined**: every step's chunk is cut into
  slices that are forwarded as soon as they arrive, so a large ring allreduce costs
  2(p-1)/p * n/B plus a constant number of latencies, not 2(p-1) of them. Several sockets per peer
  (channels) and large socket buffers: no TCP window limit. GPU reductions are free next to the wire.
* `gloo`: Gloo's TCP transport. Algorithms run **step by step** (each step's chunk is one message, sent
  after the previous one arrived), one socket per peer whose throughput is capped by the TCP window
  (Linux default autotuning: tcp_rmem max 6 MiB, half of it advertised, i.e. ~3 MiB), reductions and
  copies on one CPU thread. At high latency this is far slower than NCCL (window/RTT caps each flow).

The default numbers of `nccl` and `gloo` are starting points from public sources (NCCL's tuning
constants, Linux TCP defaults, Gloo issue threads); calibration refines them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lioncub import methods
from lioncub.files import read_json

from .step.hosts import HostModel

# the collectives an algorithm can implement (collectives/algorithm.py; lioncub's composites are made of them:
# collectives/simulate.py), by which a profile's efficiencies and algorithms are keyed
PRIMITIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "reduce")
# the built-in profiles that list the algorithms their library implements ("ideal" and a profile without a
# list run every registered algorithm)
LIBRARIES = ("nccl", "gloo")
# The registered algorithms' names: by op, in the registry's order (every profile's choice unless it lists its
# own), and by library. collectives/registry.py keeps them as it registers the records, and lioncub.simulator
# imports it before a profile can be asked for: a profile reads names, and this module imports no algorithm.
ALL_ALGORITHMS: dict[str, list[str]] = {op: [] for op in PRIMITIVES}
LIBRARY_ALGORITHMS: dict[str, dict[str, list[str]]] = {lib: {op: [] for op in PRIMITIVES} for lib in LIBRARIES}

# Ethernet + IPv4 + TCP framing at MTU 1500: a 1500-byte IP packet carries 1500 - 20 (IP) - 20 (TCP)
# - 12 (TCP timestamp option) = 1448 payload bytes and takes 1500 + 14 (header) + 4 (FCS) + 8 (preamble)
# + 12 (inter-frame gap) = 1538 byte times on the wire.
ETH_OVERHEAD = 14 + 4 + 8 + 12
IP_TCP_OVERHEAD = 20 + 20 + 12

FAMILIES = (*PRIMITIVES, "p2p")
# kernels whose speed `codec_bandwidth` can give: each method's codec (by its name), the Lion update, the 1-bit vote
CODEC_KERNELS = (*methods.NAMES, "update", "vote")


def tcp_efficiency(mtu: int = 1500) -> float:
    """Payload bytes per wire byte of a bulk TCP stream over Ethernet at this MTU."""
    if mtu <= IP_TCP_OVERHEAD:
        raise ValueError(f"MTU {mtu} is too small")
    return (mtu - IP_TCP_OVERHEAD) / (mtu + ETH_OVERHEAD)


@dataclass
class BackendProfile:
    """How one communication library behaves. Units: seconds, bytes, bytes per second.

    name: label shown in results.
    wire_efficiency: payload bytes per byte of NIC line rate (Ethernet/IP/TCP framing); every byte a
        flow sends costs 1/wire_efficiency bytes of NIC and switch capacity. 1448/1538 = 0.9415 for TCP
        at MTU 1500 (`tcp_efficiency(mtu)`), 1.0 for `ideal`. Not applied inside a node.
    efficiency: per operation family (allreduce, allgather, reducescatter, alltoall, broadcast, reduce,
        p2p), a further payload efficiency of that library's implementation of it: a flow of that family
        costs 1/efficiency bytes of every link it crosses per payload byte. Families not listed use 1.0.
        Fit it from large-message, low-latency runs (busbw / line rate / wire_efficiency).
    message_overhead: software time per message (LogP's o: syscalls, proxy thread, copies' fixed part),
        paid by the sender before the message is handed to the network. Fit from small messages.
    call_overhead: fixed time per collective call on every rank (kernel launch, Python, handshakes).
    reduce_bandwidth: bytes per second a rank reduces (sums) received data at; gamma = 1/reduce_bandwidth.
        None: free (GPU reductions next to Ethernet).
    host_bandwidth: bytes per second one rank's communication stack can move in each direction (a CPU
        thread copying into sockets, summed over its connections). None: unlimited.
    window_bytes: bytes in flight per socket (TCP receive window); each socket's rate is capped at
        window_bytes / RTT with RTT = 2 * latency. None: no cap.
    channels: sockets per peer connection (NCCL channels x sockets); a connection gets `channels` fair
        shares of a contended link and `channels` windows.
    slice_bytes: pipelining granularity. When set, ring and tree algorithms cut each step's chunk into
        slices of at most this size and forward every slice as soon as it has arrived (NCCL). None: one
        message per step, the next step starting when the previous one arrived (Gloo, MPI).
    algorithms: per operation, the algorithms this library implements, which `algorithm="auto"` chooses
        from. Any algorithm can still be asked for by name.
    link_burst: seconds of line time every NIC port can pass at once after being idle: a token bucket
        (Linux tbf's burst, a switch's buffer credit) that refills at the line rate whenever the port
        is not saturated. While it holds tokens the port does not limit its flows. 0: none (a real NIC).
    rendezvous: sends wait for the receiver's ready-to-receive notice, as on Gloo's TCP pairs: a rank
        posting a receive sends a small notice to the sender on its own connection (behind any data it
        queued there), and the sender's data goes out once the notice has arrived. It acts in the
        algorithms Gloo runs, in Gloo's form (an Algorithm's `rendezvous`, registry.py): the all-reduce ring in
        segments of at most slice_bytes (at least two per rank's chunk, two in flight, each receive
        posted before its send), the all-gather ring in half blocks (send posted first), the all-to-all
        with every send and receive posted at once (send first). Small messages then pay a handshake
        per segment. False: eager sends (no handshake).
    rendezvous_stagger: with rendezvous, the fraction of calls whose ranks enter one after another rather
        than together. A late rank then finds its peers' notices waiting and queues its data ahead of its
        own notices, so where a pair exchanges data both ways on one connection (Gloo's all-to-all; the
        all-gather on 2 ranks) the two directions run one after the other. The ranks enter with the nodes
        taking turns (a rank's lateness does not depend on its node; in the hierarchical layout's cross groups
        each group starts at another node), so on a link that several pairs cross, some send each way first.
        The time is the weighted mean of the two cases (counted from the last rank's entry).
    codec_bandwidth: bytes per second the ranks' own devices move through the step model's kernels,
        measured by a calibration: per method (its codec bytes, `codec_bytes_per_element`) and "update"
        (the Lion update's 20 bytes per parameter). When present they replace `memory_bandwidth` in
        `simulate_step` for those kernels. {}: use memory_bandwidth.
    codec_on_compute: the codec kernels run on the cores that compute (CPU ranks, whose forward and
        backward keep every core busy): their time adds to the compute instead of overlapping it, and an
        overlapped step hides only the communication. False: a GPU, whose codec runs on a side stream.
        A profile with a `host` models this (and more) as contention instead: the field is then unused.
    host: the ranks' own devices and what sharing them costs (step/hosts.py `HostModel`, as a dict:
        cores, shared_by, background, wake, call_cpu, message_cpu, call_peers, byte_cpu, intra_bandwidth, intra_latency,
        step_cv, start_skew, waits_by, groups, apply_share), measured by lioncub.apps.train.hostcal (`lioncub demo`
        and `bench train` run it). With it `simulate_step` runs the step as processes on shared devices (contention.py),
        `codec_bandwidth` is each kernel's speed on one device alone, and the host's transport replaces the
        cluster's intra-node link.
        None: devices not shared (the analytic step model).
    forecast_error: [low, high], the spread of measured / predicted - 1 over the calibration's held-out
        probes (their least and greatest, 0 always inside): every forecast made with this profile carries the interval
        forecast x (1 + low) .. forecast x (1 + high). None: no interval.
    """

    name: str = "custom"
    wire_efficiency: float = 1.0
    efficiency: dict[str, float] = field(default_factory=dict)
    message_overhead: float = 0.0
    call_overhead: float = 0.0
    reduce_bandwidth: float | None = None
    host_bandwidth: float | None = None
    window_bytes: float | None = None
    channels: int = 1
    slice_bytes: float | None = None
    algorithms: dict[str, list[str]] = field(default_factory=lambda: {k: list(v) for k, v in ALL_ALGORITHMS.items()})
    link_burst: float = 0.0
    rendezvous: bool = False
    rendezvous_stagger: float = 0.0
    codec_bandwidth: dict[str, float] = field(default_factory=dict)
    codec_on_compute: bool = False
    host: dict | None = None
    forecast_error: list[float] | None = None

    def __post_init__(self):
        self.validate()

    # ---- derived --------------------------------------------------------------------------------------
    def family_efficiency(self, family: str) -> float:
        return float(self.efficiency.get(family, 1.0))

    def host_model(self) -> HostModel | None:
        """The `host` field as a HostModel (None: devices not shared)."""
        return None if self.host is None else HostModel.from_dict(self.host)

    @property
    def gamma(self) -> float:
        """Seconds per byte reduced."""
        return 0.0 if self.reduce_bandwidth is None else 1.0 / self.reduce_bandwidth

    def candidates(self, op: str) -> list[str]:
        return list(self.algorithms.get(op, ALL_ALGORITHMS.get(op, [])))

    # ---- checks ---------------------------------------------------------------------------------------
    def _validate_host(self) -> None:
        """The `host` and `forecast_error` fields (issue 27)."""
        if self.host is not None:
            try:
                HostModel.from_dict(self.host)
            except ValueError as exc:
                raise ValueError(f"profile {self.name!r}: {exc}") from None
        fe = self.forecast_error
        if fe is not None and not (isinstance(fe, (list, tuple)) and len(fe) == 2
                                   and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in fe)
                                   and -1 < fe[0] <= 0 <= fe[1]):
            raise ValueError(f"profile {self.name!r}: forecast_error must be [low, high] with -1 < low <= 0 <= high, "
                             f"got {fe!r}")

    def validate(self) -> BackendProfile:
        def positive(name, v, allow_none=False):
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0) or not math.isfinite(v):
                raise ValueError(f"profile {self.name!r}: {name} must be a positive number, got {v!r}")

        positive("wire_efficiency", self.wire_efficiency)
        if self.wire_efficiency > 1:
            raise ValueError(f"profile {self.name!r}: wire_efficiency must be <= 1, got {self.wire_efficiency}")
        if not isinstance(self.efficiency, dict):
            raise ValueError(f"profile {self.name!r}: efficiency must be a mapping family -> value")
        for fam, v in self.efficiency.items():
            if fam not in FAMILIES:
                raise ValueError(f"profile {self.name!r}: unknown family {fam!r} in efficiency; "
                                 f"choose from {', '.join(FAMILIES)}")
            positive(f"efficiency[{fam!r}]", v)
        for name in ("message_overhead", "call_overhead"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0) or not math.isfinite(v):
                raise ValueError(f"profile {self.name!r}: {name} must be a number >= 0, got {v!r}")
        for name in ("reduce_bandwidth", "host_bandwidth", "window_bytes", "slice_bytes"):
            positive(name, getattr(self, name), allow_none=True)
        v = self.link_burst
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1):
            raise ValueError(f"profile {self.name!r}: link_burst must be seconds in [0, 1), got {v!r}")
        if not isinstance(self.rendezvous, bool):
            raise ValueError(f"profile {self.name!r}: rendezvous must be true or false, got {self.rendezvous!r}")
        v = self.rendezvous_stagger
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v <= 1):
            raise ValueError(f"profile {self.name!r}: rendezvous_stagger must be a fraction in [0, 1], got {v!r}")
        if not isinstance(self.codec_bandwidth, dict):
            raise ValueError(f"profile {self.name!r}: codec_bandwidth must be a mapping method -> bytes/s")
        for key, v in self.codec_bandwidth.items():
            if key not in CODEC_KERNELS:
                raise ValueError(f"profile {self.name!r}: unknown kernel {key!r} in codec_bandwidth; "
                                 f"choose from {', '.join(CODEC_KERNELS)}")
            positive(f"codec_bandwidth[{key!r}]", v)
        self._validate_host()
        if isinstance(self.channels, bool) or not isinstance(self.channels, int) or self.channels < 1:
            raise ValueError(f"profile {self.name!r}: channels must be a positive integer, got {self.channels!r}")
        if not isinstance(self.algorithms, dict):
            raise ValueError(f"profile {self.name!r}: algorithms must be a mapping op -> [algorithm, ...]")
        for op, algs in self.algorithms.items():
            known = ALL_ALGORITHMS.get(op)
            if known is None:
                raise ValueError(f"profile {self.name!r}: unknown op {op!r} in algorithms")
            for a in algs:
                if a not in known:
                    raise ValueError(f"profile {self.name!r}: unknown {op} algorithm {a!r}; "
                                     f"choose from {', '.join(known)}")
        return self

    # ---- (de)serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, base: BackendProfile | str | None = None) -> BackendProfile:
        """A profile from a (possibly partial) dict laid over `base` (a profile or built-in name).
        Unknown keys are an error, so a typo in a calibration file does not pass silently."""
        if not isinstance(data, dict):
            raise ValueError(f"a profile must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown profile field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        start = get_profile(base).to_dict() if base is not None else cls().to_dict()
        start.update(data)
        return cls(**start)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path, base: BackendProfile | str | None = None) -> BackendProfile:
        """Read a calibration JSON file (a profile object, possibly partial). Fields it lacks come from
        `base`, else from the built-in profile named by its `name` field, else from the defaults."""
        data = read_json(path, "calibration file")
        if base is None and isinstance(data, dict) and data.get("name") in BUILTIN:
            base = data["name"]
        return cls.from_dict(data, base=base)

    def replace(self, **changes) -> BackendProfile:
        return dataclasses.replace(self, **changes)


def library_algorithms(library: str) -> dict[str, list[str]]:
    """{op: [names]} of the algorithms a library implements (a built-in profile's `algorithms`)."""
    if library not in LIBRARIES:
        raise ValueError(f"unknown library {library!r}; choose one of: {', '.join(LIBRARIES)}")
    return {op: list(names) for op, names in LIBRARY_ALGORITHMS[library].items() if names}


def ideal() -> BackendProfile:
    return BackendProfile(name="ideal")


def nccl() -> BackendProfile:
    return BackendProfile(
        name="nccl",
        wire_efficiency=tcp_efficiency(1500),
        message_overhead=5e-6,  # per slice: proxy thread + socket call (NCCL NET/Simple per-hop ~ few us)
        call_overhead=10e-6,  # kernel launch + NCCL base latency (tuning.cc baseLat ~ 8 us)
        reduce_bandwidth=None,  # reductions fused into the GPU copy kernel
        host_bandwidth=None,
        window_bytes=None,  # several sockets per peer, large buffers
        channels=2,
        slice_bytes=1 << 20,  # NCCL_BUFFSIZE 4 MiB / NCCL_STEPS 8 * SLICESTEPS 2
        algorithms=library_algorithms("nccl"),  # ring, binomial-tree; ring; ring; all-at-once; trees
    )


def gloo() -> BackendProfile:
    return BackendProfile(
        name="gloo",
        wire_efficiency=tcp_efficiency(1500),
        message_overhead=30e-6,  # per message: TCP pair bookkeeping, syscalls, a small copy
        call_overhead=50e-6,  # Python + ProcessGroupGloo work queue + buffer set-up
        reduce_bandwidth=4e9,  # single-threaded CPU sum
        host_bandwidth=2.5e9,  # one CPU thread copying through the socket layer
        window_bytes=3 * 2**20,  # tcp_rmem max 6 MiB, half advertised
        channels=1,
        slice_bytes=None,
        # allreduce_ring(_chunked), allreduce_halving_doubling; ring; ring; all-at-once; trees
        algorithms=library_algorithms("gloo"),
    )


BUILTIN = {"ideal": ideal, "nccl": nccl, "gloo": gloo}


def get_profile(backend) -> BackendProfile:
    """A profile from a built-in name or an existing profile (returned as is)."""
    if isinstance(backend, BackendProfile):
        return backend.validate()
    if isinstance(backend, str) and backend in BUILTIN:
        return BUILTIN[backend]()
    raise ValueError(f"unknown backend {backend!r}; choose one of: {', '.join(BUILTIN)} (or a BackendProfile)")
