"""Local steps (LionCub(local_steps=H, outer=...)): each rank takes H plain Lion steps on its own gradients and
momentum, with no communication; at every H-th step the ranks agree on an outer update from their pseudo-
gradients through the method's codec, with error feedback (lioncub.optim.outer), and every replica restarts from
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

In the node layout (hierarchical=True) each node is one replica: its G ranks step together on the node's mean
gradient (an fp32 all-reduce inside the node), and local rank 0 of every node votes for it across the nodes and
broadcasts the agreed G inside its node (lioncub.optim.outer's exchange on the leaders' cross group).

With fragments (lioncub.optim.streaming) the outer steps of the model's fragments are staggered over the H
steps and overlap the next inner steps on a communication thread, in either layout.

The anchor is the parameters at the first step (after broadcast_parameters), then each outer step's result.
state_dict() holds the anchor, the residuals, the outer momentum and the counters, so a resume anywhere in
the interval reproduces the uninterrupted run bit for bit.
"""

from __future__ import annotations

import logging
import numbers

import torch
import torch.distributed as dist

from lioncub.comm import transport, wire
from lioncub.comm.transport import allreduce_mean_
from lioncub.optim import finite, steps, streaming
from lioncub.optim.outer import OuterExchange, outer_update, parse_outer
from lioncub.optim.stats import Clock

log = logging.getLogger("lioncub")


def check_options(local_steps, outer, *, dense_warmup: int, momentum_sync, sharded: bool):
    """Validate LionCub's local-step options; (H or None, the Outer or None). One-line errors."""
    if local_steps is None:
        if outer is not None:
            raise ValueError("outer applies only with local_steps=H (the outer optimizer of local steps)")
        return None, None
    if isinstance(local_steps, bool) or not isinstance(local_steps, numbers.Integral) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1 (inner steps per outer step), got {local_steps!r}")
    if dense_warmup:
        raise ValueError("local_steps does not combine with dense_warmup yet")
    if momentum_sync is not None:
        raise ValueError("local_steps does not combine with momentum_sync (the inner momenta stay each rank's own)")
    if sharded:
        raise ValueError("local_steps with FSDP2-sharded parameters is not supported yet")
    return int(local_steps), parse_outer("avg" if outer is None else outer)


class LocalSteps:
    """Drives the engine's buckets for local steps: step() replaces the engine's step kinds."""

    def __init__(self, engine, local_steps: int, outer, error_feedback: bool = True, streamed=None):
        """streamed: (F, D) streams the outer steps (lioncub.optim.streaming), None does not."""
        self.engine, self.H, self.outer = engine, local_steps, outer
        self.nodes = engine.layout.nodes  # the node layout's groups (hierarchical=True), or None
        engine.local_checks = self.nodes is None  # each inner step checks this rank's own gradients
        if self.nodes is None:
            self.exchange = OuterExchange(engine, error_feedback)
        else:  # local rank 0 of every node votes for its node (its cross group is theirs)
            self.exchange = OuterExchange(engine, error_feedback, self.nodes.cross, self.nodes.count)
        self.anchor = None  # fp32 copies of the buckets' parameters at the last outer step
        self.velocity = None
        self.local_skips = self.outer_steps = self.outer_skips = 0
        self.stream = None if streamed is None else streaming.Streaming(self, *streamed)

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
        e.buckets.collect()
        if self.anchor is None:
            self.take_anchor()
        clock = Clock(timing and e.buckets.is_cuda)
        t0 = clock()
        collectives = self.node_mean() if self.nodes is not None else []
        if e.skip_nonfinite and not (finite.all_finite(e) if self.nodes is None else e.buckets.all_finite()):
            self.local_skips += 1
            e.stats.skipped_steps += 1
            log.warning("LionCub: rank %d skipped its local step %d (non-finite gradient)", e.rank, e.steps)
        else:
            with steps.keep(e, frozenset(e.buckets.unused)):
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
        steps.record(e, collectives, comm_s=comm, apply_s=t1 - t0, exposed_s=exposed)
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
