"""Contention on the ranks' own devices: what a host's ranks share, and the processor-sharing server that
shares it in the step model (contention.py).

A *host* is the set of ranks that share compute devices: the cores of a CPU machine, or one GPU. Each rank's
forward and backward, its codec kernels, its communication thread's work (the collectives' software path:
Python, the process group, the library's threads, the kernel's TCP stack) and its optimizer update are jobs
on the host's devices. `HostModel` holds what a calibration measures about them (all physical, none fitted to
a training run):

* `cores`: the devices' capacity in jobs that run at full speed at once: CPU cores, or for one GPU 1 plus
  what two kernels (backward and a side stream's codec) overlap.
* `shared_by`: which ranks share one host: "node" (the ranks of a cluster node: a CPU cluster, or a node's
  ranks on one GPU), "cluster" (every rank on one machine: the lab's namespaces share its cores), or an
  integer R (R ranks per GPU).
* `background`: other work on the host, in jobs that are always runnable (another session's processes, two
  `yes` loops: 2.0), measured from how fast the ranks compute.
* `wake`: the seconds a thread that was waiting (for a message, for its turn in a collective) waits for a
  core when every core of its host is busy; where each rank is a scheduling group of its own (a session of its
  own under Linux autogroup, as torchrun and the lab start ranks), the wait for its own group's turn. A
  collective waits that long on every wait of its critical path (`waits_by`), and it starts when the last of
  its m members has woken up: the
  expected latest of m such waits, `wake * H(m)` (H the harmonic number: the mean of the largest of m
  exponential waits). Skew between ranks is that order statistic, so it grows with the group.
* `call_cpu`, `message_cpu`, `byte_cpu`: CPU seconds a collective costs each member (Python, the process group,
  the library's threads), as jobs on the host's cores while the collective runs: `call_cpu` per call,
  `message_cpu` per message of the library's program the member sends or receives (`gloo_messages`), `byte_cpu`
  per byte it sends or receives (copies and the TCP stack, loopback or NIC). Gloo's ring all-reduce cuts its
  buffer into at least 2 m segments and skips every send and receive of an empty one, so LionCub's 3-element
  control message costs a member 9 messages among 4 ranks where a bucket costs 24 (measured on loopback: 0.9
  and 1.8 ms of CPU; 1.0 and 3.7 ms among 8 ranks with 10.5 and 56 messages: 0.06 ms a message and 0.35-0.39
  ms a call among 4 and 8 alike). `message_cpu` None (profiles calibrated before it was measured): `call_cpu` per peer
  of the probe's (`call_peers`: the probe's members - 1), `call_cpu * (m - 1) / call_peers` for m members; and
  without `call_peers`, `call_cpu` per call whatever its group (`call_work`).
* `intra_bandwidth`, `intra_latency`: the transport between ranks of one host as the platform has it
  (loopback TCP for Gloo ranks; NVLink or PCIe for GPUs): they replace the cluster's intra-node link.
* `waits_by`: how many times a collective's thread blocks for a message on its critical path, each a wake-up
  that waits `wake` for a core when every core is busy (`waits`): "gloo", the blocking waits in a row of Gloo's
  own programs (its ring all-reduce cut into segments of at most 1 MiB, of which it waits only for the non-empty
  ones; its all-gather's one wait per peer, its all-to-all's one; gloo/allreduce.cc, allgather.cc,
  alltoall.cc), which CPU ranks on Gloo run whatever algorithm the network model simulates; "latencies", the
  latencies on the simulated algorithm's critical path (profiles calibrated before this was recorded).
* `groups`: each rank is a scheduling group of its own (a session of its own under Linux autogroup, as torchrun
  and the lab start ranks). A woken thread then waits for its group's turn while the rank's other threads are
  runnable (its main thread computing holds the group's place in the queue), and not at all while they are not
  (a group that slept is placed ahead), whatever else keeps the cores busy. False: one group for all, a woken
  thread waits whenever every core is busy.
* `apply_share`: per method, the share of its codec work (a bucket's local work: encode, vote, apply) that
  LionCub runs in step() after an overlapped exchange: the apply, with the deferred momentum update (which is
  the Lion update of a compressed method; its step has no other). The rest runs on the communication thread.
  Measured by a host calibration (the apply timed on the whole model, out of the caches, as step() runs it);
  None: the whole codec on the communication thread and the Lion update in step() (profiles without it).
* `update_seconds`: per optimizer, the seconds its step() took alone on one device after a backward of the run's
  model (device-seconds): "lion" (plain Lion, tensor by tensor: the ddp+lion baseline's step) and each LionCub
  method (overlapped: the apply, bucket by bucket, the agreement, the bookkeeping). Measured by a host calibration
  as the run's optimizer runs (a kernel timed on one flat buffer with its inputs in the cache misses the calls per
  tensor and per bucket and the caches that backward leaves cold: 0.3 ms for char-tiny's Lion update against
  1.8-2.4 ms of plain Lion's step); the step model's update in the flat layout (its ranks' updates overlapping as
  their start skew lets them: contention.StepSim.update_weight), for models of `update_params` parameters (the
  calibrated one's) only. None: the update from the kernels' speeds.
* `step_cv`: the coefficient of variation of one rank's compute step with every rank of the host computing
  (time slicing, other work), beyond what every rank's step shared (a step slow on every rank at once delays
  none against the others). Ranks that run k steps without a collective (local steps) drift apart by about
  `step_cv * step * sqrt(k)` each, and the next collective waits for the latest of its m members:
  `drift(k, step, m)`, with `expected_max(m)` the mean of the largest of m standard normals. Within a step
  they drift the same way over the part of it they have computed (k < 1): a bucket's exchange waits for its
  latest member to have made it ready, and until the latest has finished backward the cores stay busy
  (contention.StepSim).
* `start_skew`: the standard deviation of the ranks' start of step about their mean: each leaves the step's last
  collective and the update after wake-ups of its own (`wake`), so they start the next step apart before their
  compute drifts them further. Measured directly (hostcal: each rank's exit from an all-reduce between compute
  steps, on the machine's one clock); `drift` adds it to the drift's variance.

`Cores` is the processor-sharing server: n runnable jobs (each counted `weight` times: the host's ranks
are symmetric, so one representative rank is simulated for all) and `background` jobs share `capacity`,
each running at min(1, capacity / (n * weight + background)). It uses SimPy's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import simpy

SCOPES = ("node", "cluster")
WAITS_BY = ("latencies", "gloo")
GLOO_SEGMENT = 2**20  # bytes: the largest segment of Gloo's ring all-reduce (AllreduceOptions kMaxSegmentSize)


@dataclass(frozen=True)
class HostModel:
    """The host's devices and what the ranks' work costs on them (seconds, bytes, bits/s; see the module)."""

    cores: float = 1.0
    shared_by: str | int = "node"
    background: float = 0.0
    wake: float = 0.0
    call_cpu: float = 0.0
    byte_cpu: float = 0.0
    intra_bandwidth: float | None = None
    intra_latency: float | None = None
    step_cv: float = 0.0
    start_skew: float = 0.0
    call_peers: float | None = None
    message_cpu: float | None = None
    waits_by: str = "latencies"
    groups: bool = False
    apply_share: tuple | None = None
    update_seconds: tuple | None = None
    update_params: int = 0

    def __post_init__(self):
        def number(name, lo=0.0, allow_none=False, positive=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo \
                    or (positive and v <= 0):
                raise ValueError(f"host: {name} must be a {'positive' if positive else 'non-negative'} number, "
                                 f"got {v!r}")

        number("cores", positive=True)
        for name in ("background", "wake", "call_cpu", "byte_cpu", "step_cv", "start_skew", "update_params"):
            number(name)
        number("intra_bandwidth", allow_none=True, positive=True)
        number("intra_latency", allow_none=True)
        number("call_peers", allow_none=True, positive=True)
        number("message_cpu", allow_none=True)
        self._mapping("apply_share", "method names to shares in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        self._mapping("update_seconds", "optimizers to non-negative seconds", lambda v: 0.0 <= v < math.inf)
        if not isinstance(self.groups, bool):
            raise ValueError(f"host: groups must be true or false, got {self.groups!r}")
        if self.waits_by not in WAITS_BY:
            raise ValueError(f"host: waits_by must be {' or '.join(map(repr, WAITS_BY))}, got {self.waits_by!r}")
        s = self.shared_by
        if not (s in SCOPES or (isinstance(s, int) and not isinstance(s, bool) and s >= 1)):
            raise ValueError(f"host: shared_by must be {' or '.join(map(repr, SCOPES))} or a number of ranks >= 1, "
                             f"got {s!r}")

    def _mapping(self, name: str, what: str, ok) -> None:
        """Field `name`, a dict (or pairs) of names to numbers, as sorted pairs; one-line errors."""
        value = getattr(self, name)
        if value is None:
            return
        try:
            pairs = tuple(sorted((str(k), float(v)) for k, v in (value.items() if isinstance(value, dict) else value)))
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or not all(ok(v) for _, v in pairs):
            raise ValueError(f"host: {name} must map {what}, got {value!r}")
        object.__setattr__(self, name, pairs)

    @classmethod
    def from_dict(cls, data) -> HostModel:
        if isinstance(data, HostModel):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"host must be an object of host fields, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown host field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**data)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("apply_share", "update_seconds"):
            d[name] = None if d[name] is None else dict(d[name])
        return d

    def update_of(self, optimizer: str, params: int) -> float | None:
        """Seconds of `optimizer`'s step() alone on one device ("lion": plain Lion; a LionCub method) for a model of
        `params` parameters, if measured on that model."""
        if self.update_seconds is None or params != self.update_params:
            return None
        return dict(self.update_seconds).get(optimizer)

    def apply_part(self, method: str) -> float | None:
        """The share of `method`'s codec work (one bucket's local work) that step() runs after the exchange."""
        return None if self.apply_share is None else dict(self.apply_share).get(method)

    def ranks_per_host(self, ranks: int, gpus_per_node: int) -> int:
        """How many of a cluster's ranks share one host's devices."""
        if self.shared_by == "cluster":
            return ranks
        if self.shared_by == "node":
            return gpus_per_node
        return min(int(self.shared_by), ranks)

    def call_work(self, members: int, nbytes: float, op: str = "allreduce", buffer: float = 0.0,
                  element: int = 4) -> float:
        """CPU seconds a collective `op` on a `buffer` of bytes (of `element`-byte elements) among `members` ranks
        costs each of them for `nbytes` sent plus received: `call_cpu`, `message_cpu` per message of Gloo's
        program and `byte_cpu` per byte (without `message_cpu`: `call_cpu` per peer of the probe's, or per call;
        see the module)."""
        m = int(members)
        if self.message_cpu is not None:
            if m <= 1:
                return 0.0
            return self.call_cpu + self.message_cpu * gloo_messages(op, buffer, m, element) + self.byte_cpu * nbytes
        fixed = self.call_cpu
        if self.call_peers is not None:
            fixed *= max(0, m - 1) / self.call_peers
        return fixed + self.byte_cpu * nbytes

    def waits(self, op: str, buffer: float, members: int, latencies: float, element: int = 4) -> float:
        """The waits on the critical path of a collective `op` on a `buffer` of bytes (`element`-byte elements)
        among `members` ranks, at which a member's thread blocks until a message arrives (`waits_by`;
        `latencies`: the simulated algorithm's count). Gloo's programs:
        * all-reduce, ring: the buffer in S segments (`gloo_segments`: at most 1 MiB each, at least 2 per member)
          of which K are not empty, a reduce-scatter and an all-gather in which each member receives the K
          segments but its own chunk's (K (m - 1) / m on average), in two lanes of receives in flight:
          K (m - 1) / m waits in a row. Gloo's reduce-scatter is an all-reduce of the whole buffer
          (contention.moved);
        * all-gather: 2 (m - 1) half chunks in two lanes: m - 1;
        * all-to-all: every send and receive posted at once, then a wait for each peer's message, all in flight
          together: 1 in a row (waiting for the last of the peers is the skew's, `harmonic`);
        * broadcast, reduce: a binomial tree: ceil(log2 m)."""
        m = int(members)
        if m <= 1:
            return 0.0
        if self.waits_by == "latencies":
            return latencies
        if op in ("allreduce", "reducescatter"):
            return gloo_segments(buffer, m, element)[1] * (m - 1) / m
        if op == "allgather":
            return float(m - 1)
        if op == "alltoall":
            return 1.0
        return float(math.ceil(math.log2(m)))

    def share(self, jobs: float) -> float:
        """The speed of each of `jobs` runnable jobs (background included separately)."""
        n = jobs + self.background
        return 1.0 if n <= self.cores else self.cores / n

    def drift(self, k: float, step: float, m: int) -> float:
        """How long a collective after k steps without one waits for the latest of its m members, beyond the
        representative rank's own arrival: expected_max(m) * sqrt(start_skew^2 + (step_cv * step)^2 * k): the skew
        they started with and k independent steps since."""
        spread = math.sqrt(self.start_skew ** 2 + (self.step_cv * step) ** 2 * max(0.0, k))
        return spread * expected_max(m)


def gloo_segments(buffer: float, members: int, element: int = 4) -> tuple[int, int]:
    """(S, K): the segments Gloo's ring all-reduce cuts a `buffer` of bytes into among `members` ranks (a multiple of
    m, at least 2 m, none over 1 MiB; each a whole number of `element`-byte elements) and how many of them hold
    data: the last segments of a small buffer are empty (gloo/allreduce.cc, `ring`)."""
    def up(a: int, b: int) -> int:
        return -(-a // b)

    m, e = max(1, int(members)), max(1, int(element))
    total = max(0, math.ceil(buffer - 1e-9))
    S = up(max(up(total, e * max(1, GLOO_SEGMENT // e)), 2 * m), m) * m
    seg = up(up(total, S), e) * e
    return S, (up(total, seg) if seg else 0)


def gloo_messages(op: str, buffer: float, members: int, element: int = 4) -> float:
    """The messages (sends and receives, each a non-empty transfer) a member of Gloo's program for the collective
    `op` on a `buffer` of bytes among `members` ranks posts, the mean over members:
    * all-reduce (and reduce-scatter, an all-reduce in Gloo): in each of its two rings every non-empty segment is
      sent by m - 1 members and received by m - 1: 4 K (m - 1) / m;
    * all-gather: 2 (m - 1) half chunks sent and as many received: 4 (m - 1);
    * all-to-all: one to and one from each peer: 2 (m - 1);
    * broadcast, reduce: a tree's m - 1 edges, each a send and a receive: 2 (m - 1) / m."""
    m = int(members)
    if m <= 1:
        return 0.0
    if op in ("allreduce", "reducescatter"):
        return 4.0 * gloo_segments(buffer, m, element)[1] * (m - 1) / m
    if op == "allgather":
        return 4.0 * (m - 1)
    if op == "alltoall":
        return 2.0 * (m - 1)
    return 2.0 * (m - 1) / m


@functools.cache
def expected_max(m: int) -> float:
    """E[max of m independent standard normals] (0 for one): the integral of x m phi(x) Phi(x)^(m-1)."""
    if m <= 1:
        return 0.0
    n, lo, hi = 4000, -9.0, 9.0
    dx = (hi - lo) / n
    total = 0.0
    for i in range(n + 1):
        x = lo + i * dx
        f = x * m * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (m - 1)
        total += f * (0.5 if i in (0, n) else 1.0)
    return total * dx


@functools.cache
def harmonic(m: int) -> float:
    """H(m) = 1 + 1/2 + ... + 1/m: the expected largest of m exponential waits of mean 1."""
    return sum(1.0 / k for k in range(1, max(1, int(m)) + 1))


class Cores:
    """A host's devices as a processor-sharing server (see the module). `run(work)` returns an event that
    fires when `work` seconds of one device's time have been done at the share the job gets."""

    def __init__(self, env: simpy.Environment, host: HostModel, weight: int):
        self.env, self.host, self.weight = env, host, max(1, int(weight))
        self.jobs: dict[int, list] = {}  # job -> [work left, its event]
        self.t = env.now
        self.gen = 0
        self.ids = 0
        self.busy = 0.0  # device-seconds done by the simulated rank's jobs (for utilisation)
        # the ranks behind the simulated one (StepSim sets it at its end of backward): (that moment, the spread of
        # the ranks' ends of backward about it, how many ranks); (0, 0, 1): none
        self.behind = (0.0, 0.0, 1)

    def rate(self) -> float:
        return self.host.share(sum(job[2] for job in self.jobs.values()))

    def saturation(self, own: int = 0) -> float:
        """1 when a thread that wakes now finds every core busy (it waits `wake`), 0 when one is free;
        in between for fractional capacities. `own`: jobs of the waking thread's own among the running ones."""
        others = sum(job[2] for job in self.jobs.values()) - own * self.weight + self.host.background
        return min(1.0, max(0.0, others - self.host.cores + 1.0))

    def still_computing(self) -> float:
        """The chance that the latest of the ranks still computes its backward now: their ends scatter normally
        about the simulated rank's, so that of m ranks the latest is 1 - Phi(t / spread)^m likely to be still at
        it t seconds after (its mean lateness is StepSim.lag)."""
        start, spread, m = self.behind
        if spread <= 0 or m <= 1:
            return 0.0
        return 1.0 - (0.5 * math.erfc(-(self.env.now - start) / (spread * math.sqrt(2)))) ** m

    def turn_wait(self, own: int = 0) -> float:
        """The share of `wake` a thread of the simulated rank waits when it wakes now (HostModel `groups`);
        `own`: its own jobs among the running ones."""
        behind = self.still_computing()  # a rank still computing, as the representative did: its chance
        if not self.host.groups:
            return behind * self.saturation(own - 1) + (1.0 - behind) * self.saturation(own)
        busy = 1.0 if len(self.jobs) - own > 0 else behind
        return busy * min(1.0, max(0.0, self.weight + self.host.background - self.host.cores + 1.0))

    def run(self, work: float, weight: float | None = None) -> simpy.Event:
        """`weight`: the host's ranks running this job at once (default all of them, `self.weight`)."""
        ev = self.env.event()
        if not work > 0:
            ev.succeed()
            return ev
        self._advance()
        self.ids += 1
        self.jobs[self.ids] = [float(work), ev, self.weight if weight is None else float(weight)]
        self._schedule()
        return ev

    def _advance(self) -> None:
        dt = self.env.now - self.t
        if dt > 0 and self.jobs:
            done = self.rate() * dt
            for job in self.jobs.values():
                job[0] -= done
            self.busy += done * len(self.jobs)
        self.t = self.env.now

    def _schedule(self) -> None:
        self.gen += 1
        if not self.jobs:
            return
        gen = self.gen
        wait = max(0.0, min(job[0] for job in self.jobs.values()) / self.rate())
        self.env.timeout(wait).callbacks.append(lambda _ev: self._finish(gen))

    def _finish(self, gen: int) -> None:
        if gen != self.gen:  # a job came or went since: a later timer holds the next completion
            return
        self._advance()
        least = min(job[0] for job in self.jobs.values())
        for key in [k for k, job in self.jobs.items() if job[0] <= least + 1e-12]:
            self.jobs.pop(key)[1].succeed()
        self._schedule()


__all__ = ["Cores", "HostModel", "SCOPES", "expected_max", "gloo_messages", "gloo_segments", "harmonic"]
