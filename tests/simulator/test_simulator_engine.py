"""The SimPy internals the simulator relies on (simulator/net/engine.py): the installed SimPy is the version
pyproject.toml pins, and each function does what the simulator relies on, observed through SimPy's public
API (now, peek, triggered, processed, ok, value, processes resuming)."""

import math
import re

import simpy
from lioncub.simulator.net import engine
from repo import REPO

PYPROJECT = REPO / "pyproject.toml"


def test_the_installed_simpy_is_the_pinned_one():
    pins = re.findall(r'"simpy==([^"]+)"', PYPROJECT.read_text())
    assert len(pins) == 1, "pyproject.toml must pin simpy exactly (engine.py relies on its internals)"
    assert simpy.__version__ == pins[0], (f"SimPy {simpy.__version__} is installed, pyproject.toml pins {pins[0]}: "
                                          "check simulator/net/engine.py against it, then move the pin")


def _resumes(env, ev, log, name):
    yield ev
    log.append((name, env.now, ev.value))


def test_succeed_in_is_one_event_processed_after_the_delay():
    env = simpy.Environment()
    ev = env.event()
    log, seen = [], []
    env.process(_resumes(env, ev, log, "waiter"))
    ev.callbacks.append(lambda e: log.append(("callback", env.now, e.value)))

    def trigger():
        yield env.timeout(1.5)
        engine.succeed_in(ev, 2.5)
        seen.append((ev.triggered, ev.ok, ev.value, ev.processed, env.peek()))

    env.process(trigger())
    env.run()
    assert seen == [(True, True, None, False, 4.0)]  # triggered now, the only event scheduled: at 1.5 + 2.5
    assert ev.processed
    # callbacks in the order they were added: this one before the process began waiting
    assert log == [("callback", 4.0, None), ("waiter", 4.0, None)]


def test_succeed_in_orders_like_a_timeout_of_the_same_delay():
    env = simpy.Environment()
    log = []
    first = env.event()
    first.callbacks.append(lambda _e: log.append("first"))
    engine.succeed_in(first, 1.0)
    env.timeout(1.0).callbacks.append(lambda _e: log.append("timeout"))
    env.run()
    assert log == ["first", "timeout"]


def test_settle_marks_an_event_processed_without_scheduling_it():
    env = simpy.Environment()
    ev = env.event()
    engine.settle(ev)
    assert ev.triggered and ev.processed and ev.ok and ev.value is None
    assert env.peek() == math.inf  # nothing scheduled
    log = []

    def late():
        yield env.timeout(3.0)
        yield ev  # already processed: goes on at once
        log.append(("yield", env.now))
        yield env.all_of([ev])
        log.append(("all_of", env.now))

    env.process(late())
    env.run()
    assert log == [("yield", 3.0), ("all_of", 3.0)]


def test_scheduled_lists_every_scheduled_event_with_its_time():
    env = simpy.Environment()
    a, b = env.timeout(2.0), env.timeout(0.5)
    c = env.event()
    engine.succeed_in(c, 1.0)
    got = sorted((t, ev) for t, _prio, _eid, ev in engine.scheduled(env))
    assert got == [(0.5, b), (1.0, c), (2.0, a)]
    env.run()
    assert list(engine.scheduled(env)) == []


def test_jump_moves_the_clock_and_every_scheduled_event():
    env = simpy.Environment()
    log = []

    def proc():
        yield env.timeout(1.0)
        log.append(("proc", env.now))
        engine.jump(env, 10.0)  # from inside a running process, as steady.skip does
        log.append(("jumped", env.now))
        yield env.timeout(0.5)
        log.append(("proc", env.now))

    for d in (2.0, 3.0):
        env.timeout(d).callbacks.append(lambda _e, d=d: log.append((f"timeout {d}", env.now)))
    env.process(proc())
    env.run()
    assert log == [("proc", 1.0), ("jumped", 11.0), ("proc", 11.5), ("timeout 2.0", 12.0), ("timeout 3.0", 13.0)]
    assert env.now == 13.0
