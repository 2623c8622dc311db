"""What an algorithm sees of a rank: send, recv, reduce, sendrecv, slices, flush.

A rank's program is a generator. `ctx.send(dst, nbytes, tag)` hands a message to the network and returns
at once (the message's `.sent` event fires when its last byte has left); `yield ctx.recv(src, tag, n)`
waits for a message; `yield from ctx.reduce(n)` spends n * gamma seconds; `yield from ctx.sendrecv(...)`
is MPI_Sendrecv. A collective ends on a rank when its own sends have left and its receives arrived.
"""

from __future__ import annotations

import math

import simpy

from .cluster import Cluster
from .network import Network
from .profiles import BackendProfile
from .symmetry import Symmetry


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
        self.skipped = 0  # segments fast-forwarded

    def quiescent(self) -> bool:
        """Nothing scheduled, no flow on the network, no message in flight or waiting for its receiver,
        every communication thread idle: what happens next depends only on what the running process
        does next."""
        env, net = self.env, self.net
        if env._queue or self.mailbox or net.active or net._dirty:
            return False
        now = env.now
        return all(t <= now for t in net._cpu_free.values())


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
        self.events: list | None = [] if sim.timeline else None
        self.finished = 0.0
        self._steady = None  # the state at the last fast_forward point

    # ---- primitives ---------------------------------------------------------------------------------
    def _box(self, key) -> simpy.Event:
        box = self.sim.mailbox
        ev = box.pop(key, None)
        if ev is None:
            ev = self.env.event()
            box[key] = ev
        return ev

    def send(self, dst: int, nbytes: float, tag):
        """Hand nbytes for rank dst to the network; returns the Message (its .sent event fires when the
        last byte has left). Does not wait. In rendezvous mode the message is handed over only once dst's
        ready notice for this tag has arrived (at once if it already has)."""
        sim = self.sim
        delivered = self._box((self.r, dst, tag))
        if sim.rendezvous:
            notice = self._box((dst, self.r, ("ready", tag)))
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
        sim.messages += 1
        self.bytes_sent += nbytes
        self.pending.append(msg.sent)
        if self.events is not None:
            t0 = self.env.now
            msg.sent.callbacks.append(
                lambda _ev: self.events.append(("send", t0, self.env.now, dst, nbytes)))
        return msg

    def recv(self, src: int, tag, nbytes: float) -> simpy.Event:
        """The event of the message from rank src with this tag arriving here."""
        s, d = self.sim.sym.to_rep(src, self.r)
        ev = self._box((s, d, tag))
        if self.sim.rendezvous:  # tell src we are ready: a control message on our connection to src
            self.sim.net.submit(self.r, src, 0.0, self.family, self._box((d, s, ("ready", tag))))
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
        s = self.sim.profile.slice_bytes
        if s is None or chunk <= s:
            return [chunk]
        m = math.ceil(chunk / s)
        return [chunk / m] * m

    def exchange(self, sends: list[tuple], recvs: list[tuple]) -> simpy.Event:
        """Post sends [(dst, nbytes, tag)] and receives [(src, tag, nbytes)] all at once, pairwise in
        order (send, then receive); the event of every receive having arrived. Its sends leave one after
        another through the communication thread (message_overhead each).

        A *train*: when the simulation is quiescent (Sim.quiescent), one representative rank stands for
        all (its receives are the images of its own sends), there is no burst credit, and each message
        would be done before the next one enters (its bytes at the rate it gets alone on its path take
        less than message_overhead), then no two of them ever share a link and nothing else can start
        before the last arrives: each message's times are those of a lone flow, computed per kind of
        path by the network's own allocation, and the train costs one event."""
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
        r, to_rep = self.r, sim.sym.to_rep
        if {(r, d, t) for d, _, t in sends} != {(*to_rep(s, r), t) for s, t, _ in recvs}:
            return None
        hop = self.cluster.hop
        lone: dict = {}  # kind of path -> (seconds per byte, latency)
        for dst, _, _ in sends:
            kind = hop(r, dst)
            if kind not in lone:
                lone[kind] = net.lone(r, dst, self.family)
        if any(nb * lone[hop(r, d)][0] >= o * (1 - 1e-9) for d, nb, _ in sends):
            return None
        now = self.env.now
        t = max(now, net._cpu_free.get(r, 0.0))
        last_sent = last_arrival = now
        for dst, nb, _ in sends:
            t += o
            per_byte, latency = lone[hop(r, dst)]
            sent = t + nb * per_byte
            last_sent, last_arrival = max(last_sent, sent), max(last_arrival, sent + latency)
        net._cpu_free[r] = t
        sim.messages += len(sends)
        self.bytes_sent += sum(nb for _, nb, _ in sends)
        self.bytes_received += sum(nb for _, _, nb in recvs)
        self.pending.append(self.env.timeout(last_sent - now))
        return self.env.timeout(last_arrival - now)

    def fast_forward(self, kind, ahead):
        """Called by an algorithm at the end of a *segment* of its program (a step of a ring: the receipt
        of what it waited for), with the segment's `kind` and how many segments of the same kind follow
        (the algorithm vouches that their actions are the same: same sizes, same kinds of peers; a
        callable is asked only when it matters).

        If the whole simulation is quiescent here (Sim.quiescent) and was one segment ago, in the same
        state (burst credit included) after a segment of the same kind, then every segment ahead of that
        kind repeats the last one shifted in time: the model is deterministic and does not depend on the
        absolute time. They are skipped: time advances by their length, this rank's byte counters and the
        message count by theirs. Returns how many were skipped (a generator: `m = yield from ...`)."""
        sim = self.sim
        if not sim.fast:
            return 0
        if not sim.quiescent():
            self._steady = None
            return 0
        net = sim.net
        net._advance()  # burst credit as of now
        state = (kind, tuple((k, v[0]) for k, v in sorted(net.tokens.items())))
        now = (self.env.now, self.bytes_sent, self.bytes_received, sim.messages)
        last, self._steady = self._steady, (state, now)
        if last is None or last[0] != state:
            return 0
        if callable(ahead):
            ahead = ahead()
        if ahead <= 0:
            return 0
        (t0, s0, r0, m0), (t1, s1, r1, m1) = last[1], now
        yield self.env.timeout(ahead * (t1 - t0))
        net.resync()
        self.bytes_sent += ahead * (s1 - s0)
        self.bytes_received += ahead * (r1 - r0)
        sim.messages += ahead * (m1 - m0)
        sim.skipped += ahead
        self._steady = None
        return ahead

    def flush(self):
        """Wait until every message this rank sent has left."""
        waiting = [e for e in self.pending if not e.processed]
        self.pending = []
        if waiting:
            yield self.env.all_of(waiting)
