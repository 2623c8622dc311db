"""One communication thread: it runs the jobs queued to it one at a time, in the order they were queued, so every
rank issues its collectives in the same order (lioncub.optim.overlap's buckets, lioncub.optim.streaming's
fragments). It starts on the first job and ends, after the jobs already queued, at close()."""

from __future__ import annotations

import queue
import threading

_STOP = object()


class Worker:
    """`run(job)` for every job put, on a daemon thread named `name`. `run` should hold no strong reference to
    the thread's owner, so that an owner that is dropped is collected (and closes the worker)."""

    def __init__(self, run, name: str):
        self._run, self._name = run, name
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._jobs, self._run), name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def close(self, join_timeout: float | None = None) -> None:
        """End the thread once the jobs queued are done; with join_timeout, wait that long for it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(_STOP)
            if join_timeout is not None and thread is not threading.current_thread():
                thread.join(join_timeout)


def _serve(jobs: queue.Queue, run) -> None:
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        run(job)
        del job
