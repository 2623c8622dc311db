"""The sharded layout (HSDP, `simulate_step(..., sharded=True)`): the model sharded by FSDP2 inside each node
of G ranks, LionCub's method (or FSDP's own all-reduce) across the N/G nodes on each rank's 1/G shard.

The model is a list of FSDP units (each `fully_shard` call), in forward order; unit 0 is the root. Per unit
u of n_u parameters, each rank holds a shard of S_u = ceil(n_u / G) elements, and per step:

* forward: an all-gather inside the node of the unit's parameters (output G S_u elements of `param_dtype`)
  before its forward; FSDP2 frees them after it, except the root's (FSDP2 does not reshard the root after
  forward), so backward all-gathers every unit but the root again;
* backward: after the unit's backward, a reduce-scatter inside the node of its gradients (input G S_u of
  `grad_dtype`), which leaves each rank the node's mean of its shard;
* across nodes, on the shard: the baseline (a dense method: FSDP2's own HSDP with plain Lion) all-reduces
  it in fp32 after the reduce-scatter; LionCub's method encodes it (codec on S_u elements, N/G voters) and
  runs its collectives on it (one bucket per unit), then one control all-reduce over every rank;
* the Lion update of the shard: 1/G of the optimizer's memory traffic; every K steps the momentum sync, an
  fp32 all-reduce of each shard across nodes after the update (counted 1/K).

Overlap, as FSDP2 and LionCub issue the work. On GPUs (`synchronous=False`) FSDP's collectives run on their
own streams: the all-gathers one after another, each unit's issued when the previous unit's compute starts
(forward: the CPU runs ahead of the kernels into the next unit's hook; backward: FSDP2's one-unit backward
prefetch), its compute waiting for it; each reduce-scatter when its unit's backward is done, the baseline's
all-reduce of a shard when its reduce-scatter is, and the end of backward waits for them all. On CPU ranks
(`synchronous=True`: the profile's `codec_on_compute`) the issuing thread computes and FSDP2's collectives are
synchronous (async_op=False), so each blocks the main thread where FSDP issues it. LionCub's thread (overlap)
encodes and exchanges a unit's shard as soon as its reduce-scatter is done, in backward's order; without
overlap that happens in step(), after backward. Every collective takes its time on an idle network (the
step model's rule: node collectives use the node's links, cross ones the NICs) plus, on shared devices,
the contention model's waits and CPU work (contention.py); without a host model the devices are not shared.
"""

from __future__ import annotations

import collections
import dataclasses

import simpy

from lioncub.comm import wire

from ..collectives.results import CONTROL, tally
from ..collectives.simulate import simulate_collective, simulate_collectives
from .contention import HOP_PROBE, Call, apply_split, calls_of, control_of, run_call
from .hosts import Cores, HostModel

REPLICA_BYTES_PER_PARAM = 12.0  # fp32 parameter, gradient and momentum of an unsharded replica (DDP + Lion)
UNSHARED = HostModel(cores=1e9)  # devices nobody shares: every job at full speed, no waits


def check(cluster, meth, hierarchical: bool, local_steps, momentum_sync, param_dtype: str) -> int:
    """G, or a one-line ValueError for a sharded step that cannot run."""
    G = cluster.gpus_per_node
    if hierarchical or local_steps:
        raise ValueError("sharded is its own layout: not with hierarchical or local_steps")
    if G < 2:
        raise ValueError("sharded needs nodes of several ranks (cluster.gpus_per_node > 1): one rank per node "
                         "shards nothing")
    if not meth.dense and cluster.nodes < 2:
        raise ValueError(f"sharded {meth.name} votes across nodes and the cluster has one: give several nodes")
    if meth.dense and momentum_sync:
        raise ValueError("momentum_sync does not apply to a dense method: its ranks share one momentum")
    if param_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype!r}")
    return G


def unit_sizes(P: int, units, bucket_mb: float) -> list[int]:
    """The FSDP units' parameter counts in forward order: `units`, or P in units of bucket_mb MiB of fp32."""
    if units is None:
        per = max(1, int(bucket_mb * 2**20 // 4))
        full, last = divmod(P, per)
        return [per] * full + ([last] if last else [])
    sizes = [int(u) for u in units]
    if not sizes or any(u < 1 for u in sizes) or sum(sizes) != P:
        raise ValueError(f"units must be positive parameter counts that add up to params ({P}), got {units!r}")
    return sizes


def memory(P: int, G: int, layout: str, sizes=None) -> tuple[float, float]:
    """(bytes per rank of fp32 parameters, gradients and momenta, its fraction of an unsharded replica's):
    flat 12 P; hierarchical the momentum of the shard only; sharded the shard of all three."""
    if layout == "sharded":
        held = REPLICA_BYTES_PER_PARAM * sum(-(-n // G) for n in sizes)
    elif layout == "hierarchical":
        held = 8.0 * P + 4.0 * wire.shard_elements(P, G)
    else:
        held = REPLICA_BYTES_PER_PARAM * P
    return held, held / (REPLICA_BYTES_PER_PARAM * P)


def unit_collectives(meth, n: int, N: int, G: int, lv: int, grad_dtype: str, param_dtype: str) -> dict:
    """One unit's collectives (wire.Collective lists): the forward all-gather, the reduce-scatter, and across
    nodes the baseline's all-reduce ("reduce", FSDP's, blocking backward's end) or the method's ("cross")."""
    S, M = -(-n // G), N // G
    out = dict(gather=[wire.Collective("allgather", G * S * wire.DTYPE_BYTES[param_dtype], param_dtype, "node")],
               scatter=[wire.Collective("reducescatter", G * S * wire.DTYPE_BYTES[grad_dtype], grad_dtype, "node")],
               reduce=[], cross=[], sync=[])
    if meth.dense:
        if M > 1:
            out["reduce"] = [wire.Collective("allreduce", 4 * S, "float32", "cross")]
    else:
        out["cross"] = [dataclasses.replace(c, scope="cross") for c in meth.collectives(S, M, lv)]
        out["sync"] = [wire.Collective("allreduce", 4 * S, "float32", "cross")]
    return out


class Wire:
    """Each distinct list of collectives simulated once (and its twin at HOP_PROBE more latency, for the
    contention model's count of latencies), as Calls and as bytes."""

    def __init__(self, cluster, profile, spec, cache, exact):
        self.cluster, self.profile, self.spec, self.cache, self.exact = cluster, profile, spec, cache, exact
        c = cluster
        self.twin = dataclasses.replace(c, latency=c.latency + HOP_PROBE, intra_latency=c.intra_latency + HOP_PROBE)
        self.memo: dict = {}

    def calls(self, what: str, colls: list, nbytes: float) -> tuple[list[Call], dict]:
        """(the Calls, {seconds, sent, node_sent, nic, algorithm}) of `colls`, issued one after another."""
        key = (what, tuple(colls))
        if key not in self.memo:
            if not colls:
                self.memo[key] = [], dict(seconds=0.0, sent=0.0, node_sent=0.0, nic=0.0, algorithm="none")
                return self.memo[key]
            N, G = self.cluster.ranks, self.cluster.gpus_per_node
            r, t = (simulate_collectives(cl, self.profile, what, colls, self.spec, nbytes, self.cache,
                                         exact=self.exact, node_size=G) for cl in (self.cluster, self.twin))
            node = wire.traffic([c for c in colls if c.scope == "node"], N, G)[0]
            self.memo[key] = calls_of(r, t, what, nbytes, N, G, self.profile), dict(
                seconds=r.seconds, sent=r.bytes_sent_per_rank, node_sent=node, nic=r.nic_bytes_per_node,
                algorithm=r.algorithm)
        return self.memo[key]

    def control(self) -> tuple[Call, dict]:
        """LionCub's control all-reduce (wire.CONTROL) over every rank."""
        if "control" not in self.memo:
            c = wire.CONTROL
            r, t = (simulate_collective(cl, c.op, self.spec.get(c.op, "auto"), c.nbytes, self.profile,
                                        cache=self.cache, exact=self.exact) for cl in (self.cluster, self.twin))
            self.memo["control"] = (control_of(r.algorithm, r.seconds, t.seconds, self.cluster.ranks,
                                               r.bytes_sent_per_rank, self.profile),
                                    dict(seconds=r.seconds, sent=r.bytes_sent_per_rank, node_sent=0.0,
                                         nic=r.nic_bytes_per_node, algorithm=r.algorithm))
        return self.memo["control"]


def simulate(ctx: dict) -> dict:
    """The sharded step: the StepResult fields simulate_step reports (see the module). ctx: cluster (with the
    host's transport), profile, meth, P, sizes, K, fwd and bwd seconds, update_bytes, update_bw, codec_bw,
    host (HostModel or None), spec, cache, exact, levels, grad_dtype, param_dtype, overlap."""
    c, meth, G = ctx["cluster"], ctx["meth"], ctx["cluster"].gpus_per_node
    N, P, host = c.ranks, ctx["P"], ctx["host"] or UNSHARED
    weight = host.ranks_per_host(N, G) if ctx["host"] else 1
    lv = meth.resolve_levels(N // G, ctx["levels"]) if meth.uses_levels else 0
    per = 0.0 if meth.dense else meth.codec_bytes_per_element(N // G, lv, ctx["grad_dtype"])
    net, tally = Wire(c, ctx["profile"], ctx["spec"], ctx["cache"], ctx["exact"]), Tally(ctx["K"])
    plan, share, sizes = [], host.share(weight) if ctx["host"] else 1.0, ctx["sizes"]
    kinds = (("gather", "fsdp allgather"), ("scatter", "fsdp reducescatter"), ("reduce", "fsdp allreduce"),
             ("cross", meth.name), ("sync", "momentum-sync"))
    of_size = {}  # units of one size issue the same collectives
    for n in sizes:
        if n not in of_size:
            colls = unit_collectives(meth, n, N, G, lv, ctx["grad_dtype"], ctx["param_dtype"])
            of_size[n] = {kind: net.calls(what, colls[kind], 4 * n) for kind, what in kinds}
    for n, k in collections.Counter(sizes).items():
        for kind, what in kinds:  # every unit is gathered twice but the root
            count = 2 * k - (n == sizes[0]) if kind == "gather" else k
            tally.add(what, of_size[n][kind][1], 4 * n, count=count, per_step=kind == "sync")
    for u, n in enumerate(sizes):
        step = {kind: of_size[n][kind][0] for kind, _ in kinds}
        # the root (unit 0) stays gathered from forward to backward: FSDP2 does not reshard it
        plan.append(dict(step, gather_back=step["gather"] if u else [], fwd=ctx["fwd"] * n / P * share,
                         bwd=ctx["bwd"] * n / P * share, codec=per * -(-n // G) / ctx["codec_bw"]))
    control = None
    if not meth.dense:
        control, figures = net.control()
        tally.add(CONTROL, figures, wire.CONTROL.nbytes)
    out = _run(ctx, lv, host, weight, plan, control)
    msync = out["msync"] / ctx["K"] if ctx["K"] else 0.0
    held, fraction = memory(P, G, "sharded", ctx["sizes"])
    return dict(step=out["step"] + msync, optimizer=out["update"], codec=out["codec"],
                comm=out["comm"] + out["fsdp"] + msync, exposed=out["exposed"] + msync, msync=msync,
                fsdp_exposed=out["fsdp_exposed"],
                memory=held, memory_fraction=fraction, contention=dict(out, host=host.to_dict(), ranks_per_host=weight)
                if ctx["host"] else None, **tally.totals())



def _run(ctx: dict, lv: int, host: HostModel, weight: int, plan: list, control) -> dict:
    """ShardedSim's phases of the step. The momentum sync runs after everything else, on cores nothing else uses
    then, so the step before it is simulated once per cache for every K (autotune asks for many) and the sync
    on its own."""
    G, synchronous = ctx["cluster"].gpus_per_node, bool(ctx["profile"].codec_on_compute)
    update = ctx["update_bytes"] * sum(-(-n // G) for n in ctx["sizes"]) / ctx["update_bw"]
    codecs, applied = apply_split(host, ctx["meth"], [unit["codec"] for unit in plan])
    if applied is not None:  # a compressed step's apply runs in step(), after the exchange (contention.apply_split)
        plan, update = [dict(unit, codec=c) for unit, c in zip(plan, codecs)], applied
    key = ctx["cache"].key(ctx["cluster"], ctx["profile"], "sharded step", ctx["meth"].name, ctx["P"]) + (
        tuple(ctx["sizes"]), lv, ctx["fwd"], ctx["bwd"], update, ctx["codec_bw"], ctx["grad_dtype"],
        ctx["param_dtype"], repr(ctx["spec"]), ctx["exact"], ctx["overlap"])
    sync = [x for unit in plan for x in unit["sync"]] if ctx["K"] else []
    if ctx["host"] is None:  # devices nobody shares: the same events without processes
        return unshared_step(plan, update, control, sync, synchronous, ctx["overlap"])
    steps = ctx["cache"].steps
    if key not in steps:
        steps[key] = ShardedSim(host, weight, plan, update, control, [], synchronous, ctx["overlap"],
                                compute=ctx["fwd"] + ctx["bwd"]).run()
    msync = ShardedSim(host, weight, [], 0.0, None, sync, synchronous, ctx["overlap"]).run()["msync"] if sync else 0.0
    return dict(steps[key], msync=msync)


class Tally:
    """The step's collectives as StepResult lists them, and its bytes (momentum sync counted 1/K)."""

    def __init__(self, K):
        self.K, self.rows = K, []
        self.sent = self.node_sent = self.nic = 0.0

    def add(self, what: str, figures: dict, size: int, count: int = 1, per_step: bool = False) -> None:
        if figures["algorithm"] == "none" or (per_step and not self.K):
            return
        rate = 1 / self.K if per_step else 1.0
        self.sent += rate * count * figures["sent"]
        self.node_sent += rate * count * figures["node_sent"]
        self.nic += rate * count * figures["nic"]
        tally(self.rows, what, figures["algorithm"], size, figures["seconds"], per_step=rate, count=count)

    def totals(self) -> dict:
        return dict(sent=self.sent, node_sent=self.node_sent, nic=self.nic, collectives=self.rows)


# ---- the step's processes -----------------------------------------------------------------------------
class ShardedSim:
    """The sharded step as SimPy processes on the representative rank's devices.

    Processes: the main thread (forward and backward unit by unit, then the update); on GPUs the all-gather,
    reduce-scatter and all-reduce streams of FSDP2; LionCub's communication thread (overlap). Events tie them
    together: a unit's parameters gathered, its compute started, its gradients ready, its shard reduce-scattered,
    its shard all-reduced. Collectives cost what contention.StepSim charges (the network's time, and on busy
    cores the waits for a core and their CPU work on the host's `Cores`).

    plan[u] (forward order, unit 0 the root): dict(fwd, bwd, codec: device-seconds of work; gather,
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


__all__ = ["REPLICA_BYTES_PER_PARAM", "UNSHARED", "ShardedSim", "Wire", "check", "memory", "unit_collectives",
           "unit_sizes", "unshared_step"]
