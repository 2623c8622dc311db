"""Flow-level network: connections share full-duplex links by weighted max-min fairness.

There are no packets. A *connection* is a byte stream from one rank to another (a set of TCP sockets);
messages sent on it are delivered in order, so only its head message is being transmitted. Whenever a
connection starts or stops having data to send, the rates of all active connections are recomputed by
progressive filling (max-min fairness, each connection weighted by its number of sockets and capped by
window/RTT), and the next message completion is scheduled. Between those instants every connection
moves at a constant rate, so the cost of a simulation grows with the number of messages, not bytes.

A message of m bytes handed to the network at t0 leaves the sender when its last byte has been
transmitted, and is delivered `latency` later: with an idle path that is t0 + m/rate + latency, the
alpha-beta model. Per-message software overhead (LogP's o) is paid by the sender before the message
enters its connection, one message after another on each rank (so p-1 messages posted at once cost
(p-1)*o of sender time). Sends are eager: a message is transmitted whether or not its receive has been
posted yet (no rendezvous).

Batching: connections that cross the same links with the same weight and cap form a *class*; max-min
fairness gives them the same rate, so rates are computed per class, and each class keeps a "served"
counter (bytes per connection so far) with a heap of the counter values at which its connections'
head messages complete. An event then costs O(classes + log connections), not O(connections): an
all-to-all among 1024 ranks is a handful of classes.

Burst credit (profile.link_burst > 0): every NIC port is a token bucket of link_burst seconds of line
time, full at the start. Tokens drain at (load - capacity) while the port carries more than its line
rate and refill at (capacity - load) otherwise, up to the bucket. While a port holds tokens it does not
limit its flows (its capacity counts as BURST_SPEEDUP times the line rate, i.e. memory speed; a
host_bandwidth link still applies); when it runs dry the rates are recomputed with the line rate.
This is Linux tbf (the lab's shaper): after an idle period its first `burst` bytes leave at once.

Symmetry: the caller may simulate only representative ranks of a symmetric computation. It then passes
`canonical`, a map from a link to its representative under the symmetry group. Each representative
connection stands for its whole orbit, which crosses every link of a link orbit equally often, so
counting a representative connection once on the canonical link of each link it crosses gives exactly
the per-link load of the full system (see collectives.Symmetry). A cluster whose NIC and leaf links are
shared with identical flows of other groups (groups.CrossGroup: the G cross groups of the hierarchical
layout, all through one NIC) says how many flows each simulated one stands for there (`nic_share`): the
connection's cost on those links is multiplied by it, as that many flows at one rate load them.
"""

from __future__ import annotations

import heapq
from collections import deque
from math import inf
from typing import TYPE_CHECKING

import simpy

from .cluster import Cluster
from .engine import settle, succeed_in

if TYPE_CHECKING:
    from ..profiles import BackendProfile

NIC_LINKS = ("up", "down", "leaf-up", "leaf-down")
PORTS = ("up", "down")  # a node's NIC port, each direction: where link_burst acts
BURST_SPEEDUP = 1000.0  # a port's capacity while it holds burst tokens, in line rates (memory speed)


class Message:
    __slots__ = ("size", "latency", "sent", "delivered", "conn", "tag")

    def __init__(self, env, size, latency, delivered):
        self.size = size
        self.latency = latency
        self.sent = env.event()  # last byte has left the sender
        self.delivered = delivered  # last byte has arrived at the receiver
        self.conn = None
        self.tag = None  # the sender's tag (steady.py relates it to the program's segments)


class FlowClass:
    """Connections with the same links (with costs), weight and cap: they always share one rate."""

    __slots__ = ("links", "weight", "cap", "count", "rate", "served", "heap")

    def __init__(self, links, weight, cap):
        self.links = links  # [(canonical link, capacity units per payload byte)]
        self.weight = weight
        self.cap = cap  # max payload bytes/s per connection (window limit), inf if none
        self.count = 0  # active connections
        self.rate = 0.0  # payload bytes/s of each active connection
        self.served = 0.0  # bytes each active connection has sent since the class was created
        self.heap: list = []  # (served value at which the head message is done, seq, connection)


class Connection:
    __slots__ = ("key", "cls", "queue", "active", "latency")

    def __init__(self, key, cls, latency):
        self.key = key
        self.cls = cls
        self.queue: deque[Message] = deque()
        self.active = False
        self.latency = latency


class Network:
    """The links of a `Cluster` as seen by one backend profile.

    submit(src, dst, nbytes, family, delivered) -> Message; `delivered` is the event to trigger on arrival
    (created by the caller so that a receiver can wait on it before the send is issued).
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, profile: BackendProfile, canonical=None,
                 rendezvous: bool = False):
        self.env = env
        self.rendezvous = rendezvous
        self.cluster = cluster
        self.profile = profile
        self.canonical = canonical or (lambda link: link)
        self.capacity: dict = {}
        self.conns: dict = {}
        self.classes: dict = {}
        self.active: list[FlowClass] = []  # classes with active connections
        self.thread_free: dict = {}  # rank -> time its communication thread is free (ranks.py reads and books it)
        # burst credit: canonical port -> [tokens, bucket] in bytes of capacity; ports in burst now;
        # capacity used per port at the current rates
        self.tokens: dict = {}
        self._bursting: set = set()
        self._usage: dict = {}
        self._last = 0.0
        self._dirty = False
        self._gen = 0
        self._seq = 0
        self.reallocations = 0
        self._lone: dict = {}

    # ---- public -------------------------------------------------------------------------------------
    def submit(self, src: int, dst: int, nbytes: float, family: str, delivered: simpy.Event,
               at: float | None = None) -> Message:
        """Hand a message to src's communication thread now (or at time `at`, for replaying a rank's sends
        whose times are known)."""
        conn = self.conns.get((src, dst, family))
        if conn is None:
            conn = self._connect(src, dst, family)
        msg = Message(self.env, float(nbytes), conn.latency, delivered)
        msg.conn = conn
        o = self.profile.message_overhead
        now = self.env.now
        t = now if at is None else max(at, now)
        if o > 0:
            # the sender's communication thread spends o per message, one message after another (LogGP)
            ready = max(t, self.thread_free.get(src, 0.0)) + o
            self.thread_free[src] = ready
            ev = self.env.timeout(ready - now)
            ev.callbacks.append(lambda _ev, m=msg: self._enqueue(m))
            ev.ff = ("enter", msg)  # what steady.signature sees of it
        elif t > now:
            ev = self.env.timeout(t - now)
            ev.callbacks.append(lambda _ev, m=msg: self._enqueue(m))
            ev.ff = ("enter", msg)
        else:
            self._enqueue(msg)
        return msg

    def lone(self, src: int, dst: int, family: str) -> tuple[float, float]:
        """(seconds per payload byte, latency) of a connection src -> dst alone on the network, by the same
        allocation as always (no burst credit)."""
        key = (src, dst, family)
        got = self._lone.get(key)
        if got is None:
            conn = self.conns.get(key) or self._connect(src, dst, family)
            cls = conn.cls
            probe = FlowClass(cls.links, cls.weight, cls.cap)
            probe.count = 1
            allocate([probe], self.capacity)
            got = self._lone[key] = (1.0 / probe.rate, conn.latency)
        return got

    def resync(self) -> None:
        """The caller fast-forwarded an idle network through repeating segments (Rank.fast_forward): its
        state (burst credit) is what it was; do not count the skipped time as idle time."""
        self._last = self.env.now

    def jump(self, now: float, shift: float) -> None:
        """The whole simulation moves on by `shift` seconds at `now` (steady.skip): busy communication
        threads move with it; flows keep their progress and burst credit is what it was."""
        free = self.thread_free
        for r, t in list(free.items()):
            if t > now:
                free[r] = t + shift
        self._last += shift

    @property
    def reallocation_due(self) -> bool:
        """Rates are to be recomputed at this instant (a change is waiting to be coalesced)."""
        return self._dirty

    @property
    def idle(self) -> bool:
        """No flow has data and no reallocation is due."""
        return not self.active and not self._dirty

    def current_timer(self, gen: int) -> bool:
        """Whether the completion timer scheduled as generation `gen` (its event's `ff`) is still the one
        that counts (a reallocation since makes it stale: it will do nothing)."""
        return gen == self._gen

    def threads_idle(self, now: float) -> bool:
        """Every rank's communication thread is free at `now`."""
        return all(t <= now for t in self.thread_free.values())

    # ---- connections --------------------------------------------------------------------------------
    def _connect(self, src, dst, family) -> Connection:
        prof, cl = self.profile, self.cluster
        links, latency = cl.path(src, dst)
        eff = prof.family_efficiency(family)
        if prof.host_bandwidth is not None:
            links = [("host-tx", src)] + links + [("host-rx", dst)]
        counted: dict = {}
        for link in links:
            cost = 1.0 / (eff * (prof.wire_efficiency if link[0] in NIC_LINKS else 1.0))
            if link[0] in NIC_LINKS:
                cost *= cl.nic_share
            canon = self.canonical(link)
            counted[canon] = counted.get(canon, 0.0) + cost
            if canon not in self.capacity:
                if link[0] in ("host-tx", "host-rx"):
                    self.capacity[canon] = prof.host_bandwidth
                else:
                    self.capacity[canon] = cl.link_capacity(link)
                    if prof.link_burst > 0 and link[0] in PORTS:
                        bucket = prof.link_burst * self.capacity[canon]
                        # the port has idled before the call: a full bucket
                        self.tokens[canon] = [bucket, bucket]
        cap = inf
        if prof.window_bytes is not None and latency > 0:
            cap = prof.channels * prof.window_bytes / (2.0 * latency)
        sig = (tuple(sorted(counted.items())), float(prof.channels), cap)
        cls = self.classes.get(sig)
        if cls is None:
            cls = self.classes[sig] = FlowClass(list(sig[0]), sig[1], cap)
        conn = Connection((src, dst, family), cls, latency)
        self.conns[conn.key] = conn
        return conn

    def _push(self, conn: Connection, target: float) -> None:
        self._seq += 1
        heapq.heappush(conn.cls.heap, (target, self._seq, conn))

    def _enqueue(self, msg: Message) -> None:
        conn = msg.conn
        conn.queue.append(msg)
        if not conn.active:
            self.advance()
            conn.active = True
            cls = conn.cls
            if cls.count == 0:
                self.active.append(cls)
            cls.count += 1
            self._push(conn, cls.served + msg.size)
            if len(self.active) == 1 and cls.count == 1 and not self._dirty:
                # the network was idle: nothing to coalesce with yet (another change at this instant
                # marks it dirty and reallocates again)
                self._reallocate()
            else:
                self._mark_dirty()

    # ---- rates --------------------------------------------------------------------------------------
    def advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0:
            for c in self.active:
                c.served += c.rate * dt
            if self.tokens:
                usage, cap = self._usage, self.capacity
                for link, tb in self.tokens.items():
                    tb[0] = min(tb[1], max(0.0, tb[0] + (cap[link] - usage.get(link, 0.0)) * dt))
        self._last = now

    def _token_floor(self, link) -> float:
        """Tokens below this count as none (a thousandth of the bucket: no switching back and forth on
        crumbs)."""
        return 1e-3 * self.tokens[link][1]

    def _has_tokens(self, link) -> bool:
        tokens, bucket = self.tokens[link]
        return tokens > self._token_floor(link) + 1e-9 * bucket

    def _effective_capacity(self) -> dict:
        """Capacities for the next allocation: ports holding burst tokens do not limit their flows."""
        self._bursting = {link for link in self.tokens if self._has_tokens(link)}
        if not self._bursting:
            return self.capacity
        cap = dict(self.capacity)
        for link in self._bursting:
            cap[link] = BURST_SPEEDUP * self.capacity[link]
        return cap

    def _measure_usage(self) -> None:
        usage: dict = {}
        for c in self.active:
            for link, cost in c.links:
                if link in self.tokens:
                    usage[link] = usage.get(link, 0.0) + c.rate * c.count * cost
        self._usage = usage

    def _token_dt(self) -> float:
        """Time until a port in burst runs dry at the current rates."""
        dt = inf
        for link in self._bursting:
            drain = self._usage.get(link, 0.0) - self.capacity[link]
            if drain > 0:
                dt = min(dt, max(0.0, self.tokens[link][0] - self._token_floor(link)) / drain)
        return dt

    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._gen += 1  # pending completion timer is stale
            self.env.timeout(0).callbacks.append(self._reallocate)

    def _reallocate(self, _ev=None) -> None:
        self._dirty = False
        self.advance()
        self.reallocations += 1
        if not self.active:
            self._usage = {}
            self._gen += 1
            return
        if self.tokens:
            allocate(self.active, self._effective_capacity())
            self._measure_usage()
        else:
            allocate(self.active, self.capacity)
        self._schedule()

    def _schedule(self) -> None:
        self._gen += 1
        if not self.active:
            return
        dt = inf
        for c in self.active:
            d = (c.heap[0][0] - c.served) / c.rate
            if d < dt:
                dt = d
        if self._bursting:
            dt = min(dt, self._token_dt())
        gen = self._gen
        ev = self.env.timeout(max(dt, 0.0))
        ev.callbacks.append(lambda _ev: self._on_timer(gen))
        ev.ff = ("timer", gen)

    def _on_timer(self, gen: int) -> None:
        if gen != self._gen:
            return
        self.advance()
        # a port that ran out of burst goes back to its line rate: recompute the rates. Within a
        # nanosecond of running dry counts as dry (float round-off must not re-arm a zero-length timer).
        stopped = False
        for link in self._bursting:
            drain = self._usage.get(link, 0.0) - self.capacity[link]
            tb = self.tokens[link]
            if not self._has_tokens(link) or (drain > 0 and tb[0] - self._token_floor(link) <= drain * 1e-9):
                tb[0] = min(tb[0], self._token_floor(link))
                stopped = True
        for c in self.active:
            # a head message is done when what is left would take < 1 ps (float round-off)
            heap = c.heap
            left = heap[0][0] - c.served if heap else inf
            if left > 1e-6 and left > c.rate * 1e-12 and left > abs(c.served) * 1e-13:
                continue
            tol = max(1e-6, c.rate * 1e-12, abs(c.served) * 1e-13)
            while heap and heap[0][0] - c.served <= tol:
                target, _, conn = heapq.heappop(heap)
                msg = conn.queue.popleft()
                self._sent(msg.sent)
                self._deliver(msg)
                if conn.queue:  # the next message starts where this one ended
                    self._push(conn, target + conn.queue[0].size)
                else:
                    conn.active = False
                    c.count -= 1
                    stopped = True
        if stopped:
            self.active = [c for c in self.active if c.count > 0]
            if self._dirty:  # a reallocation is already due at this instant
                self._gen += 1
            else:
                self._reallocate()
        else:
            self._schedule()

    def _sent(self, ev: simpy.Event) -> None:
        """A message's last byte has left. Nobody waiting on it yet (a rank's pending sends, checked at its
        flush): mark it processed at once instead of scheduling it (same effect, one event less)."""
        if ev.callbacks:
            ev.succeed()
        else:
            settle(ev)

    def _deliver(self, msg: Message) -> None:
        """Its last byte arrives `latency` after it left: schedule the receiver's event for then (one event;
        with rendezvous it is triggered only on arrival, since senders test whether a notice has come)."""
        d = msg.delivered
        d.ff = ["deliver", msg.conn.key, msg.size, msg.tag]  # not msg itself: msg -> d -> msg would be a cycle
        if msg.latency <= 0:
            d.succeed()
        elif self.rendezvous:
            self.env.timeout(msg.latency).callbacks.append(lambda _ev: d.succeed())
        else:
            succeed_in(d, msg.latency)


def allocate(classes: list[FlowClass], capacity: dict) -> None:
    """Weighted max-min fair rates by progressive filling, per class of identical connections.

    Every unfrozen connection gets rate weight * level; the level rises until a link is full (sum of
    rate * cost over its connections = capacity) or a connection reaches its cap; those connections are
    frozen at that rate and the rest keep rising.
    """
    if len(classes) == 1:
        _allocate_alone(classes[0], capacity)
        return
    rem, load = _loads(classes, capacity)
    unfrozen = list(classes)
    while unfrozen:
        level = _next_level(unfrozen, rem, load)
        unfrozen = _freeze(unfrozen, level, rem, load)


def _allocate_alone(c: FlowClass, capacity: dict) -> None:
    """One class: the same arithmetic as progressive filling, in one round."""
    w = c.weight * c.count
    level = min(capacity[link] / (w * cost) for link, cost in c.links)
    level = max(min(level, c.cap / c.weight), 0.0)
    if c.cap / c.weight <= level * (1 + 1e-9):
        c.rate = min(c.cap, c.weight * level)
    else:
        c.rate = c.weight * level


def _loads(classes: list[FlowClass], capacity: dict) -> tuple[dict, dict]:
    """Per link crossed: (capacity not yet given out, weight of the connections crossing it, by cost)."""
    rem: dict = {}
    load: dict = {}
    for c in classes:
        w = c.weight * c.count
        for link, cost in c.links:
            if link in load:
                load[link] += w * cost
            else:
                load[link] = w * cost
                rem[link] = capacity[link]
    return rem, load


def _next_level(unfrozen: list[FlowClass], rem: dict, load: dict) -> float:
    """The level at which the next link fills up or the next connection reaches its cap."""
    level = inf
    for link, ld in load.items():
        v = rem[link] / ld
        if v < level:
            level = v
    for c in unfrozen:
        v = c.cap / c.weight
        if v < level:
            level = v
    if level == inf:  # cannot happen: every connection crosses a link
        raise RuntimeError("unbounded flow")
    return max(level, 0.0)


def _freeze(unfrozen: list[FlowClass], level: float, rem: dict, load: dict) -> list[FlowClass]:
    """Freeze the classes at their cap or on a link full at `level`, take their share off their links;
    the classes still rising."""
    thresh = level * (1 + 1e-9)
    full = {link for link, ld in load.items() if rem[link] / ld <= thresh}
    keep = []
    for c in unfrozen:
        if c.cap / c.weight <= thresh:
            c.rate = min(c.cap, c.weight * level)
        elif any(link in full for link, _ in c.links):
            c.rate = c.weight * level
        else:
            keep.append(c)
            continue
        for link, cost in c.links:
            if link in load:
                rem[link] -= c.rate * c.count * cost
                load[link] -= c.weight * c.count * cost
    for link in full:
        load.pop(link, None)
    for link in [k for k, v in load.items() if v <= 1e-12]:
        del load[link]
    return keep
