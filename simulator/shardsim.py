"""The sharded step (sharded.py's mechanism) as SimPy processes on the representative rank's devices.

Processes: the main thread (forward and backward unit by unit, then the update); on GPUs the all-gather,
reduce-scatter and all-reduce streams of FSDP2; LionCub's communication thread (overlap). Events tie them
together: a unit's parameters gathered, its compute started, its gradients ready, its shard reduce-scattered,
its shard all-reduced. Collectives cost what contention.StepSim charges (the network's time, and on busy
cores the waits for a core and their CPU work on the host's `Cores`).
"""

from __future__ import annotations

import simpy

from .contention import Call, run_call
from .hosts import Cores, HostModel


class ShardedSim:
    """plan[u] (forward order, unit 0 the root): dict(fwd, bwd, codec: device-seconds of work; gather,
    gather_back, scatter, reduce, cross: lists of Calls). `control`: LionCub's control Call or None (the
    baseline); `sync`: the momentum sync's Calls after the update (or []). `synchronous`: FSDP's collectives
    block the main thread (CPU ranks)."""

    def __init__(self, host: HostModel, weight: int, plan: list, optimizer: float, control, sync: list,
                 synchronous: bool, overlap: bool, compute: float = 0.0):
        self.env = simpy.Environment()
        self.compute_seconds, self.aligned = compute, 0.0  # the step's compute as measured; computing at the last sync
        self.host, self.plan, self.optimizer = host, plan, optimizer
        self.control, self.sync, self.synchronous, self.overlap = control, sync, synchronous, overlap
        self.cores = Cores(self.env, host, weight)
        n = len(plan)
        ev = self.env.event
        self.gathered, self.gathered_back = [ev() for _ in range(n)], [ev() for _ in range(n)]
        self.started, self.started_back = [ev() for _ in range(n)], [ev() for _ in range(n)]
        self.grads, self.scattered, self.reduced = [ev() for _ in range(n)], [ev() for _ in range(n)], \
            [ev() for _ in range(n)]
        self.forward_done, self.comm_done = ev(), ev()
        self.marks: dict[str, float] = {}
        self.walls = dict(fsdp=0.0, comm=0.0, codec=0.0, computing=0.0)

    @property
    def back(self) -> list[int]:
        return list(range(len(self.plan)))[::-1]

    def run(self) -> dict:
        self.env.process(self.main())
        if not self.synchronous:
            for proc in (self.gathers(), self.scatters(), self.reduces()):
                self.env.process(proc)
        if self.control is not None and self.overlap:
            self.env.process(self.thread())
        self.env.run()
        m = self.marks
        # fsdp_exposed: how long the main thread waited for FSDP's collectives during forward and backward
        return dict(step=m["update"], forward=m["forward"], compute=m["backward"], exposed=m["waited"] - m["backward"],
                    fsdp_exposed=m["backward"] - self.walls["computing"],
                    update=m["update"] - m["waited"], msync=m["synced"] - m["update"], device_seconds=self.cores.busy,
                    **self.walls)

    def main(self):
        env, sync = self.env, self.synchronous
        for u, unit in enumerate(self.plan):
            yield from (self.blocking(unit["gather"]) if sync else [self.gathered[u]])
            self.started[u].succeed()
            yield from self.compute(unit["fwd"])
        self.marks["forward"] = env.now
        self.forward_done.succeed()
        for u in self.back:
            unit = self.plan[u]
            yield from (self.blocking(unit["gather_back"]) if sync else [self.gathered_back[u]])
            self.started_back[u].succeed()
            yield from self.compute(unit["bwd"])
            self.grads[u].succeed()
            if sync:
                yield from self.blocking(unit["scatter"] + unit["reduce"])
                self.scattered[u].succeed()
                self.reduced[u].succeed()
        yield env.all_of(self.reduced)  # FSDP2's end of backward waits for its reduce-scatters and all-reduces
        self.marks["backward"] = env.now
        if self.control is not None:
            yield self.comm_done if self.overlap else env.process(self.exchanges())
        self.marks["waited"] = env.now
        yield self.cores.run(self.optimizer)
        self.marks["update"] = env.now
        yield from self.calls(self.sync, "sync")
        self.marks["synced"] = env.now

    def compute(self, work: float):
        t0 = self.env.now
        yield self.cores.run(work)
        self.walls["computing"] += self.env.now - t0

    def gathers(self):
        """FSDP2's all-gather stream: each unit's when the previous unit's compute has started."""
        for u, unit in enumerate(self.plan):
            if u:
                yield self.started[u - 1]
            yield from self.calls(unit["gather"], "fsdp")
            self.gathered[u].succeed()
        prev = self.forward_done
        for u in self.back:
            if self.plan[u]["gather_back"]:
                yield prev
                yield from self.calls(self.plan[u]["gather_back"], "fsdp")
            self.gathered_back[u].succeed()
            prev = self.started_back[u]

    def scatters(self):
        for u in self.back:
            yield self.grads[u]
            yield from self.calls(self.plan[u]["scatter"], "fsdp")
            self.scattered[u].succeed()

    def reduces(self):
        for u in self.back:
            yield self.scattered[u]
            yield from self.calls(self.plan[u]["reduce"], "fsdp")
            self.reduced[u].succeed()

    def thread(self):
        yield from self.exchanges()
        self.comm_done.succeed()

    def exchanges(self):
        """LionCub's side: each unit's codec and collectives on its shard once it is reduce-scattered, in
        backward's order, then the control message (first when step() runs it, without overlap)."""
        if not self.overlap:
            yield from self.calls([self.control], "comm")
        for u in self.back:
            yield self.scattered[u]
            t0 = self.env.now
            yield self.cores.run(self.plan[u]["codec"])
            self.walls["codec"] += self.env.now - t0
            yield from self.calls(self.plan[u]["cross"], "comm")
        if self.overlap:
            yield from self.calls([self.control], "comm")

    def blocking(self, calls: list):
        """FSDP's collectives on the main thread (CPU ranks): each starts when the latest of its members arrives,
        which drifted from the others over the compute since the previous one (`HostModel.drift`, from the
        spread they left that one with: `start_skew`), and after it they are together again."""
        for c in calls:
            k = (self.walls["computing"] - self.aligned) / self.compute_seconds if self.compute_seconds > 0 else 0.0
            late = self.host.drift(k, self.compute_seconds, c.members)
            if late > 0:
                yield self.env.timeout(late)
                self.walls["fsdp"] += late
            yield from self.calls([c], "fsdp")
            self.aligned = self.walls["computing"]

    def calls(self, calls: list, wall: str):
        for c in calls:
            t0 = self.env.now
            yield from self.collective(c)
            self.walls[wall] = self.walls.get(wall, 0.0) + self.env.now - t0

    def collective(self, c: Call):
        yield from run_call(self.env, self.cores, self.host, c)


def unshared_step(plan: list, optimizer: float, control, sync: list, synchronous: bool, overlap: bool) -> dict:
    """ShardedSim.run()'s figures on devices nobody shares (every job at full speed, no waits for a core): the same
    events, each the latest of what it waits for plus its duration, in one pass over the units."""
    def d(calls):
        return sum(c.seconds for c in calls)

    n, back = len(plan), range(len(plan) - 1, -1, -1)
    scattered, reduced = [0.0] * n, [0.0] * n
    t = stream = started = rs = ar = 0.0
    for i, u in enumerate(plan):  # forward
        if synchronous:
            t += d(u["gather"]) + u["fwd"]
        else:  # the gather stream issues unit i's once unit i-1 has started; unit i waits for it
            stream = max(stream, started if i else 0.0) + d(u["gather"])
            started = max(t, stream)
            t = started + u["fwd"]
    forward, trigger = t, t
    for i in back:
        u = plan[i]
        if synchronous:
            t += d(u["gather_back"]) + u["bwd"] + d(u["scatter"]) + d(u["reduce"])
            scattered[i] = reduced[i] = t
            continue
        if u["gather_back"]:  # issued when the unit before it in backward started (the first: when forward ended)
            stream = max(stream, trigger) + d(u["gather_back"])
        trigger = max(t, stream)
        t = trigger + u["bwd"]
        rs = max(rs, t) + d(u["scatter"])
        ar = max(ar, rs) + d(u["reduce"])
        scattered[i], reduced[i] = rs, ar
    backward = max([t, *reduced])
    lioncub = control is not None  # (the baseline has no LionCub thread: no codec, no cross-node calls of its own)
    codec = sum(u["codec"] for u in plan) if lioncub else 0.0
    comm = control.seconds + sum(d(u["cross"]) for u in plan) if lioncub else 0.0
    waited = backward
    if lioncub and overlap:
        thread = 0.0
        for i in back:
            thread = max(thread, scattered[i]) + plan[i]["codec"] + d(plan[i]["cross"])
        waited = max(backward, thread + control.seconds)
    elif lioncub:
        waited = backward + codec + comm
    computing = sum(u["fwd"] + u["bwd"] for u in plan)
    fsdp = sum(d(u["gather"]) + d(u["gather_back"]) + d(u["scatter"]) + d(u["reduce"]) for u in plan)
    return dict(step=waited + optimizer, forward=forward, compute=backward, exposed=waited - backward,
                update=optimizer, msync=d(sync), device_seconds=computing + codec + optimizer, fsdp=fsdp, comm=comm,
                codec=codec, computing=computing, fsdp_exposed=backward - computing)


__all__ = ["ShardedSim", "unshared_step"]
