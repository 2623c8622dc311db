"""Steady states: when a simulation repeats itself, shifted in time, skip the repeats.

An algorithm marks the end of each *segment* of its program (a ring step: the receipt of its last slice)
and says which segments ahead are of the same kind (same actions: sizes, peers, reductions). At such a
point `signature` describes everything the future depends on, relative to now: every scheduled event
(messages waiting for their sender's communication thread, messages on their way to the receiver, the
network's completion timer), every flow on the network (its rate, the bytes its head message still has to
send, the messages queued behind it), the mailbox (messages arrived or in flight, with their tags relative
to the current segment), busy communication threads and burst credit. It gives up (None) when anything
else is pending: another process waiting, a reallocation due, an event it does not know.

If the signatures at the ends of the last two segments of one kind equal the current one (to float
round-off), the model, being deterministic and independent of absolute time, will repeat that segment for
every segment of the kind ahead. `skip` then moves the whole state on by m segments at once: the clock and
every scheduled event by m periods, the tags of messages in flight by m segments, the rank's counters by m
times a segment's. The flows keep their progress: what they have left to send is what they had one
period ago.
"""

from __future__ import annotations

import math

from ..net.engine import jump, scheduled

_REL = 1e-9  # floats of two signatures agree within this fraction (of the larger) ...
_ABS = 1e-12  # ... plus this many seconds per second of simulated time (round-off grows with the clock)


class StepTags:
    """Tags (label, step, ...) of a program whose segments are its steps: relative to step k, and moved on
    by m steps."""

    def __init__(self, k: int):
        self.k = k

    def rel(self, tag):
        return (tag[0], tag[1] - self.k, *tag[2:])

    def shift(self, tag, m: int):
        return (tag[0], tag[1] + m, *tag[2:])


class _Same:
    """Tags of a program whose segments have no tags in flight between them (nothing to relate)."""

    @staticmethod
    def rel(tag):
        return tag

    @staticmethod
    def shift(tag, m):
        return tag


def signature(sim, tags=None):
    """(structure, floats) of the simulation's state relative to now, or None if it cannot be told."""
    env, net = sim.env, sim.net
    if net.reallocation_due:
        return None
    tags = tags or _Same
    rel = tags.rel
    now = env.now
    net.advance()
    items = []
    for t, _prio, _eid, ev in scheduled(env):
        d = getattr(ev, "ff", None)
        if d is None:
            return None
        if d[0] == "timer":
            if net.current_timer(d[1]):
                items.append((("timer",), (t - now,)))
            continue  # a stale timer does nothing
        if d[0] == "deliver":  # ["deliver", connection, size, tag]
            if d[3] is None or ev.callbacks:
                return None  # a process waits on it: one whose program we cannot see
            items.append((("deliver", d[1], d[2], rel(d[3])), (t - now,)))
            continue
        msg = d[1]
        if msg.tag is None or msg.sent.callbacks or msg.delivered.callbacks:
            return None
        items.append((("enter", msg.conn.key, msg.size, rel(msg.tag)), (t - now,)))
    for c in net.active:
        for target, _seq, conn in c.heap:
            if any(m.tag is None or m.sent.callbacks or m.delivered.callbacks for m in conn.queue):
                return None
            queue = tuple((m.size, rel(m.tag)) for m in conn.queue)
            items.append((("flow", conn.key, queue), (target - c.served, c.rate)))
    for (src, dst, tag), ev in sim.mailbox.items():
        if ev.callbacks:  # someone waits on it: a process whose program we cannot see
            return None
        items.append((("box", src, dst, rel(tag), ev.triggered), ()))
    for r, t in net.thread_free.items():
        if t > now:
            items.append((("cpu", r), (t - now,)))
    for link, tb in net.tokens.items():
        items.append((("credit", link), (tb[0],)))
    items.sort(key=lambda it: repr(it[0]))
    return tuple(s for s, _ in items), tuple(f for _, fs in items for f in fs)


def same(a, b, now: float) -> bool:
    if a is None or b is None or a[0] != b[0]:
        return False
    tol = _ABS * (1.0 + now)
    return all(math.isclose(x, y, rel_tol=_REL, abs_tol=tol) for x, y in zip(a[1], b[1]))


def skip(sim, m: int, period: float, tags=None) -> None:
    """Move the whole simulation on by m segments of `period` seconds each (see the module docstring)."""
    env, net = sim.env, sim.net
    tags = tags or _Same
    shift = m * period
    now = env.now
    moved = set()

    def move(msg):
        if id(msg) not in moved:
            moved.add(id(msg))
            msg.tag = tags.shift(msg.tag, m)

    for _t, _prio, _eid, ev in scheduled(env):
        d = getattr(ev, "ff", None)
        if d is not None and d[0] == "enter":
            move(d[1])
        elif d is not None and d[0] == "deliver":
            d[3] = tags.shift(d[3], m)
    jump(env, shift)
    for c in net.active:
        for _target, _seq, conn in c.heap:
            for msg in conn.queue:
                move(msg)
    sim.mailbox = {(s, d, tags.shift(t, m)): ev for (s, d, t), ev in sim.mailbox.items()}
    net.jump(now, shift)
