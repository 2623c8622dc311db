"""Local steps in the step model: LionCub(local_steps=H), streamed (fragments=F, outer_delay=D) or not, flat or in
the node layout (hierarchical=True).

Every step is compute and a local Lion update. In the node layout every step also averages the gradients inside
the node first (an fp32 all-reduce of each bucket among the node's G ranks, in step(): exposed), and only local
rank 0 of every node votes, one voter per node on the cross links, then broadcasts the voted flag and the agreed
update inside its node.

The outer exchange of a set of buckets is what lioncub.optim.outer issues: one small all-gather among the voters
(the non-finite flag and the scales: costed as the step's control message), then each bucket's codec and the
method's collectives for the voters, one after another; the outer step's own passes (OUTER_BYTES_PER_PARAM) run
on the main thread.

* Not streamed: every H-th step runs the whole model's exchange inside step(), all exposed, amortized as 1/H.
* Drift: with no collective for k steps the ranks drift apart, and an exchange starts when the latest voter
  arrives (`HostModel.drift`, from the host's measured step-to-step variation; none without a host model).
* Streamed: the buckets are cut into F fragments (lioncub.comm.fragment_schedule, as the optimizer cuts them);
  fragment f's exchange is queued at its offset in the interval on one communication thread (first in, first out) and
  step() waits for it D inner steps later. The exposed time is what those waits add, from a timeline of the
  main thread (inner steps) and the thread (the exchanges) run until it repeats. On hosts where the codec runs on
  the computing cores (codec_on_compute: CPU ranks) the thread's codec lengthens the inner steps instead. In
  the node layout a fragment's time on the thread is its voter's exchange and then the leader's broadcasts of
  the flag and of the fragment's agreed update inside the node (the inner steps' node mean stays in step()).

On a host's shared devices (a profile with a `host`) the same step runs as processes on its cores
(`LocalSim`): the inner update at the share each rank gets, and the outer exchange's collectives with their
CPU and their wake-ups, which a streamed exchange pays while the next inner steps compute.

A node broadcast is costed as an all-gather of the same output inside the node (the simulator's primitives
have no broadcast; a pipelined broadcast and a ring all-gather move about the same bytes per link).
"""

from __future__ import annotations

import simpy

from lioncub.comm import fragment_schedule, wire

from ..collectives.results import CONTROL, tally
from . import contention
from .hosts import Cores

# the outer step's passes beyond the codec (lioncub.optim.outer), fp32: the pseudo-gradient (read anchor, p and
# residual, write delta), its scales (read), the residual (read delta and the local value, write), the decoded
# update (write, read), the outer momentum (read, write), the anchor (read, write) and the parameters (write)
OUTER_BYTES_PER_PARAM = 64.0
NODE_MEAN = "node mean allreduce"  # how StepResult.collectives lists the node layout's inner all-reduce
NODE_BROADCAST = "node broadcast"  # ... and the leader's broadcasts of the outer step inside the node


def check(local_steps, fragments, outer_delay, momentum_sync) -> tuple[int, int] | None:
    """(F, D) of a streamed configuration, None otherwise; one-line errors, LionCub's own."""
    if local_steps is not None and (isinstance(local_steps, bool) or not isinstance(local_steps, int)
                                    or local_steps < 1 or momentum_sync):
        raise ValueError("local_steps must be an int >= 1, without momentum_sync")
    return fragment_schedule.check_options(fragments, outer_delay, local_steps)


class NodeExchanges:
    """The node layout's collectives inside one node (every node alike): the inner mean, the outer broadcasts.
    `simulate(name, colls, nbytes)` is simulate_collectives on the cluster with node_size G."""

    def __init__(self, simulate, G: int):
        self.simulate, self.G, self.memo = simulate, G, {}

    def mean(self, e: int):
        if ("mean", e) not in self.memo:
            self.memo["mean", e] = self.simulate(NODE_MEAN, [wire.Collective("allreduce", 4 * e, "float32", "node")],
                                                 4 * e)
        return self.memo["mean", e]

    def broadcast(self, nbytes: int):
        if ("bcast", nbytes) not in self.memo:
            self.memo["bcast", nbytes] = self.simulate(
                NODE_BROADCAST, [wire.Collective("allgather", nbytes, "float32", "node")], nbytes)
        return self.memo["bcast", nbytes]


def local_step(voters, node: NodeExchanges | None, buckets, P: int, times: dict, H: int,
               stream: tuple[int, int] | None = None, host=None, shared=None) -> dict:
    """The step's parts (model.py's `_communicate` keys), per step. voters: the exchanges of the voting ranks
    (model.py's _Exchanges: the world flat, one rank per node in the node layout); buckets: (elements, count)
    runs; times: model.py's kernel times (the codec for the voters); stream: (F, D) or None; host: the profile's
    HostModel or None (its `drift`: the ranks' drift between the exchanges, a wait for the latest voter);
    shared: (the ranks sharing a host's devices, the voters' and the node's exchanges on links with
    contention.HOP_PROBE more latency) to run the step on the host's devices (`LocalSim`; with `host`),
    which then also gives "step" and "optimizer"."""
    t = dict(codec=0.0, comm=0.0, exposed=0.0, tail=[], msync=0.0, sent=0.0, nic=0.0, collectives=[])
    if node is not None:
        _inner_node_mean(t, node, buckets)
    sizes = [e for e, k in buckets for _ in range(k)]
    if voters.N == 1 and node is None:
        return t
    passes = OUTER_BYTES_PER_PARAM * P / times["codec_bw"]
    step = times["fwd"] + times["bwd"] + times["optimizer"] + t["exposed"]
    drift = (lambda k: host.drift(k, step, voters.N)) if host is not None else (lambda k: 0.0)
    if stream is None:
        ex = _exchange(voters, node, sizes, times, t["collectives"], 1 / H)
        wait = drift(H) + ex["comm"]
        t["codec"] += (ex["codec"] + passes) / H
        t["comm"] += ex["comm"] / H
        t["exposed"] += wait / H
        t["tail"] += [(ex["codec"] + passes) / H, wait / H]
    else:
        ex = _streamed(t, voters, node, sizes, times, H, *stream, passes, drift)
    t["sent"] += ex["sent"] / H
    t["nic"] += ex["nic"] / H
    if host is not None and shared is not None:
        t.update(_on_shared_devices(voters, node, buckets, sizes, P, times, H, stream, host, shared, passes,
                                    drift(H / stream[0] if stream else H)))
    return t


def _on_shared_devices(voters, node, buckets, sizes, P, times, H, stream, host, shared, passes, drift) -> dict:
    """The step's times from its processes on the host's devices (`LocalSim`): step, optimizer, exposed,
    codec, comm per inner step."""
    weight, probed_voters, probed_node = shared
    F, D = stream or (1, 0)
    frags = [[sizes[i] for i in ks] for ks in fragment_schedule.split(sizes, F)] if stream else [sizes]
    offsets = fragment_schedule.offsets(H, F) if stream else [0]
    work = dict(compute=contention.compute_work(host, weight, times["fwd"] + times["bwd"]),
                update=times["optimizer"], launch=[], thread=[], apply=[])
    calls = []
    for f in frags:
        share = passes * sum(f) / P
        codec = sum(times["codec_bytes"](e) for e in f) / times["codec_bw"]
        work["launch"].append(share * LAUNCH_BYTES / OUTER_BYTES_PER_PARAM)
        work["apply"].append(share * APPLY_BYTES / OUTER_BYTES_PER_PARAM)
        work["thread"].append(codec + share * (1 - (LAUNCH_BYTES + APPLY_BYTES) / OUTER_BYTES_PER_PARAM))
        calls.append(_calls(voters, node, probed_voters, probed_node, f))
    node_calls = []
    if node is not None:
        N = voters.N * node.G
        for e, k in buckets:
            node_calls += contention.calls_of(node.mean(e), probed_node.mean(e), NODE_MEAN, 4 * e, N, node.G,
                                              voters.profile) * k
    return LocalSim(host, weight, H, work, calls, node_calls, offsets, D, drift).run()


def _calls(voters, node, probed_voters, probed_node, sizes: list[int]) -> list:
    """The Calls of one outer exchange of the buckets `sizes` (as `_exchange` issues them) for contention.run_call."""
    out = []
    if voters.N > 1:
        out.append(contention.control_call(voters, probed_voters, voters.N))
        for e in sizes:
            r, _, size = voters.bucket(e)
            out += contention.calls_of(r, probed_voters.bucket(e)[0], voters.meth.name, size, voters.N, 0,
                                       voters.profile)
    if node is not None:
        N = voters.N * node.G
        for nbytes in [4] + [4 * e for e in sizes]:
            out += contention.calls_of(node.broadcast(nbytes), probed_node.broadcast(nbytes), NODE_BROADCAST, nbytes,
                                       N, node.G, voters.profile)
    return out


def _inner_node_mean(t: dict, node: NodeExchanges, buckets) -> None:
    """Every step: each bucket's fp32 all-reduce inside the node, in step() after backward (exposed)."""
    for e, k in buckets:
        r = node.mean(e)
        t["comm"] += k * r.seconds
        t["exposed"] += k * r.seconds
        t["sent"] += k * r.bytes_sent_per_rank
        tally(t["collectives"], NODE_MEAN, r.algorithm, 4 * e, r.seconds, count=k)
    t["tail"].append(t["exposed"])


def _exchange(voters, node, sizes: list[int], times: dict, colls: list, per_step: float) -> dict:
    """One outer exchange of the buckets `sizes`: {codec, comm, sent, nic} of the busiest rank (a voter), the
    collectives tallied into `colls` at `per_step`."""
    out = dict(codec=0.0, comm=0.0, sent=0.0, nic=0.0)

    def add(r, what, alg, size, leaves_node=True):
        out["comm"] += r.seconds
        out["sent"] += r.bytes_sent_per_rank
        out["nic"] += r.nic_bytes_per_node if leaves_node else 0.0
        tally(colls, what, alg, size, r.seconds, per_step=per_step)

    if voters.N > 1:
        r = voters.control()
        add(r, CONTROL, r.algorithm, wire.CONTROL.nbytes)
    for e in sizes:
        out["codec"] += times["codec_bytes"](e) / times["codec_bw"]
        if voters.N > 1:
            r, alg, size = voters.bucket(e)
            add(r, voters.meth.name, alg, size)
    if node is not None:
        for nbytes in [4] + [4 * e for e in sizes]:  # the voted flag, then the agreed update of each bucket
            r = node.broadcast(nbytes)
            add(r, NODE_BROADCAST, r.algorithm, nbytes, leaves_node=False)
    return out


def _streamed(t: dict, voters, node, sizes: list[int], times: dict, H: int, F: int, D: int, passes: float,
              drift) -> dict:
    """The streamed outer steps: each fragment's exchange on the thread (in the node layout, the voter's exchange
    and then its broadcasts inside the node), step()'s waits from the timeline. A fragment's exchange starts when
    the latest voter has launched it: drift over the H / F steps since the previous application, which waited
    for every voter."""
    frags = [[sizes[i] for i in ks] for ks in fragment_schedule.split(sizes, F)]
    whole = dict(codec=0.0, comm=0.0, sent=0.0, nic=0.0)
    busy = []  # each fragment's time on the thread
    for f in frags:
        ex = _exchange(voters, node, f, times, t["collectives"], 1 / H)
        for key in whole:
            whole[key] += ex[key]
        busy.append(drift(H / F) + ex["comm"] + (0.0 if times["codec_on_compute"] else ex["codec"]))
    on_cores = whole["codec"] if times["codec_on_compute"] else 0.0
    inner = times["fwd"] + times["bwd"] + times["optimizer"] + t["exposed"] + (passes + on_cores) / H
    waited = stream_waits(H, fragment_schedule.offsets(H, F), D, inner, busy)
    t["codec"] += (whole["codec"] + passes) / H
    t["comm"] += whole["comm"] / H
    t["exposed"] += waited / H
    t["tail"] += [(passes + on_cores) / H, waited / H]
    return whole


def stream_waits(H: int, offsets: list[int], D: int, inner: float, busy: list[float], cycles: int = 6) -> float:
    """The seconds step() waits for the streamed exchanges over one interval of H steps, once the timeline
    repeats: inner steps of `inner` seconds; after step t, fragment f's exchange (`busy[f]` seconds on the one
    thread, first in, first out) is launched when t % H == offsets[f], then step() waits for each exchange
    launched D steps before (LionCub's order: launch, then apply)."""
    now, free, pending, per_cycle = 0.0, 0.0, [], []
    for t in range(1, cycles * H + 1):
        now += inner
        for f, o in enumerate(offsets):
            if t % H == o:
                free = max(free, now) + busy[f]
                pending.append((t + D, free))
        if t % H == 1 or H == 1:
            per_cycle.append(0.0)
        while pending and pending[0][0] <= t:
            _, done = pending.pop(0)
            wait = max(0.0, done - now)
            now += wait
            per_cycle[-1] += wait
    return per_cycle[-1]


# ---- on a host's shared devices -------------------------------------------------------------------------
# the outer step's passes (OUTER_BYTES_PER_PARAM) by where LionCub runs them: the pseudo-gradient at the
# launch (read anchor, p and residual, write delta), the scales, residual and decoded update on the thread, the
# outer momentum, the anchor and the parameters at the application
LAUNCH_BYTES, APPLY_BYTES = 16.0, 20.0
CYCLES = 3  # intervals of H steps simulated; the last is the step's (LionCub's timeline repeats from the second)


class LocalSim:
    """Local steps on shared devices (a profile with a `host`: hosts.py), as SimPy processes, as contention.py
    runs the steps of the methods that talk every step: the timeline of one representative rank per host (the
    host's ranks are symmetric):

    * the main thread, every inner step: forward and backward (the measured compute, every rank of the host
      computing), in the node layout the node mean's collectives (exposed), the inner Lion update; then the outer
      step's launches (the fragment's pseudo-gradient, a pass over its parameters) and applications (the wait for
      its exchange, the outer optimizer's passes), in LionCub's order;
    * the communication thread takes the launched exchanges first in, first out: the wait for the latest voter
      (`HostModel.drift` over the steps since the previous exchange), the codec and its share of the outer passes,
      then each collective (`contention.run_call`: its network time, a wake-up at each wait while the host's cores
      are busy, its software path's CPU on the cores).

    In the node layout only each node's leader votes; the model runs the leader's thread for every rank of the
    host (the ranks are taken as symmetric), an upper bound on what the thread takes from the cores.

    An outer step that is not streamed is one fragment of every bucket, launched and applied at every H-th step
    (D = 0): step() waits for all of it. Streamed, the thread's work shares the cores with the next inner steps'
    compute, and its collectives' waits fall while every core computes: what makes a streamed exchange on a CPU
    host take longer than the same exchange in step(). The timeline runs until it repeats; the last interval of H
    steps is the step's.

    work: compute (device-seconds of forward and backward), update (the inner Lion update), launch[f], thread[f]
    (codec and outer passes) and apply[f] per fragment; calls[f]: fragment f's Calls on the thread; node: the node
    mean's Calls of every inner step (in step()); offsets, D: LionCub's stagger; drift: the wait for the latest voter
    before each exchange."""

    def __init__(self, host, weight: int, H: int, work: dict, calls: list, node: list, offsets: list[int], D: int,
                 drift: float):
        self.env = simpy.Environment()
        self.cores = Cores(self.env, host, weight)
        self.host, self.H, self.work, self.calls, self.node = host, H, work, calls, node
        self.offsets, self.D, self.drift = offsets, D, drift
        self.queue = simpy.Store(self.env)
        self.last = dict(exposed=0.0, optimizer=0.0, codec=0.0, comm=0.0)

    def run(self) -> dict:
        """Per inner step, over the last interval: step, exposed, optimizer (the inner update; the launches and the
        applications when streamed, else they are exposed), codec and comm (the thread's)."""
        self.env.process(self.thread())
        main = self.env.process(self.main())
        start, end = self.env.run(until=main)
        out = {k: v / self.H for k, v in self.last.items()}
        out["step"] = (end - start) / self.H
        return out

    def _counting(self, t: int) -> bool:
        return t > (CYCLES - 1) * self.H

    def _timed(self, key: str, t: int, event):
        t0 = self.env.now
        yield event
        if self._counting(t):
            self.last[key] += self.env.now - t0

    def main(self):
        env, work, cores = self.env, self.work, self.cores
        pending, start = [], 0.0
        outer = "exposed" if self.D == 0 else "optimizer"  # an outer step in step(): LionCub times all of it as exposed
        for t in range(1, CYCLES * self.H + 1):
            if t == (CYCLES - 1) * self.H + 1:
                start = env.now
            yield cores.run(work["compute"])
            for c in self.node:
                yield from self._timed("exposed", t, env.process(contention.run_call(env, cores, self.host, c)))
            yield from self._timed("optimizer", t, cores.run(work["update"]))
            for f, o in enumerate(self.offsets):
                if t % self.H == o:
                    yield from self._timed(outer, t, cores.run(work["launch"][f]))
                    done = env.event()
                    pending.append((t + self.D, f, done))
                    self.queue.put((t, f, done))
            while pending and pending[0][0] <= t:
                _, f, done = pending.pop(0)
                yield from self._timed("exposed", t, done)
                yield from self._timed(outer, t, cores.run(work["apply"][f]))
        return start, env.now

    def thread(self):
        env = self.env
        while True:
            t, f, done = yield self.queue.get()
            yield env.timeout(self.drift)
            yield from self._timed("codec", t, self.cores.run(self.work["thread"][f]))
            for c in self.calls[f]:
                yield from self._timed("comm", t, env.process(contention.run_call(env, self.cores, self.host, c)))
            done.succeed()

