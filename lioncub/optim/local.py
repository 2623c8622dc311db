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

The anchor is the parameters at the first step (after broadcast_parameters), then each outer step's result.
state_dict() holds the anchor, the residuals, the outer momentum and the counters, so a resume anywhere in
the interval reproduces the uninterrupted run bit for bit.
"""

from __future__ import annotations

import logging
import numbers

import torch

from lioncub.optim import steps
from lioncub.optim.outer import OuterExchange, outer_update, parse_outer
from lioncub.optim.stats import Clock

log = logging.getLogger("lioncub")


def check_options(local_steps, outer, *, dense_warmup: int, momentum_sync, hierarchical: bool, sharded: bool):
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
    if hierarchical:
        raise ValueError("local_steps with hierarchical=True is not supported yet (run the flat layout)")
    if sharded:
        raise ValueError("local_steps with FSDP2-sharded parameters is not supported yet")
    return int(local_steps), parse_outer("avg" if outer is None else outer)


class LocalSteps:
    """Drives the engine's buckets for local steps: step() replaces the engine's step kinds."""

    def __init__(self, engine, local_steps: int, outer, error_feedback: bool = True):
        self.engine, self.H, self.outer = engine, local_steps, outer
        self.exchange = OuterExchange(engine, error_feedback)
        self.anchor = None  # fp32 copies of the buckets' parameters at the last outer step
        self.velocity = None
        self.local_skips = self.outer_steps = self.outer_skips = 0

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
        if e.skip_nonfinite and not e.buckets.all_finite():
            self.local_skips += 1
            e.stats.skipped_steps += 1
            log.warning("LionCub: rank %d skipped its local step %d (non-finite gradient)", e.rank, e.steps)
        else:
            with steps.keep(e, frozenset(e.buckets.unused)):
                e.layout.dense_step(e.buckets)
            e.momenta_identical = e.world_size == 1
        t1 = clock()
        collectives = self.outer_step() if e.steps % self.H == 0 else []
        comm = clock() - t1
        steps.record(e, collectives, comm_s=comm, apply_s=t1 - t0, exposed_s=comm)
        e.buckets.end_step()

    def outer_step(self) -> list:
        """Agree G, move the anchor, restart every replica from it; returns the collectives."""
        e = self.engine
        G, collectives = self.exchange.agree(self.anchor)
        if G is None:
            self.outer_skips += 1
            if e.rank == 0:
                log.warning("LionCub: outer step at %d skipped on all ranks (a non-finite pseudo-gradient)", e.steps)
        else:
            self.outer_steps += 1
            for k, b in enumerate(e.buckets):
                reach = self.H * e.buckets.hyper(b).lr
                outer_update(self.outer, self.anchor[k], None if self.velocity is None else self.velocity[k], G[k],
                             inner_reach=reach)
        for b, a in zip(e.buckets, self.anchor):
            b.p.copy_(a)
        return collectives

    def state_dict(self) -> dict:
        copy = (lambda ts: None if ts is None else [t.clone() for t in ts])
        return dict(local_steps=self.H, outer=str(self.outer), anchor=copy(self.anchor), residual=copy(self.residual),
                    velocity=copy(self.velocity), local_skips=self.local_skips, outer_steps=self.outer_steps,
                    outer_skips=self.outer_skips)

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        if sd.get("local_steps") != self.H or sd.get("outer") != str(self.outer):
            raise ValueError(f"this checkpoint ran local_steps={sd.get('local_steps')} outer={sd.get('outer')}; this "
                             f"optimizer has local_steps={self.H} outer={self.outer}: resume with the same options")
        if (sd["residual"] is None) != (self.residual is None):
            raise ValueError("this checkpoint's error feedback differs from this optimizer's: resume with the same")
        self.anchor = None if sd["anchor"] is None else [t.clone() for t in sd["anchor"]]
        self.velocity = None if sd["velocity"] is None else [t.clone() for t in sd["velocity"]]
        for mine, saved in zip(self.residual or (), sd["residual"] or ()):
            mine.copy_(saved)
        self.local_skips, self.outer_steps, self.outer_skips = sd["local_skips"], sd["outer_steps"], sd["outer_skips"]
