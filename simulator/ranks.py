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
    def __init__(self, cluster: Cluster, profile: BackendProfile, sym: Symmetry, timeline: bool,
                 rendezvous: bool = False):
        self.env = simpy.Environment()
        self.cluster = cluster
        self.profile = profile
        self.sym = sym
        self.net = Network(self.env, cluster, profile, canonical=sym.canonical if sym.unit < sym.p else None)
        self.mailbox: dict = {}
        self.timeline = timeline
        self.messages = 0
        # rendezvous: a send waits for the receiver's ready notice (profile.rendezvous); every rank simulated
        self.rendezvous = rendezvous


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

    def flush(self):
        """Wait until every message this rank sent has left."""
        waiting = [e for e in self.pending if not e.processed]
        self.pending = []
        if waiting:
            yield self.env.all_of(waiting)
