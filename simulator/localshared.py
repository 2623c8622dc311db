"""Local steps on shared devices (a profile with a `host`: hosts.py), as SimPy processes, as contention.py runs the
steps of the methods that talk every step. One representative rank per host (the host's ranks are symmetric):

* the main thread, every inner step: forward and backward (the measured compute, every rank of the host computing),
  in the node layout the node mean's collectives (exposed), the inner Lion update; then the outer step's launches
  (the fragment's pseudo-gradient, a pass over its parameters) and applications (the wait for its exchange, the
  outer optimizer's passes), in LionCub's order;
* the communication thread takes the launched exchanges first in, first out: the wait for the latest voter
  (`HostModel.drift` over the steps since the previous exchange), the codec and its share of the outer passes,
  then each collective (`contention.run_call`: its network time, a wake-up at each wait while the host's cores
  are busy, its software path's CPU on the cores).

In the node layout only each node's leader votes; the model runs the leader's thread for every rank of the host
(the ranks are taken as symmetric), an upper bound on what the thread takes from the cores.

An outer step that is not streamed is one fragment of every bucket, launched and applied at every H-th step (D = 0):
step() waits for all of it. Streamed, the thread's work shares the cores with the next inner steps' compute,
and its collectives' waits fall while every core computes: what makes a streamed exchange on a CPU host take
longer than the same exchange in step(). The timeline runs until it repeats; the last interval of H steps is
the step's.
"""

from __future__ import annotations

import simpy

from . import contention
from .hosts import Cores

# the outer step's passes (localsteps.OUTER_BYTES_PER_PARAM) by where LionCub runs them: the pseudo-gradient at the
# launch (read anchor, p and residual, write delta), the scales, residual and decoded update on the thread, the
# outer momentum, the anchor and the parameters at the application
LAUNCH_BYTES, APPLY_BYTES = 16.0, 20.0
CYCLES = 3  # intervals of H steps simulated; the last is the step's (LionCub's timeline repeats from the second)


class LocalSim:
    """The timeline of one representative rank (see the module).

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


__all__ = ["APPLY_BYTES", "LAUNCH_BYTES", "LocalSim"]
