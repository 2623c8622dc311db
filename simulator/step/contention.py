"""The training step on shared devices (a profile with a `host`: hosts.py), as SimPy processes.

One representative rank per host is simulated (the host's ranks are symmetric; every job of it counts for
all of them on the host's `Cores`):

* the main thread: forward, then backward, which makes bucket after bucket ready (in backward's order),
  then it waits for the communication thread (the exposed communication), then the Lion update;
* the communication thread (overlap: LionCub's thread, DDP's reducer): per bucket, once it is ready, the
  codec (encode, on the host's devices) and the bucket's collectives one after another; then the step's
  control message. Without overlap the main thread does the same after backward (control message first).

The ranks start a step apart (`HostModel.start_skew`: each left the previous step after wake-ups of its own), and
their compute drifts apart within a step as it does between steps (`HostModel.drift`: time slicing gives each rank
its turns unevenly). A bucket's exchange starts once the latest of its members has made it ready, so
the thread waits for the representative rank's readiness plus that lag (`StepSim.lag`, for the step's time so
far); and until the latest rank has finished backward the host's cores are as busy as during it: a woken thread
of the representative rank waits for its turn although its own backward is over, as likely as the latest is
still at it (`Cores.still_computing`: the ranks' ends of backward scatter about the representative's).

A collective is the network's time for it (simulated once, on an idle network, as everywhere in the step
model), cut at each wait of its critical path (`HostModel.waits`: where a member's thread blocks until a
message arrives) and at the wait for the last of its members (`harmonic`), each followed by a wake-up wait
(`HostModel.wake`) if every core of the host is busy at that moment, while its software path
(`HostModel.call_work`: `call_cpu` per call, `message_cpu` per message of Gloo's program, `byte_cpu` per byte
`moved`) runs as a job on the cores: it ends when both are done. Compute comes in as measured with every rank of
the host computing at once (`compute_seconds`): its work is that time at the share each of the host's ranks had
then.

Every K steps the momenta are averaged after the update, one bucket after another; that time counts 1/K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import simpy

from lioncub.comm import wire

from .hosts import Cores, HostModel, expected_max, harmonic

HOP_PROBE = 1e-6  # seconds added to every latency to count the latencies on a collective's critical path
WAIT_PIECES = 64  # at most this many moments at which a call's waits look at the cores (run_call)


@dataclass(frozen=True)
class Call:
    """One collective call as the step model runs it."""

    what: str  # how StepResult.collectives lists it
    algorithm: str
    size: float
    seconds: float  # on an idle network, idle cores
    hops: float  # latencies on the simulated algorithm's critical path
    members: int  # ranks that must all have entered it
    bytes: float  # a member's bytes through its software path: sent plus received / efficiency (`moved`)
    op: str = "allreduce"
    buffer: float = 0.0  # the collective's buffer, bytes (an all-reduce's tensor; a member's share x members)
    element: int = 4  # bytes per element of the buffer (where Gloo may cut it into segments)


def moved(profile, op: str, sent: float) -> float:
    """Bytes a member's software path moves for a collective `op` that sends `sent` payload bytes per member (and
    receives as many): each payload byte is 1 / efficiency[op] bytes through the library and its TCP stack, the
    same factor the network model charges the links (profiles.py). Gloo's reduce-scatter is an all-reduce of the
    whole buffer (ProcessGroupGloo clones the input, all-reduces it and copies out the rank's chunk): the lab
    calibration's reducescatter efficiency, 0.48 against allreduce's 1.00, is that doubling."""
    return 2.0 * sent / profile.family_efficiency(op)


def make_call(what: str, algorithm: str, size: float, seconds: float, probed: float, members: int, op: str,
              sent: float, profile, element: int = 4) -> Call:
    """A Call of a collective `op` whose member sends `sent` payload bytes, simulated in `seconds` and in `probed`
    with HOP_PROBE more latency on every link (which counts the latencies on its critical path): the bytes its
    software path moves (`moved`) and its buffer (what the library's program is cut by, HostModel.waits)."""
    buffer = sent / wire.bus_factor(op, members) if members > 1 else 0.0
    return Call(what, algorithm, size, seconds, max(0.0, (probed - seconds) / HOP_PROBE), members,
                moved(profile, op, sent), op, buffer)


def calls_of(result, probed, what: str, size: float, N: int, G: int, profile) -> list[Call]:
    """The Calls of a CollectiveResult (a bucket's: one per part) with its twin simulated at HOP_PROBE more
    latency (`probed`), which counts each part's latencies."""
    parts = result.parts or [{"seconds": result.seconds, "scope": "world", "op": result.op,
                              "bytes_sent_per_rank": result.bytes_sent_per_rank}]
    twins = probed.parts or [{"seconds": probed.seconds}]
    members = {"world": N, "node": G or 1, "cross": N // G if G else N}
    return [make_call(what, result.algorithm, size, part["seconds"], twin["seconds"],
                      members[part.get("scope", "world")], part["op"], part["bytes_sent_per_rank"], profile)
            for part, twin in zip(parts, twins)]


class StepSim:
    """One step of the representative rank (see the module). `plan[j]`: bucket j's (elements, codec work,
    [Call]); `control`: the step's control Call or None; `sync`: the momentum-sync Calls (after the
    update) or []; `members`: the ranks whose progress the exchange waits for; `compute`: the step's forward and
    backward seconds as measured (the drift's unit)."""

    def __init__(self, host: HostModel, weight: int, work: dict, plan: list, control, sync: list, overlap: bool,
                 members: int = 1, compute: float = 0.0):
        self.env = simpy.Environment()
        self.members, self.compute = members, compute
        self.host, self.work, self.plan = host, work, plan
        self.control, self.sync, self.overlap = control, sync, overlap
        self.cores = Cores(self.env, host, weight)
        self.ready = [self.env.event() for _ in plan]
        self.comm_done = self.env.event()
        self.marks: dict[str, float] = {}
        self.ready_at: list[float] = []
        self.codec_wall = self.comm_wall = 0.0
        self.tally: list[dict] = []

    def run(self) -> dict:
        self.env.process(self.main())
        if self.overlap:
            self.env.process(self.thread())
        self.env.run()
        m = self.marks
        return dict(step=m["update"], compute=m["backward"], exposed=m["exposed"], update=m["update"] - m["waited"],
                    msync=m["synced"] - m["update"], codec=self.codec_wall, comm=self.comm_wall,
                    device_seconds=self.cores.busy)

    def main(self):
        env, work = self.env, self.work
        yield self.cores.run(work["fwd"])
        total = sum(e for e, _, _ in self.plan) or 1
        for j, (e, _, _) in enumerate(self.plan):
            yield self.cores.run(work["bwd"] * e / total)
            self.ready_at.append(env.now)
            self.ready[j].succeed()
        self.marks["backward"] = env.now
        spread = self.lag(env.now) / expected_max(self.members) if self.members > 1 else 0.0
        self.cores.behind = (env.now, spread, self.members)
        if self.overlap:
            yield self.comm_done
        else:
            yield from self.exchanges()
        self.marks["waited"] = env.now
        self.marks["exposed"] = env.now - self.marks["backward"]
        yield self.cores.run(work["optimizer"], self.update_weight(work["optimizer"]))
        self.marks["update"] = env.now
        for c in self.sync:
            yield from self.collective(c)
        self.marks["synced"] = env.now

    def thread(self):
        yield from self.exchanges()
        self.comm_done.succeed()

    def exchanges(self):
        """Each bucket's codec and collectives once it is ready, and the control message (first without
        overlap, as step() sends it; last with overlap, at the end of backward)."""
        if not self.overlap:  # step() runs after backward: its first call waits for the latest rank to get there
            yield from self.latest(self.env.now)
            if self.control is not None:
                yield from self.collective(self.control)
        for j, (_, codec, calls) in enumerate(self.plan):
            yield self.ready[j]
            yield from self.latest(self.ready_at[j])
            t0 = self.env.now
            yield self.cores.run(codec)
            self.codec_wall += self.env.now - t0
            for c in calls:
                yield from self.collective(c)
        if self.control is not None and self.overlap:
            yield from self.collective(self.control)

    def update_weight(self, u: float) -> float:
        """The host's ranks running the update at once: the simulated rank's, and each other rank's for the share
        of it that overlaps, their starts `start_skew` apart (they leave the last collective after wake-ups of their
        own): E[(u - |d|)+] / u with d ~ N(0, 2 skew^2)."""
        w, s = self.cores.weight, self.host.start_skew * math.sqrt(2.0)
        if w <= 1 or s <= 0 or u <= 0:
            return float(w)
        z = u / s
        phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
        overlap = u * math.erf(z / math.sqrt(2)) - 2 * s * (phi(0.0) - phi(z))
        return 1.0 + (w - 1) * overlap / u

    def lag(self, at: float) -> float:
        """How far behind the representative rank's progress at `at` (seconds into the step) the latest of the
        exchange's members is: they started the step apart (`start_skew`), and their compute drifts apart within a
        step as between steps (HostModel.drift over the `at / compute` of a step they have computed)."""
        if self.members <= 1:
            return 0.0
        return self.host.drift(at / self.compute if self.compute > 0 else 0.0, self.compute, self.members)

    def latest(self, at: float):
        """Wait until the latest member has got as far as the representative rank had at `at`."""
        late = at + self.lag(at) - self.env.now
        if late > 0:
            yield self.env.timeout(late)

    def collective(self, c: Call):
        env = self.env
        t0 = env.now
        yield from run_call(env, self.cores, self.host, c)
        self.comm_wall += env.now - t0
        self.tally.append({"what": c.what, "algorithm": c.algorithm, "size_bytes": c.size, "seconds": env.now - t0})


def run_call(env, cores: Cores, host: HostModel, c: Call):
    """One collective on shared cores (see the module): its network time, cut at each of its waits (the last of
    its members' one, a fraction where H(m) has one), each followed by the wait for a core at that moment
    (`Cores.turn_wait`), beside its software path's CPU work. A wait after backward has ended costs nothing on
    quiet cores, one during backward the whole `wake`, whenever the call began."""
    units = host.waits(c.op, c.buffer, c.members, c.hops, c.element) + harmonic(c.members) if host.wake > 0 else 0.0
    cpu = cores.run(host.call_work(c.members, c.bytes, c.op, c.buffer, c.element))
    # a ring among thousands of ranks waits thousands of times: at most WAIT_PIECES moments, each for its share
    pieces = max(1, math.ceil(units - 1e-9))
    scale = max(1.0, pieces / WAIT_PIECES)
    pieces = min(pieces, WAIT_PIECES)

    def waits():
        for i in range(pieces):
            yield env.timeout(c.seconds / pieces)
            weight = min(1.0, units / scale - i) * scale
            busy = cores.turn_wait(own=0 if cpu.triggered else 1) if weight > 0 else 0.0
            if busy > 0:
                yield env.timeout(busy * weight * host.wake)

    yield env.all_of([env.process(waits()), cpu])


def loaded_collective(host: HostModel, weight: int, call: Call, computing: bool = True) -> float:
    """Seconds of one collective `call` on a host whose `weight` ranks each also compute throughout
    (`computing`) or are otherwise idle: the same mechanism as a step's collectives (the calibration
    predicts its held-out probes with it)."""
    sim = StepSim(host, weight, dict(fwd=0.0, bwd=0.0, optimizer=0.0), [], None, [], False)
    if computing:
        sim.cores.run(1e9)  # every rank's forward and backward, for longer than the collective

    def one():
        t0 = sim.env.now
        yield from sim.collective(call)
        return sim.env.now - t0

    return sim.env.run(until=sim.env.process(one()))


def compute_work(host: HostModel, weight: int, seconds: float) -> float:
    """Device-seconds of work that took `seconds` with every one of the host's `weight` ranks computing."""
    return seconds * host.share(weight)


def apply_split(host: HostModel, meth, codecs: list[float]) -> tuple[list[float], float | None]:
    """A compressed step's codec work per bucket or unit (`codecs`) as LionCub runs it: the apply (its Lion update,
    `HostModel.apply_share`) in step() after the exchange, the rest on the communication thread. (the thread's
    work per entry, step()'s work), or (`codecs`, None) where the host has no share for the method."""
    applied = None if meth.dense else host.apply_part(meth.name)
    if applied is None:
        return codecs, None
    return [c * (1.0 - applied) for c in codecs], applied * sum(codecs)


def control_call(ex, probed, N: int) -> Call:
    r, twin = ex.control(), probed.control()
    return control_of(r.algorithm, r.seconds, twin.seconds, N, r.bytes_sent_per_rank, ex.profile)


def control_of(algorithm: str, seconds: float, probed: float, N: int, sent: float, profile) -> Call:
    """LionCub's control all-reduce (wire.CONTROL) among N ranks as a Call (see make_call)."""
    c = wire.CONTROL
    return make_call("control", algorithm, c.nbytes, seconds, probed, N, c.op, sent, profile, wire.DTYPE_BYTES[c.dtype])


__all__ = ["Call", "StepSim", "apply_split", "calls_of", "compute_work", "control_call", "control_of",
           "loaded_collective", "make_call", "moved", "run_call"]
