"""What an algorithm sees of a rank: send, recv, reduce, sendrecv, slices, flush, and the three calls that
let the simulator do less: send_each, exchange, fast_forward.

A rank's program is a generator. `ctx.send(dst, nbytes, tag)` hands a message to the network and returns
at once (the message's `.sent` event fires when its last byte has left); `yield ctx.recv(src, tag, n)`
waits for a message; `yield from ctx.reduce(n)` spends n * gamma seconds; `yield from ctx.sendrecv(...)`
is MPI_Sendrecv. A collective ends on a rank when its own sends have left and its receives arrived.

`yield from ctx.send_each(msgs)` sends one after another, each once the previous has left; `yield
ctx.exchange(sends, recvs)` posts sends and receives at once and waits for the receives: both are what
their loops would do, costed as one train when nothing can compete with them. `k += ctx.fast_forward(kind,
ahead, tags)` at the end of each step of a loop skips the steps ahead when the simulation is in a steady
state (steady.py). Sim(fast=False), the exact run, does none of that.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import simpy

from ..net.cluster import Cluster
from ..net.engine import succeed_in
from ..net.network import Network
from . import steady
from .symmetry import Symmetry

if TYPE_CHECKING:
    from ..profiles import BackendProfile


class Sim:
    """One simulation: its environment, network and mailbox. fast: steady stretches may be fast-forwarded
    (Rank.fast_forward); False for the exact, message-by-message run."""

    def __init__(self, cluster: Cluster, profile: BackendProfile, sym: Symmetry, timeline: bool,
                 rendezvous: bool = False, fast: bool = True):
        self.env = simpy.Environment()
        self.cluster = cluster
        self.profile = profile
        self.sym = sym
        self.net = Network(self.env, cluster, profile, canonical=sym.canonical if sym.unit < sym.p else None,
                           rendezvous=rendezvous)
        self.mailbox: dict = {}
        self.timeline = timeline
        self.messages = 0
        # rendezvous: a send waits for the receiver's ready notice (profile.rendezvous); every rank simulated
        self.rendezvous = rendezvous
        self.fast = fast and not timeline and not rendezvous
        self.solo = False  # only one process sends (a class's sub-simulation)
        self.skipped = 0  # segments fast-forwarded

    def quiescent(self) -> bool:
        """Nothing scheduled, no flow on the network, no message in flight or waiting for its receiver,
        every communication thread idle: what happens next depends only on what the running process
        does next."""
        env, net = self.env, self.net
        if env.peek() < math.inf or self.mailbox or not net.idle:
            return False
        return net.threads_idle(env.now)

    def box(self, key) -> simpy.Event:
        """The event of message key = (src, dst, tag): the one its receive waits on and its arrival
        triggers. Whichever side comes first creates it; the other takes it out of the mailbox."""
        box = self.mailbox
        ev = box.pop(key, None)
        if ev is None:
            ev = self.env.event()
            box[key] = ev
        return ev


class _Deferred:
    """A send waiting for the receiver's ready notice; `.sent` fires when its last byte has left."""

    __slots__ = ("sent",)

    def __init__(self, env):
        self.sent = env.event()


class Rank:
    """What an algorithm sees of one rank."""

    def __init__(self, sim: Sim, r: int, family: str):
        self.sim = sim
        self.env = sim.env
        self.r = r
        self.p = sim.cluster.ranks
        self.cluster = sim.cluster
        self.family = family
        self.pending: list = []
        self.bytes_sent = 0.0
        self.bytes_received = 0.0
        self.bytes_out = 0.0  # of bytes_sent, those to ranks of other nodes: what leaves through the NIC
        self._g = sim.cluster.gpus_per_node
        self.events: list | None = [] if sim.timeline else None
        self.finished = 0.0
        self._steady: list = []  # the states at the last fast_forward points

    # ---- primitives ---------------------------------------------------------------------------------
    def send(self, dst: int, nbytes: float, tag):
        """Hand nbytes for rank dst to the network; returns the Message (its .sent event fires when the
        last byte has left). Does not wait. In rendezvous mode the message is handed over only once dst's
        ready notice for this tag has arrived (at once if it already has)."""
        sim = self.sim
        delivered = self.sim.box((self.r, dst, tag))
        if sim.rendezvous:
            notice = self.sim.box((dst, self.r, ("ready", tag)))
            if notice.triggered:
                msg = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
            else:
                msg = _Deferred(self.env)

                def go(_ev, msg=msg):
                    real = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
                    real.sent.callbacks.append(lambda _e: msg.sent.succeed())

                notice.callbacks.append(go)
        else:
            msg = sim.net.submit(self.r, dst, nbytes, self.family, delivered)
            msg.tag = tag
        sim.messages += 1
        self._count(dst, nbytes)
        self.pending.append(msg.sent)
        if self.events is not None:
            t0 = self.env.now
            msg.sent.callbacks.append(
                lambda _ev: self.events.append(("send", t0, self.env.now, dst, nbytes)))
        return msg

    def _count(self, dst: int, nbytes: float) -> None:
        self.bytes_sent += nbytes
        if dst // self._g != self.r // self._g:
            self.bytes_out += nbytes

    def recv(self, src: int, tag, nbytes: float) -> simpy.Event:
        """The event of the message from rank src with this tag arriving here."""
        s, d = self.sim.sym.to_rep(src, self.r)
        ev = self.sim.box((s, d, tag))
        if self.sim.rendezvous:  # tell src we are ready: a control message on our connection to src
            self.sim.net.submit(self.r, src, 0.0, self.family, self.sim.box((d, s, ("ready", tag))))
        self.bytes_received += nbytes
        if self.events is not None:
            t0 = self.env.now
            ev.callbacks.append(lambda _ev: self.events.append(("recv", t0, self.env.now, src, nbytes)))
        return ev

    def reduce(self, nbytes: float):
        """Sum nbytes of received data into the local buffer (gamma * nbytes seconds)."""
        gamma = self.sim.profile.gamma
        if gamma > 0 and nbytes > 0:
            t0 = self.env.now
            yield self.env.timeout(gamma * nbytes)
            if self.events is not None:
                self.events.append(("reduce", t0, self.env.now, None, nbytes))

    def sendrecv(self, dst: int, src: int, nbytes: float, tag, recv_bytes: float | None = None):
        """Send to dst and receive from src at the same time; wait for both (MPI_Sendrecv)."""
        msg = self.send(dst, nbytes, tag)
        ev = self.recv(src, tag, nbytes if recv_bytes is None else recv_bytes)
        yield self.env.all_of([msg.sent, ev])

    def slices(self, chunk: float) -> list[float]:
        return slices(self.sim.profile.slice_bytes, chunk)

    def send_each(self, msgs: list[tuple]):
        """Send [(dst, nbytes, tag)] one after another, each once the previous one has left (a generator:
        `yield from ctx.send_each(...)`).

        A *train* in a simulation with one sending process (Sim.solo) on an idle network without burst
        credit: each message is then alone on the network when it enters, so its times are those of a
        lone flow (the network's own allocation, per path), and the train costs one event; arrivals are
        handed to `arrive_at`."""
        sim, net = self.sim, self.sim.net
        if not (sim.fast and sim.solo and sim.profile.link_burst == 0 and net.idle):
            for dst, nb, tag in msgs:
                yield self.send(dst, nb, tag).sent
            return
        o, now = sim.profile.message_overhead, self.env.now
        t = now
        cpu = max(now, net.thread_free.get(self.r, 0.0))
        for dst, nb, tag in msgs:
            per_byte, latency = net.lone(self.r, dst, self.family)
            cpu = max(t, cpu) + o
            t = cpu + nb * per_byte
            self.arrive_at(dst, tag, t + latency)
            sim.messages += 1
            self._count(dst, nb)
        net.thread_free[self.r] = cpu
        if t > now:
            yield self.env.timeout(t - now)

    def arrive_at(self, dst: int, tag, t: float) -> None:
        """A train's message to dst arrives at time t."""
        succeed_in(self.sim.box((self.r, dst, tag)), t - self.env.now)

    def exchange(self, sends: list[tuple], recvs: list[tuple]) -> simpy.Event:
        """Post sends [(dst, nbytes, tag)] and receives [(src, tag, nbytes)] all at once, pairwise in
        order (send, then receive); the event of every receive having arrived. Its sends leave one after
        another through the communication thread (message_overhead each).

        A *train*: when the simulation is quiescent (Sim.quiescent), one representative rank stands for
        all (its receives are the images of its own sends; every path is of one kind), there is no burst
        credit, and each message would be done before the next one enters (its bytes at the rate it gets
        alone on its path take less than message_overhead), then no two of them ever share a link and
        nothing else can start before the last arrives: each message's times are those of a lone flow
        (the network's own allocation), and the train costs one event."""
        ev = self._train(sends, recvs)
        if ev is not None:
            return ev
        arrivals = []
        for (dst, nb, tag), (src, rtag, rnb) in zip(sends, recvs):
            self.send(dst, nb, tag)
            arrivals.append(self.recv(src, rtag, rnb))
        return self.env.all_of(arrivals)

    def _train(self, sends, recvs):
        sim, net, prof = self.sim, self.sim.net, self.sim.profile
        o = prof.message_overhead
        if not (sim.fast and sim.sym.unit == 1 and o > 0 and prof.link_burst == 0 and sends
                and len(sends) == len(recvs) and sim.quiescent()):
            return None
        # one representative rank (unit 1: one GPU per node, one kind of path between any two ranks)
        r, to_rep = self.r, sim.sym.to_rep
        for (dst, _, tag), (src, rtag, _) in zip(sends, recvs):
            if rtag != tag or to_rep(src, r) != (r, dst):
                return None
        per_byte, latency = net.lone(r, sends[0][0], self.family)
        sizes = {nb for _, nb, _ in sends}
        if max(sizes) * per_byte >= o * (1 - 1e-9):
            return None
        now = self.env.now
        t = max(now, net.thread_free.get(r, 0.0))
        if len(sizes) == 1:
            t += len(sends) * o
            last_sent = t + sizes.pop() * per_byte
        else:
            last_sent = now
            for _, nb, _ in sends:
                t += o
                last_sent = max(last_sent, t + nb * per_byte)
        net.thread_free[r] = t
        sim.messages += len(sends)
        for dst, nb, _ in sends:
            self._count(dst, nb)
        self.bytes_received += sum(nb for _, _, nb in recvs)
        self.pending.append(self.env.timeout(last_sent - now))
        return self.env.timeout(last_sent + latency - now)

    def fast_forward(self, kind, ahead, tags=None) -> int:
        """Called by an algorithm at the end of each *segment* of its program (a ring step: the receipt of
        its last slice), with the segment's `kind` and how many segments of the same kind follow (the
        algorithm vouches that their actions are the same: same sizes, same kinds of peers; a callable is
        asked only when it matters), and how its tags relate to the segment (`steady.StepTags(k)`; None if
        no tag is in flight at segment ends).

        If the whole simulation was in the same state (steady.signature) at the ends of the last two
        segments, of this kind, as it is now (two, not one: a state that happens to recur once proves
        less), the segments ahead repeat the last one shifted in time (the
        model is deterministic and does not depend on the absolute time): they are skipped at once
        (steady.skip), and this rank's byte counters and the message count move on by theirs. Returns how
        many segments were skipped."""
        sim = self.sim
        if not sim.fast:
            return 0
        sig = steady.signature(sim, tags)
        if sig is None:
            self._steady = []
            return 0
        now = self.env.now
        point = (kind, sig, now, self.bytes_sent, self.bytes_received, sim.messages, self.bytes_out)
        hist = self._steady = [*self._steady[-2:], point]
        if len(hist) < 3 or any(h[0] != kind or not steady.same(h[1], sig, now) for h in hist[:2]):
            return 0
        if callable(ahead):
            ahead = ahead()
        if ahead <= 0:
            return 0
        _, _, t0, s0, r0, m0, o0 = hist[1]
        steady.skip(sim, ahead, now - t0, tags)
        self.bytes_sent += ahead * (self.bytes_sent - s0)
        self.bytes_out += ahead * (self.bytes_out - o0)
        self.bytes_received += ahead * (self.bytes_received - r0)
        sim.messages += ahead * (sim.messages - m0)
        sim.skipped += ahead
        self._steady = []
        return ahead

    def flush(self):
        """Wait until every message this rank sent has left."""
        waiting = [e for e in self.pending if not e.processed]
        self.pending = []
        if waiting:
            yield self.env.all_of(waiting)


def slices(slice_bytes: float | None, chunk: float) -> list[float]:
    """A chunk cut into equal slices of at most slice_bytes (the profile's pipelining; None: one piece)."""
    if slice_bytes is None or chunk <= slice_bytes:
        return [chunk]
    m = math.ceil(chunk / slice_bytes)
    return [chunk / m] * m
