"""Streamed outer steps (LionCub(local_steps=H, fragments=F, outer_delay=D)): the model in F fragments whose outer
exchanges are staggered over the H inner steps and run on a communication thread while the next inner steps
compute (as in Streaming DiLoCo, arXiv 2501.18512).

    fragments   the engine's buckets (in backward order) cut into F runs of about equal size, the same on every
                rank (they have the same buckets)
    launch      at every step t with t % H == offset_f = ((f + 1) H // F) % H, after the inner step: fragment
                f's pseudo-gradients (anchor - p, + residual) are taken and its exchange is queued on the thread
    apply       at step t + D, after that step's inner step: step() waits for the exchange (the exposed time),
                the outer optimizer moves the fragment's anchor and its parameters restart from it

F = 1 with D = 0 is the unstreamed outer step at every H-th step, bit for bit. With D >= 1 the inner steps a
fragment takes between its launch and its application are discarded at the application (Streaming DiLoCo's
alpha = 1): every rank restarts the fragment from the same anchor, so right after each application its
parameters are bit-identical on every rank. D < H / F: a fragment is applied before the next one launches
(or in the same step, first).

One thread takes the exchanges in launch order (FIFO), and every rank launches the same fragments at the same
steps, so the collectives' order is the same on every rank. They run on a process group of their own (when the
optimizer's group is the whole world; made with the optimizer, since making it waits for every rank), so
collectives the training loop issues meanwhile cannot interleave with them.

In the node layout (hierarchical=True) the thread runs, for a fragment's buckets, what the unstreamed outer
step runs for all of them (lioncub.optim.local): local rank 0 of each node takes the pseudo-gradients (the
others hold no residual: their node's are its leader's), votes across the nodes and broadcasts whether they
voted and the agreed G inside its node. Its collectives run on copies of the cross group and of the node's
group, since every inner step all-reduces the node's mean gradient on the node's own group meanwhile. That
runs on Gloo only: NCCL does not allow two communicators of one device in use at once in orders that differ
between ranks, so on NCCL it is refused (one line).

The non-finite rule: a fragment whose pseudo-gradient is not finite on some rank skips its outer step on every
rank (its parameters restart from the unchanged anchor). state_dict() waits for the exchanges in flight and
holds their agreed updates, applied at their own step after a resume: the resumed run is the uninterrupted one,
bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref

import torch
import torch.distributed as dist

from lioncub.comm import settle, stagger
from lioncub.optim import nodes
from lioncub.optim.worker import Worker

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Streaming with a thread, for shutdown()


def shutdown(timeout: float = 60.0) -> None:
    """End every streaming thread (at exit, like lioncub.optim.overlap's): each first finishes the exchanges
    queued (every rank launched them, so they complete; a slow link may need the time), then stops."""
    for s in list(_LIVE):
        s.close(join_timeout=timeout)


settle.at_exit(shutdown)


class _Job:
    """One fragment's exchange: launched at `step`, applied at `due`; G and the collectives once done."""

    def __init__(self, fragment: int, step: int, due: int, event=None):
        self.fragment, self.step, self.due, self.event = fragment, step, due, event
        self.done = threading.Event()
        self.G = self.collectives = self.error = None
        self.comm_s = 0.0


class Streaming:
    """The fragments, their schedule and the communication thread of one LocalSteps (lioncub.optim.local)."""

    def __init__(self, local, F: int, D: int):
        self._cuda = local.engine.buckets.is_cuda  # (the worker first: __del__ closes it if the rest raises)
        self._stream = torch.cuda.Stream(device=local.engine.buckets.device) if self._cuda else None
        self._worker = Worker(functools.partial(_run, stream=self._stream), "lioncub-stream")
        self.local, self.F, self.D = local, F, D
        # Made here, not at the first launch: new_group waits for the slowest rank, and inside a step that wait
        # (a lab's start-up skew: seconds) was counted neither as compute nor as the exchanges' exposed time.
        if local.nodes is None:
            local.exchange.group, self.intra = _own_group(local.engine), None
        else:  # (built by every rank, every group in the same order: as the layout built its own)
            _check_backend(local.engine.group)
            own = nodes.Nodes(local.engine.group, local.nodes.size)
            local.exchange.group, self.intra = own.cross, own.intra
        self.fragments = stagger.split([b.n for b in local.engine.buckets], F)
        self.offsets = stagger.offsets(local.H, F)
        self.pending: list[_Job] = []  # launched, not yet applied, in launch order
        self.launches: list[tuple[int, int]] = []  # (step, fragment) in the order the thread ran them
        self.exposed_s, self.exchanges = 0.0, 0

    def step(self, t: int) -> tuple[list, float, float]:
        """After inner step t: launch the fragments due at t, then apply those due at t; (collectives, the
        exchanges' communication seconds, the seconds step() waited for them)."""
        for f, o in enumerate(self.offsets):
            if t % self.local.H == o:
                self._launch(f, t)
        collectives, comm, waited = [], 0.0, 0.0
        while self.pending and self.pending[0].due <= t:
            job = self.pending.pop(0)
            waited += self._wait(job)
            self.exchanges += 1
            self.local.apply_outer(self.fragments[job.fragment], job.G, job.step)
            collectives += job.collectives or []
            comm += job.comm_s
        self.exposed_s += waited
        return collectives, comm, waited

    def _launch(self, f: int, t: int) -> None:
        ex = self.local.exchange
        if not self._worker.started:
            _LIVE.add(self)
        ks = self.fragments[f]
        if self.intra is None or self.local.nodes.local == 0:  # (a node's other ranks take none: see above)
            ex.pseudo_gradients(self.local.anchor, ks)
        run = (functools.partial(ex.agree_taken, ks, t) if self.intra is None
               else functools.partial(self.local.node_agree, ks, t, self.intra))
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        job = _Job(f, t, t + self.D, event)
        self.pending.append(job)
        self._worker.put((job, run, self.launches))

    def _wait(self, job: _Job) -> float:
        t0 = time.perf_counter()
        while not job.done.wait(1.0):
            if not self._worker.alive():
                raise RuntimeError(f"LionCub: the streaming thread ended before fragment {job.fragment}'s outer "
                                   f"exchange of step {job.step} finished")
        if self._cuda and job.event is not None:  # (a restored job has no event and no stream work)
            torch.cuda.current_stream().wait_stream(self._stream)
        if job.error is not None:
            raise RuntimeError(f"LionCub: fragment {job.fragment}'s streamed outer exchange of step {job.step} "
                               f"failed: {job.error!r}") from job.error
        return time.perf_counter() - t0

    def state_dict(self) -> dict:
        """Waits for the exchanges in flight (the checkpoint holds their agreed updates)."""
        for job in self.pending:
            self.exposed_s += self._wait(job)
        pend = [dict(fragment=j.fragment, step=j.step, due=j.due,
                     G=None if j.G is None else [j.G[k].clone() for k in self.fragments[j.fragment]])
                for j in self.pending]
        return dict(fragments=self.F, outer_delay=self.D, pending=pend)

    def load_state_dict(self, sd: dict) -> None:
        if sd is None or sd.get("fragments") != self.F or sd.get("outer_delay") != self.D:
            raise ValueError(f"this checkpoint ran fragments={sd and sd.get('fragments')} outer_delay="
                             f"{sd and sd.get('outer_delay')}; this optimizer has fragments={self.F} outer_delay="
                             f"{self.D}: resume with the same options")
        for job in self.pending:  # this optimizer's own exchanges in flight would write into the loaded residuals
            job.done.wait()
        self.pending = []
        for p in sd["pending"]:
            job = _Job(p["fragment"], p["step"], p["due"])
            if p["G"] is not None:
                job.G = dict(zip(self.fragments[job.fragment], (g.clone() for g in p["G"])))
            job.done.set()
            self.pending.append(job)

    def close(self, join_timeout: float | None = None) -> None:
        self._worker.close(join_timeout)

    def __del__(self):
        self.close()


def _check_backend(group) -> None:
    """The node layout streams on Gloo only: on NCCL the thread's node broadcasts would run beside the inner
    steps' node all-reduce on another communicator of the same devices, in an order that differs between ranks,
    which NCCL documents as unsafe (it can hang)."""
    if dist.is_initialized() and dist.get_backend(group) != "gloo":
        raise ValueError(f"fragments with hierarchical=True runs on Gloo only (this group's backend is "
                         f"{dist.get_backend(group)}: NCCL does not allow collectives on two communicators of one "
                         "device at once in different orders); use the flat layout's fragments or no fragments")


def _own_group(engine):
    """A process group for the streamed exchanges alone: a copy of the optimizer's when that is the whole world
    (every rank makes it as it makes the optimizer); otherwise the optimizer's own."""
    if engine.world_size == 1 or not dist.is_initialized() or engine.world_size != dist.get_world_size():
        return engine.group
    return dist.new_group(ranks=dist.get_process_group_ranks(engine.group))


def _run(item, stream) -> None:
    """The communication thread's job: one fragment's exchange; an error is kept on its job, for step() to raise."""
    job, run, launches = item
    launches.append((job.step, job.fragment))
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if job.event is not None:
                stream.wait_event(job.event)
            job.G, job.collectives = run()
    except BaseException as exc:
        job.error = exc
    job.comm_s = time.perf_counter() - t0
    job.done.set()
