"""The SimPy internals the simulator relies on, all in this module.

SimPy's public API schedules an event only by triggering it for now (`succeed()`), and it has no way to read
or move the event queue. The simulator needs four things it does not offer:

* `succeed_in(ev, delay)`: trigger an event now, to be processed `delay` from now, as one scheduled event (a
  message's arrival; the public way, a Timeout whose callback succeeds it, is a second event per message);
* `settle(ev)`: mark an event succeeded and processed without scheduling it, while nobody waits on it (a
  message's `sent`; a process that yields it later goes on at once, as SimPy does for processed events);
* `scheduled(env)`: every scheduled (time, priority, id, event) (steady.signature: the state to compare);
* `jump(env, shift)`: move the clock and every scheduled event on by `shift` (steady.skip).

They rely on where SimPy 4.1 keeps that state: `Environment._queue` (a heap of (time, priority, id, event)),
`Environment._now`, `Event._ok` and `Event._value`. SimPy is therefore pinned in pyproject.toml, and
tests/simulator/test_simulator_engine.py fails if the installed SimPy is another version or if these functions stop
behaving as the simulator relies on. research/notebook/SIMULATOR-notes.md (The engine) has the measured cost of the
public ways.
"""

from __future__ import annotations

import simpy
from simpy.events import NORMAL


def succeed_in(ev: simpy.Event, delay: float) -> None:
    """Trigger `ev` (value None) now; it is processed, its callbacks run, `delay` seconds from now."""
    ev._ok, ev._value = True, None
    ev.env.schedule(ev, NORMAL, delay)


def settle(ev: simpy.Event) -> None:
    """`ev` succeeded (value None) and was processed, without an event: only while it has no callbacks."""
    ev._ok, ev._value, ev.callbacks = True, None, None


def scheduled(env: simpy.Environment) -> list:
    """The scheduled events as SimPy holds them: [(time, priority, id, event)], a heap (not sorted)."""
    return env._queue


def jump(env: simpy.Environment, shift: float) -> None:
    """Move the clock and every scheduled event on by `shift` seconds: the running process goes on from the
    new time, and the events keep their order (a uniform shift keeps the heap a heap)."""
    now = env.now
    env._queue[:] = [(t + shift, prio, eid, ev) for t, prio, eid, ev in env._queue]
    env._now = now + shift
