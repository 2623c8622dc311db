"""What step() does, by kind of step:

    local        one rank: plain Lion on its gradients
    dense        the dense method: average the gradients (unless a pass did), then Lion on the mean
    compressed   communicate inside step(): agree on the non-finite flag first, then per bucket encode
                 (the momentum update fused in), exchange and apply
    apply_pass   apply what a pass agreed during backward, with the deferred momentum update
Every kind ends in `record` (statistics); the compressed ones first in `finish` (agreement, momentum sync).
A non-finite gradient on any rank makes every rank skip the step (`skip`), momenta unchanged.
"""

from __future__ import annotations

import logging

import torch

from lioncub.comm import wire
from lioncub.comm.transport import agree_control
from lioncub.optim.passes import nonfinite_flag
from lioncub.optim.stats import Clock

log = logging.getLogger("lioncub")


@torch.no_grad()
def take(engine, timing: bool) -> None:
    """Step engine.steps + 1 on the gradients in the buckets (or a pass that already exchanged them)."""
    engine.steps += 1
    engine.stats.steps += 1
    engine.buckets.adopt_moved_params()
    method = engine.method_at(engine.steps)
    done = engine.take_pass()
    overlapped = done is not None and done.overlapped
    engine.stats.overlapped_steps += overlapped
    engine.stats.last_backward_wait_s = done.exposed_s if overlapped else 0.0
    if done is None or (method.dense and not engine.buckets.private):
        engine.buckets.collect()
    clock = Clock(timing and engine.buckets.is_cuda)
    if method.dense:
        dense(engine, clock, done)
    elif engine.world_size == 1:
        local(engine, clock)
    elif done is not None:
        apply_pass(engine, clock, done)
    else:
        compressed(engine, clock)


def local(engine, clock) -> None:
    t0 = clock()
    if engine.skip_nonfinite and not engine.buckets.all_finite():
        return skip(engine, "non-finite gradient")
    engine.layout.dense_step(engine.buckets)
    record(engine, (), apply_s=clock() - t0)


def dense(engine, clock, done=None) -> None:
    t0 = clock()
    if done is not None:  # a pass averaged the gradients
        collectives, comm, exposed = done.collectives, done.comm_s, done.exposed_s
    else:
        collectives = []
        if engine.world_size > 1:
            for k in range(len(engine.buckets)):
                x = engine.exchange_of(k, engine.phase.dense_method)
                x()
                collectives += x.collectives
        comm = exposed = clock() - t0
    t1 = clock()
    # the reduced gradients are identical on all ranks, so this check agrees without a message
    if engine.skip_nonfinite and not engine.buckets.all_finite():
        return skip(engine, "non-finite gradient", collectives, comm, exposed)
    collectives = list(collectives) + engine.layout.dense_step(engine.buckets)
    engine.momenta_identical = True  # (a dense warm-up step) every rank applied the same mean gradient
    t2 = clock()
    if engine.phase.charges_guard(engine.steps):
        engine.schedule.spend(credit_bytes(engine, collectives))
    record(engine, collectives, comm_s=comm, apply_s=t2 - t1, exposed_s=exposed)


def compressed(engine, clock) -> None:
    buckets, layout = engine.buckets, engine.layout
    t_quant = t_comm = t_apply = 0.0
    mults, inputs, finite = [], [], []
    for k, b in enumerate(buckets):
        h, x = buckets.hyper(b), engine.exchange_of(k, engine.spec)
        t0 = clock()
        g, offsets, _ = layout.codec_input(b, x, b.g)
        t1 = clock()
        ok, mult = x.prepare(g, b.m, beta1=h.beta1, offsets=offsets)
        finite.append(ok)
        mults.append(mult)
        inputs.append((g, offsets))
        t_comm, t_quant = t_comm + t1 - t0, t_quant + clock() - t1
    xs = [engine.exchange_of(k, engine.spec) for k in range(len(buckets))]
    collectives = [c for x in xs for c in x.collectives if c.op == "reducescatter"]
    collectives.append(wire.CONTROL)
    t1 = clock()
    bad, _ = agree_control(nonfinite_flag(finite), None, layout.group, buckets.device)
    bad = bad if engine.skip_nonfinite else 0
    t_comm += clock() - t1
    if bad:
        return skip(engine, f"{bad} rank(s) saw a non-finite gradient", collectives, t_comm)
    codes = []
    for b, x, mult, (g, offsets) in zip(buckets, xs, mults, inputs):
        h = buckets.hyper(b)
        ta = clock()
        x.pack(g, b.m, mult, beta1=h.beta1, beta2=h.beta2, offsets=offsets,
               zero_parity=engine.zero_parity(engine.steps))
        tb = clock()
        code = x()
        codes.append(code)
        tc = clock()
        layout.apply(b, x, code, h)
        td = clock()
        t_quant, t_comm, t_apply = t_quant + tb - ta, t_comm + tc - tb, t_apply + td - tc
        collectives += [c for c in x.collectives if c.op != "reducescatter"]
    finish(engine, clock, xs, codes, collectives, quantize_s=t_quant, comm_s=t_comm, apply_s=t_apply)


def apply_pass(engine, clock, done) -> None:
    """Apply what backward agreed on, with the deferred momentum update."""
    if done.bad:
        return skip(engine, f"{done.bad} rank(s) saw a non-finite gradient", done.collectives, done.comm_s,
                    done.exposed_s)
    t0 = clock()
    xs = [engine.exchange_of(k, engine.spec) for k in range(len(engine.buckets))]
    for b, x, code in zip(engine.buckets, xs, done.codes):
        engine.layout.apply(b, x, code, engine.buckets.hyper(b), deferred=True)
    finish(engine, clock, xs, done.codes, list(done.collectives), quantize_s=done.quantize_s, comm_s=done.comm_s,
           apply_s=clock() - t0, exposed_s=done.exposed_s)


def finish(engine, clock, xs, codes, collectives, *, quantize_s, comm_s, apply_s, exposed_s=None) -> None:
    """After a compressed step: its agreement, the momentum sync if one is due, the statistics."""
    engine.momenta_identical = False
    stats, layout = engine.stats, engine.layout
    stats.last_agreement = layout.agreement(engine.spec.codec, engine.buckets, xs, codes, engine.levels)
    due = engine.schedule.decide(engine.steps, stats.last_agreement, credit_bytes(engine, collectives),
                                 credit_bytes(engine, layout.sync_collectives(engine.buckets)))
    sync_s = 0.0
    if due:
        ts = clock()
        collectives += engine.sync_momentum()
        sync_s = clock() - ts
    record(engine, collectives, quantize_s=quantize_s, comm_s=comm_s, apply_s=apply_s, sync_s=sync_s,
           exposed_s=None if exposed_s is None else exposed_s + sync_s)


def skip(engine, why: str, collectives=(), comm_s: float = 0.0, exposed_s: float | None = None) -> None:
    engine.stats.skipped_steps += 1
    record(engine, collectives, comm_s=comm_s, exposed_s=exposed_s)
    if engine.rank == 0:
        log.warning("LionCub: step %d skipped on all ranks (%s); %d skipped so far",
                    engine.steps, why, engine.stats.skipped_steps)


def record(engine, collectives, *, quantize_s=0.0, comm_s=0.0, apply_s=0.0, sync_s=0.0, exposed_s=None) -> None:
    sent, recv = engine.layout.traffic(collectives)
    engine.stats.record(sent, recv, len(collectives), quantize_s, comm_s, apply_s, sync_s, exposed_s,
                        engine.layout.node_bytes(collectives))


def credit_bytes(engine, collectives) -> int:
    """The bytes the adaptive guard's credit counts: those that leave the node (all of them in the flat
    layout). In the node layout the node's fp32 reduce-scatter would otherwise earn credit for momentum
    syncs, which cross the slow links."""
    return engine.layout.traffic(collectives)[0] - engine.layout.node_bytes(collectives)
