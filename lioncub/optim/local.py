"""Local steps (LionCub(local=LocalSteps(H, outer=...))): each rank takes H plain Lion steps on its own gradients and
momentum, with no communication; at every H-th step the ranks agree on an outer update from their pseudo-
gradients through the method's codec, with error feedback (the outer step, below), and every replica restarts from
the same new anchor.

    step t (every rank)   collect the gradients; if they are all finite, a local Lion step (parameters without
                          a gradient on this rank untouched), else this rank skips the step alone (no message)
    t % H == 0            the outer step: pseudo-gradients, the agreed G, the outer optimizer moves the anchor,
                          every rank copies it into its parameters (bit-identical replicas); the inner momenta
                          stay each rank's own (as in DiLoCo)

The non-finite rule: a non-finite gradient makes its rank skip that inner step alone (`local_skips`; the
others' steps are theirs anyway, and agreeing would cost a message per step, which local steps exist to
avoid). Since inner steps only ever apply finite updates, the pseudo-gradients are finite; if one is not
(parameters changed from outside), every rank skips the outer step and restarts from the unchanged anchor
(`outer_skips`), its residual and outer momentum as they were.

In the node layout (node_size=G) each node is one replica: its G ranks step together on the node's mean
gradient (an fp32 all-reduce inside the node), and local rank 0 of every node votes for it across the nodes and
broadcasts the agreed G inside its node (the outer exchange on the leaders' cross group).

With fragments (streamed outer steps, below) the outer steps of the model's fragments are staggered over the H
steps and overlap the next inner steps on a communication thread, in either layout.

The anchor is the parameters at the first step (after broadcast_parameters), then each outer step's result.
state_dict() holds the anchor, the residuals, the outer momentum and the counters, so a resume anywhere in
the interval reproduces the uninterrupted run bit for bit.

The outer step: the ranks agree on one update from their pseudo-
gradients, through the registered method's codec, with error feedback; then the outer optimizer moves the
anchor that every replica restarts from.

Per bucket, on rank i (fp32, whatever the parameters' dtype):

    delta_i = anchor - p_i                      the pseudo-gradient (the parameters' change since the anchor)
    e_i     = delta_i + r_i                     with the residual r_i that compression dropped last time
    a_i,t   = mean |e_i| over tensor t          this rank's scale of each parameter tensor
    s_t     = (1/N) sum_i a_i,t                 the agreed scale (an all-gather of the scales, summed in rank
                                                order on every rank: the same bits everywhere)
    code    = the method's codec of e_i (beta1 = 0, so the codec's c is e_i; no momentum update)
    G       = s_t * U                           U: the agreed update the codec decodes (a vote's sign, avg-pbit's
                                                mean sign, l1-pbit's sign of the summed levels)
    r_i    <- e_i - C_i(e_i)                    C_i: what rank i's own message stands for: a_i,t * sign(e_i) for
                                                the sign codecs, q * 2 a_i,t / s (q its L1 levels) for l1-pbit

The dense method (the baseline, DiLoCo's outer all-reduce) averages delta_i in fp32: G = mean_i delta_i, no
residual. One rank: G = delta. The outer optimizer (`Outer`) then takes the anchor to its next value:

    avg[:LR[:MU]]        v <- MU v + G; anchor -= LR v                (LR 1, MU 0: parameter averaging)
    nesterov[:LR[:MU]]   v <- MU v + G; anchor -= LR (G + MU v)       (DiLoCo's outer SGD: LR 0.7, MU 0.9)
    sign[:LR[:MU]]       v <- MU v + G; anchor -= LR H lr sign(G + MU v)   (a Lion-like step of H inner steps'
                                                                       reach, lr the group's; LR 0.5, MU 0.9)

Streamed outer steps (LocalSteps(H, fragments=F, delay=D)): the model in F fragments whose outer
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

In the node layout (node_size=G) the thread runs, for a fragment's buckets, what the unstreamed outer
step runs for all of them: local rank 0 of each node takes the pseudo-gradients (the
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
import logging
import numbers
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lioncub.comm import clean_exit, fragment_schedule, transport, wire
from lioncub.comm.transport import allreduce_mean_
from lioncub.optim.backward import Worker
from lioncub.optim.layout import Nodes
from lioncub.optim.stats import Clock

log = logging.getLogger("lioncub")

OUTERS = {"avg": (1.0, 0.0), "nesterov": (0.7, 0.9), "sign": (0.5, 0.9)}


@dataclass(frozen=True)
class Outer:
    """The outer optimizer: kind (one of OUTERS), its learning rate and momentum."""

    kind: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9

    def __str__(self) -> str:
        return f"{self.kind}:{self.lr:g}:{self.momentum:g}"


def parse_outer(spec) -> Outer:
    """An Outer from "kind[:LR[:MU]]" (or an Outer); a clear ValueError otherwise."""
    if isinstance(spec, Outer):
        return spec
    kind, *rest = str(spec).split(":")
    if kind not in OUTERS or len(rest) > 2:
        raise ValueError(f"outer must be 'kind[:LR[:MU]]' with kind one of {', '.join(OUTERS)}, got {spec!r}")
    try:
        values = [float(v) for v in rest]
    except ValueError:
        raise ValueError(f"outer {spec!r}: LR and MU must be numbers") from None
    lr, mu = (values + list(OUTERS[kind])[len(values):])[:2]
    if not lr > 0 or not 0 <= mu < 1:
        raise ValueError(f"outer {spec!r}: LR must be > 0 and MU in [0, 1)")
    return Outer(kind, lr, mu)


_NAMES = ("fragments", "delay", "every")  # how LocalSteps spells fragment_schedule's options


@dataclass(frozen=True)
class LocalSteps:
    """Local steps: every rank takes `every` plain Lion steps on its own gradients and momentum, without
    communicating; then the ranks agree on an outer update of their pseudo-gradients through the method's codec
    (the module's docstring). Give it to LionCub as `local=`; validated here, with one-line errors.

    Args:
        every: H, the inner steps per outer step (an int >= 1).
        outer: the outer optimizer, "kind[:LR[:MU]]" or an Outer: "avg" (the default, 1:0: the agreed update as it
            is), "nesterov" (DiLoCo's, 0.7:0.9) or "sign" (0.5:0.9).
        fragments: F, to stream the outer steps: the buckets in F fragments whose outer exchanges are staggered
            over the H steps and run on a communication thread (an int in [1, H]); None (default): not streamed.
        delay: D, with fragments: each fragment's outer update is applied D inner steps after its exchange was
            launched (D * F < H; default 1 where 1 < F < H, else 0).
        error_feedback: with a compressed method, keep what compression dropped for the next outer step.

    Example:
        >>> import lioncub
        >>> local = lioncub.LocalSteps(25, outer="nesterov", fragments=5, delay=3)
        >>> local.streamed
        (5, 3)

    What it costs and gains against every-step agreement is measured in the docs (local steps).
    """

    every: int
    outer: str | Outer = "avg"
    fragments: int | None = None
    delay: int | None = None
    error_feedback: bool = True

    def __post_init__(self):
        H = self.every
        if isinstance(H, bool) or not isinstance(H, numbers.Integral) or H < 1:
            raise ValueError(f"LocalSteps: every must be an int >= 1 (inner steps per outer step), got {H!r}")
        parse_outer(self.outer)
        fragment_schedule.check_options(self.fragments, self.delay, H, names=_NAMES)

    @property
    def streamed(self) -> tuple[int, int] | None:
        """(F, D) where the outer steps are streamed, else None."""
        return fragment_schedule.check_options(self.fragments, self.delay, self.every, names=_NAMES)


class LocalStepDriver:
    """Drives the engine's buckets for local steps (`options`, a LocalSteps): step() replaces the engine's."""

    def __init__(self, engine, options: LocalSteps):
        error_feedback, streamed = options.error_feedback, options.streamed
        self.engine, self.H, self.outer = engine, int(options.every), parse_outer(options.outer)
        self.nodes = engine.layout.nodes  # the node layout's groups (node_size=G), or None
        engine.local_checks = self.nodes is None  # each inner step checks this rank's own gradients
        if self.nodes is None:
            self.exchange = OuterExchange(engine, error_feedback)
        else:  # local rank 0 of every node votes for its node (its cross group is theirs)
            self.exchange = OuterExchange(engine, error_feedback, self.nodes.cross, self.nodes.count)
        self.anchor = None  # fp32 copies of the buckets' parameters at the last outer step
        self.velocity = None
        self.local_skips = self.outer_steps = self.outer_skips = 0
        self.stream = None if streamed is None else Streaming(self, *streamed)

    @property
    def residual(self):
        """The error-feedback residual of each bucket (None without error feedback)."""
        return self.exchange.residual

    def take_anchor(self) -> None:
        self.anchor = [b.p.detach().float().clone() for b in self.engine.buckets]
        if self.outer.momentum:
            self.velocity = [torch.zeros_like(a) for a in self.anchor]

    @torch.no_grad()
    def step(self, timing: bool = False) -> None:
        e = self.engine
        e.steps += 1
        e.stats.steps += 1
        e.buckets.adopt_moved_params()
        e.start_equal()  # (before the anchor is taken)
        e.buckets.collect()
        if self.anchor is None:
            self.take_anchor()
        clock = Clock(timing and e.buckets.is_cuda)
        t0 = clock()
        collectives = self.node_mean() if self.nodes is not None else []
        if e.skip_nonfinite and not (e.grads_finite() if self.nodes is None else e.buckets.all_finite()):
            self.local_skips += 1
            e.stats.skipped_steps += 1
            log.warning("LionCub: rank %d skipped its local step %d (non-finite gradient)", e.rank, e.steps)
        else:
            with e.keep(frozenset(e.buckets.unused)):
                collectives += e.layout.dense_step(e.buckets)
            e.momenta_identical = e.world_size == 1
        t1 = clock()
        if self.stream is not None:
            streamed, comm, exposed = self.stream.step(e.steps)
            collectives += streamed
        else:
            if e.steps % self.H == 0:
                collectives += self.outer_step()
            comm = exposed = clock() - t1
        e.record(collectives, comm_s=comm, apply_s=t1 - t0, exposed_s=exposed)
        e.buckets.end_step()

    def node_mean(self) -> list:
        """The node layout: every rank of a node takes its inner step on the node's mean gradient (an fp32
        all-reduce inside the node), so the node's ranks stay identical and it votes as one."""
        out = []
        for b in self.engine.buckets:
            allreduce_mean_(b.g, self.nodes.intra, torch.float32)
            out.append(wire.Collective("allreduce", b.n * 4, "float32", "node"))
        return out

    def agree(self) -> tuple[list | None, list]:
        """G and the collectives; in the node layout local rank 0 of each node votes for it across the nodes
        and broadcasts G (or that the outer step is skipped) inside its node."""
        if self.nodes is None:
            return self.exchange.agree(self.anchor)
        if self.nodes.local == 0:
            self.exchange.pseudo_gradients(self.anchor)
        return self.node_agree(range(len(self.engine.buckets)), self.engine.steps, self.nodes.intra)

    def node_agree(self, ks, step: int, intra) -> tuple[list | None, list]:
        """The node layout's agreement on buckets ks, their pseudo-gradients taken on the leader (local rank 0;
        the others take none, as they hold no residual): its exchange across the nodes, then its broadcasts on
        `intra` (this node's group) of whether the nodes voted and of G[k] for k in ks."""
        e, leader = self.engine, self.nodes.local == 0
        G, collectives = self.exchange.agree_taken(ks, step) if leader else (None, [])
        collectives = [wire.Collective(c.op, c.nbytes, c.dtype, "cross") for c in collectives]
        src = dist.get_global_rank(intra, 0)
        voted = torch.tensor([int(G is not None)], dtype=torch.int32, device=e.buckets.device)
        transport.call("broadcast (outer voted)", dist.broadcast, voted, src=src, group=intra)
        collectives.append(wire.Collective("broadcast", 4, "int32", "node"))
        if not int(voted):
            return None, collectives
        G = G if leader else self.exchange.received()
        for k in ks:
            transport.call("broadcast (outer update)", dist.broadcast, G[k], src=src, group=intra)
            collectives.append(wire.Collective("broadcast", G[k].numel() * 4, "float32", "node"))
        return G, collectives

    def outer_step(self) -> list:
        """Agree G, move the anchor, restart every replica from it; returns the collectives."""
        G, collectives = self.agree()
        self.apply_outer(range(len(self.engine.buckets)), G, self.engine.steps)
        return collectives

    def apply_outer(self, ks, G, step: int) -> None:
        """Move the anchor of buckets ks by the agreed G (None: the outer step of `step` is skipped) and restart
        their parameters from it."""
        e = self.engine
        if G is None:
            self.outer_skips += 1
            if e.rank == 0:
                log.warning("LionCub: outer step at %d skipped on all ranks (a non-finite pseudo-gradient)", step)
        else:
            self.outer_steps += 1
            for k in ks:
                reach = self.H * e.buckets.hyper(e.buckets[k]).lr
                outer_update(self.outer, self.anchor[k], None if self.velocity is None else self.velocity[k], G[k],
                             inner_reach=reach)
        for k in ks:
            e.buckets[k].p.copy_(self.anchor[k])

    def state_dict(self) -> dict:
        stream = None if self.stream is None else self.stream.state_dict()  # (first: it waits for the thread)
        copy = (lambda ts: None if ts is None else [t.clone() for t in ts])
        sd = dict(local_steps=self.H, outer=str(self.outer), anchor=copy(self.anchor), residual=copy(self.residual),
                  velocity=copy(self.velocity), local_skips=self.local_skips, outer_steps=self.outer_steps,
                  outer_skips=self.outer_skips)
        if stream is not None:
            sd["stream"] = stream
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if sd.get("local_steps") != self.H or sd.get("outer") != str(self.outer):
            raise ValueError(f"this checkpoint ran local_steps={sd.get('local_steps')} outer={sd.get('outer')}; this "
                             f"optimizer has local_steps={self.H} outer={self.outer}: resume with the same options")
        if ("stream" in sd) != (self.stream is not None):
            raise ValueError(f"this checkpoint's outer steps were {'' if 'stream' in sd else 'not '}streamed "
                             "(fragments); resume with the same options")
        if (sd["residual"] is None) != (self.residual is None):
            raise ValueError("this checkpoint's error feedback differs from this optimizer's: resume with the same")
        if self.stream is not None:
            self.stream.load_state_dict(sd["stream"])
        self.anchor = None if sd["anchor"] is None else [t.clone() for t in sd["anchor"]]
        self.velocity = None if sd["velocity"] is None else [t.clone() for t in sd["velocity"]]
        for mine, saved in zip(self.residual or (), sd["residual"] or ()):
            mine.copy_(saved)
        self.local_skips, self.outer_steps, self.outer_skips = sd["local_skips"], sd["outer_steps"], sd["outer_skips"]


# --- the outer step ---------------------------------------------------------------------------------------

def segment_mean_abs(e: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """float64 mean |e| of each segment [offsets[j], offsets[j+1])."""
    return torch.stack([e[s:t].abs().sum(dtype=torch.float64) / (t - s) for s, t in zip(offsets[:-1], offsets[1:])])


def expand(values: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """One fp32 value per segment, repeated over the segment's elements."""
    sizes = torch.tensor([t - s for s, t in zip(offsets[:-1], offsets[1:])], device=values.device)
    return torch.repeat_interleave(values.float(), sizes)


def local_value(codec, e: torch.Tensor, scale: torch.Tensor, mult, offsets: list[int], levels: int) -> torch.Tensor:
    """C_i(e): what this rank's message of e stands for (see the module's docstring)."""
    if codec.l1:  # the codec's own levels: q = clamp(rint(e * mult_t), -s, s), standing for q / mult_t
        out = e.clone()
        for m, s, t in zip(mult.tolist(), offsets[:-1], offsets[1:]):
            if m > 0:
                out[s:t].mul_(m).round_().clamp_(-levels, levels).div_(m)
            else:
                out[s:t].zero_()
        return out
    return torch.sign(e).mul_(expand(scale, offsets))


class OuterExchange:
    """The buffers and collectives of the outer step, per bucket of the engine, among `voters` ranks of `group`
    (default: the engine's; the node layout: one rank per node, LocalStepDriver)."""

    def __init__(self, engine, error_feedback: bool, group=None, voters: int | None = None):
        self.engine, self.spec = engine, engine.spec
        self.group = engine.group if voters is None else group
        self.voters = engine.world_size if voters is None else voters
        self.error_feedback = error_feedback and not self.spec.dense
        buckets = engine.buckets
        for b in buckets:
            if b.offsets[0] != 0 or b.offsets[-1] != b.n:
                raise ValueError("local steps need buckets whose tensors fill them")
        f32 = [dict(dtype=torch.float32, device=b.p.device) for b in buckets]
        self.delta = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)]
        self.residual = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)] if self.error_feedback else None
        self.update = [torch.zeros(b.n, **kw) for b, kw in zip(buckets, f32)] if not self.spec.dense else None
        self.xs = None  # built on the first outer step, for the engine's process group then

    def received(self) -> list:
        """The buffers that receive an agreed G voted by another rank (the node layout)."""
        return self.delta if self.spec.dense else self.update

    def _exchanges(self):
        e = self.engine
        if self.xs is None:
            self.xs = [self.spec.exchange(b.n, b.p.device, self.group, levels=e.levels, grad_wire_dtype="float32",
                                          grads=d) for b, d in zip(e.buckets, self.delta)]
        return self.xs

    def pseudo_gradients(self, anchors, ks=None) -> None:
        """delta (+ the residual) of buckets `ks` (default: all), into self.delta."""
        for k in range(len(self.delta)) if ks is None else ks:
            d = self.delta[k]
            torch.sub(anchors[k], self.engine.buckets[k].p.float(), out=d)
            if self.residual is not None:
                d.add_(self.residual[k])

    def agree(self, anchors) -> tuple[list | None, list]:
        """The agreed outer gradient G of every bucket (None if some rank's pseudo-gradient is not finite:
        the outer step is skipped everywhere), and the collectives it took."""
        self.pseudo_gradients(anchors)
        return self.agree_taken(range(len(self.delta)), self.engine.steps)

    def agree_taken(self, ks, step: int) -> tuple[list | None, list]:
        """agree() for buckets `ks` whose pseudo-gradients are already in self.delta, as at step `step` (the
        streamed outer steps, Streaming, run this on their communication thread). G[k] holds
        bucket k's for k in ks."""
        if self.voters == 1:
            return (self.delta if all(torch.isfinite(self.delta[k]).all() for k in ks) else None), []
        if self.spec.dense:
            return self._dense(ks)
        return self._compressed(ks, step)

    def _dense(self, ks):
        xs, e = self._exchanges(), self.engine
        ok = all(bool(torch.isfinite(self.delta[k]).all()) for k in ks)
        bad = transport.any_rank(not ok, self.group, e.buckets.device, "outer non-finite")
        collectives = [wire.Collective("allreduce", 4, "int32")]
        if bad:
            return None, collectives
        for k in ks:
            xs[k]()
            collectives += xs[k].collectives
        return self.delta, collectives

    def _scales(self, mine: list, ok: bool):
        """All-gather [non-finite flag, this rank's scales]; (ranks with a non-finite pseudo-gradient, the
        agreed scales per bucket), summed in rank order on every rank alike."""
        msg = torch.cat([torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=mine[0].device), *mine])
        rows = torch.empty(self.voters * msg.numel(), dtype=torch.float64, device=msg.device)
        transport.call("all_gather_into_tensor (outer scales)", transport.all_gather, rows, msg, group=self.group)
        rows = rows.view(self.voters, -1)
        total = rows[0].clone()
        for r in rows[1:]:
            total += r
        total[1:] /= self.voters
        out, at = [], 1
        for m in mine:
            out.append(total[at : at + m.numel()])
            at += m.numel()
        collective = wire.Collective("allgather", rows.numel() * 8, "float64")
        return int(total[0].item()), out, collective

    def _compressed(self, ks, step: int):
        e, xs = self.engine, self._exchanges()
        buckets = [e.buckets[k] for k in ks]
        prepared = [xs[k].prepare(self.delta[k], self.delta[k], beta1=0.0, offsets=b.offsets)
                    for k, b in zip(ks, buckets)]
        mine = [segment_mean_abs(self.delta[k], b.offsets) for k, b in zip(ks, buckets)]
        ok = all(bool(flag) for flag, _ in prepared) and all(bool(torch.isfinite(m).all()) for m in mine)
        bad, scales, collective = self._scales(mine, ok)
        collectives = [collective]
        if bad:
            return None, collectives
        parity = e.zero_parity(step)
        for j, (k, b, (_, mult)) in enumerate(zip(ks, buckets, prepared)):
            x, d = xs[k], self.delta[k]
            x.pack(d, d, mult, beta1=0.0, beta2=0.0, offsets=b.offsets, zero_parity=parity, update_momentum=False)
            code = x()
            collectives += x.collectives
            u = self.update[k].zero_()
            x.apply(u, code, lr=-1.0, wd=0.0)  # u = 0 + U
            u.mul_(expand(scales[j], b.offsets))
            if self.residual is not None:
                self.residual[k].copy_(d).sub_(local_value(x.codec, d, mine[j], mult, b.offsets, x.levels))
        return self.update, collectives


def outer_update(outer: Outer, anchor, velocity, G, *, inner_reach: float) -> None:
    """Move one bucket's anchor by the outer optimizer (module docstring); `inner_reach` is H * lr."""
    if velocity is not None:
        velocity.mul_(outer.momentum).add_(G)
    if outer.kind == "avg":
        anchor.sub_(velocity if velocity is not None else G, alpha=outer.lr)
        return
    direction = G if velocity is None else G.add(velocity, alpha=outer.momentum)
    if outer.kind == "sign":
        anchor.sub_(torch.sign(direction), alpha=outer.lr * inner_reach)
    else:
        anchor.sub_(direction, alpha=outer.lr)


# --- streamed outer steps ---------------------------------------------------------------------------------

_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Streaming with a thread, for shutdown()


def shutdown(timeout: float = 60.0) -> None:
    """End every streaming thread (at exit, like lioncub.optim.backward's): each first finishes the exchanges
    queued (every rank launched them, so they complete; a slow link may need the time), then stops."""
    for s in list(_LIVE):
        s.close(join_timeout=timeout)


clean_exit.at_exit(shutdown)


class _Job:
    """One fragment's exchange: launched at `step`, applied at `due`; G and the collectives once done."""

    def __init__(self, fragment: int, step: int, due: int, event=None):
        self.fragment, self.step, self.due, self.event = fragment, step, due, event
        self.done = threading.Event()
        self.G = self.collectives = self.error = None
        self.comm_s = 0.0


class Streaming:
    """The fragments, their schedule and the communication thread of one LocalStepDriver."""

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
            own = Nodes(local.engine.group, local.nodes.size)
            local.exchange.group, self.intra = own.cross, own.intra
        self.fragments = fragment_schedule.split([b.n for b in local.engine.buckets], F)
        self.offsets = fragment_schedule.offsets(local.H, F)
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
        raise ValueError(f"fragments in the node layout (node_size=) run on Gloo only (this group's backend is "
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
