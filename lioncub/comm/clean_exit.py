"""A clean end to every process, whatever ends it: lioncub.finish(), a bare destroy_process_group(), or neither.

Why an end can abort (torch 2.13, Gloo): a Gloo worker thread drops each collective's Work, and with it its
reference to the collective's tensors, a moment *after* the collective returned (about 1 call in 5 still holds
one then). A C++ owner letting go of a tensor that has a Python object decrefs that object, which takes the GIL
on the worker thread. If the interpreter has started finalising by then, CPython ends that thread; the forced
unwind crosses a noexcept destructor and the process aborts ("terminate called without an active exception",
SIGABRT), although all work had finished. torch DDP's buckets have no Python object, so DDP alone never hits it.

So every collective lioncub issues (lioncub.comm.transport.call) notes its tensors (`track`), and before Python
finalises (an atexit handler, and finish()) `settle` first runs what registered to stop (the optimizer's
communication threads: `at_exit`), then waits with the GIL released until Gloo let go of every noted tensor,
and gives Gloo's workers a short GIL-free grace for collectives lioncub did not issue (a metric the script
all-reduced last).
"""

from __future__ import annotations

import atexit
import os
import threading
import time

import torch

_PENDING: list = []  # (tensor, its use count before the collective) that a Work may still hold
_LOCK = threading.Lock()
_STOPPERS: list = []  # run first by settle(), e.g. the optimizer's communication threads
GRACE_S = 0.05


def at_exit(fn) -> None:
    """Run fn() first when the process settles (at exit, and in lioncub.finish())."""
    if fn not in _STOPPERS:
        _STOPPERS.append(fn)


def _tensors_in(objs):
    for o in objs:
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (list, tuple)):
            yield from _tensors_in(o)


def before(objs) -> list:
    """The tensors among a collective's arguments, with their use counts before it runs."""
    return [(t, t._use_count()) for t in _tensors_in(objs)]


def track(counted: list) -> None:
    """After the collective: keep the tensors whose Work still holds them (typically none or one)."""
    with _LOCK:
        _PENDING[:] = [(t, n) for t, n in _PENDING + counted if t._use_count() > n]


def drain(timeout: float = 5.0) -> bool:
    """Wait, with the GIL released, until no Work holds a tracked tensor; whether none does."""
    deadline = time.monotonic() + timeout
    while True:
        with _LOCK:
            _PENDING[:] = [(t, n) for t, n in _PENDING if t._use_count() > n]
            if not _PENDING:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)


def _gloo_workers() -> int:
    """How many Gloo worker threads this process has (Linux; 0 elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            pass
    return count


def settle(timeout: float = 5.0) -> None:
    """Stop what registered to stop, then let Gloo drop every finished Work while Python can still give its
    workers the GIL."""
    for fn in list(_STOPPERS):
        fn()
    drain(timeout)
    if _gloo_workers():
        time.sleep(GRACE_S)


atexit.register(settle)
