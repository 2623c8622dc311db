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

import contextlib
import logging
import time

import torch

from lioncub import kernels
from lioncub.comm import wire
from lioncub.comm.transport import agree_control
from lioncub.optim import finite, replicas
from lioncub.optim.passes import nonfinite_flag
from lioncub.optim.stats import Clock

log = logging.getLogger("lioncub")


@torch.no_grad()
def take(engine, timing: bool) -> None:
    """Step engine.steps + 1 on the gradients in the buckets (or a pass that already exchanged them)."""
    began = time.perf_counter()
    settle(engine)
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
    if engine.steps == engine.phase.first_compressed_step and not engine.ddp_alongside:
        replicas.check(engine)  # (the buckets hold this rank's own gradients)
    clock = Clock(timing and engine.buckets.is_cuda)
    if method.dense:
        dense(engine, clock, done)
    elif engine.world_size == 1:
        local(engine, clock)
    elif done is not None:
        apply_pass(engine, clock, done)
    else:
        compressed(engine, clock)
    engine.buckets.end_step()
    if timing:
        engine.stats.tick(began)


@contextlib.contextmanager
def keep(engine, untouched: frozenset):
    """Leave the parameters no rank gave a gradient (and their momenta) as they are, as torch optimizers skip
    a .grad of None: their values are put back after the update, which ran on whole buckets."""
    if not untouched:
        yield
        return
    views = []
    for k, i in sorted(untouched):
        b = engine.buckets[k]
        views += [b.param_view(i), engine.layout.momentum_piece(b, i)]
    saved = [v.clone() for v in views]
    yield
    for v, copy in zip(views, saved):
        v.copy_(copy)


def local(engine, clock) -> None:
    """Plain Lion; a non-finite gradient makes the update kernels write nothing, decided on the device
    (lioncub.optim.skips: on a GPU the count comes back later, without draining the queue)."""
    t0 = clock()
    buckets = engine.buckets
    flag = kernels.nonfinite_flag(finite.finite_flags(engine)) if engine.skip_nonfinite and len(buckets) else None
    with keep(engine, engine.untouched(len(buckets.unused), [])):
        engine.layout.dense_step(buckets, skip=flag)
    record(engine, (), apply_s=clock() - t0)
    if flag is not None:
        engine.skips.add(engine.steps, flag)
        settle(engine, wait=not buckets.is_cuda)


def settle(engine, wait: bool = False) -> None:
    """Count (and report) the steps skipped on the device whose flags have come back."""
    for step in engine.skips.settle(wait):
        engine.stats.skipped_steps += 1
        if engine.rank == 0:
            log.warning("LionCub: step %d skipped (non-finite gradient); %d skipped so far", step,
                        engine.stats.skipped_steps)


def dense(engine, clock, done=None) -> None:
    t0 = clock()
    if done is not None:  # a pass averaged the gradients
        collectives, comm, exposed, untouched = done.collectives, done.comm_s, done.exposed_s, done.untouched
    else:
        collectives, unused = [], len(engine.buckets.unused)
        if engine.world_size > 1:
            for x in engine.step_units(engine.phase.dense_method)[1]:  # (runs: a larger sum, in another order)
                x()
                collectives += x.collectives
            _, _, unused = agree_control(0, None, engine.group, engine.buckets.device, unused)
            collectives.append(wire.CONTROL)
        untouched = engine.untouched(unused, collectives)
        comm = exposed = clock() - t0
    t1 = clock()
    # the reduced gradients are identical on all ranks, so this check agrees without a message
    if engine.skip_nonfinite and not all_finite(engine):
        return skip(engine, "non-finite gradient", collectives, comm, exposed)
    with keep(engine, untouched):
        collectives = list(collectives) + engine.layout.dense_step(engine.buckets)
    engine.momenta_identical = True  # (a dense warm-up step) every rank applied the same mean gradient
    t2 = clock()
    if engine.phase.charges_guard(engine.steps):
        engine.schedule.spend(credit_bytes(engine, collectives))
    record(engine, collectives, comm_s=comm, apply_s=t2 - t1, exposed_s=exposed)


def compressed(engine, clock) -> None:
    """Per unit (a bucket, or a run of adjacent buckets: lioncub.optim.runs): 1. the pre-pass (the node layout
    first reduces inside the node); 2. the control message (non-finite count, parameters without a gradient);
    3. encode with the momentum update fused in, exchange, apply."""
    buckets, layout = engine.buckets, engine.layout
    units, xs = engine.step_units(engine.spec)
    seconds = dict(quantize=0.0, comm=0.0, apply=0.0)
    prepared, early = [], pre_pass_from_backward(engine, units, xs)
    flags = [] if early is None else [early[0]]
    for j, (b, x) in enumerate(zip(units, xs)):
        t0 = clock()
        g, offsets, _ = layout.codec_input(b, x, b.g)
        t1 = clock()
        if early is None:
            ok, mult = x.prepare(g, b.m, beta1=buckets.hyper(b).beta1, offsets=offsets)
            flags.append(ok)
        else:
            mult = early[1][j]
        prepared.append((g, offsets, mult))
        seconds["comm"] += t1 - t0
        seconds["quantize"] += clock() - t1
    collectives = [c for x in xs for c in x.collectives if c.op == "reducescatter"] + [wire.CONTROL]
    t1 = clock()
    bad, _, unused = agree_control(nonfinite_flag(flags), None, layout.group, buckets.device, len(buckets.unused))
    bad = bad if engine.skip_nonfinite else 0
    untouched = engine.untouched(unused, collectives)
    seconds["comm"] += clock() - t1
    if bad:
        return skip(engine, f"{bad} rank(s) saw a non-finite gradient", collectives, seconds["comm"])
    codes = []
    with keep(engine, untouched):
        for b, x, (g, offsets, mult) in zip(units, xs, prepared):
            h = buckets.hyper(b)
            ta = clock()
            x.pack(g, b.m, mult, beta1=h.beta1, beta2=h.beta2, offsets=offsets,
                   zero_parity=engine.zero_parity(engine.steps))
            tb = clock()
            codes.append(x())
            tc = clock()
            layout.apply(b, x, codes[-1], h)
            seconds["quantize"] += tb - ta
            seconds["comm"] += tc - tb
            seconds["apply"] += clock() - tc
            collectives += [c for c in x.collectives if c.op != "reducescatter"]
    finish(engine, clock, xs, codes, collectives, quantize_s=seconds["quantize"], comm_s=seconds["comm"],
           apply_s=seconds["apply"], units=units)


def all_finite(engine) -> bool:
    """Every gradient finite (one host sync): at world size 1 from the flags backward took where they hold; else
    the buckets as they are now (after an average: the mean)."""
    return finite.all_finite(engine) if engine.world_size == 1 else engine.buckets.all_finite()


def pre_pass_from_backward(engine, units, xs):
    """The pre-pass backward took, if the codec reads this rank's own gradients and it holds: (the check, per
    unit the L1 multipliers or None); else None."""
    if not engine.layout.codec_reads_local or not xs:
        return None
    return finite.taken_in_backward(engine, units, xs[0])


def apply_pass(engine, clock, done) -> None:
    """Apply what backward agreed on, with the deferred momentum update."""
    if done.bad:
        return skip(engine, f"{done.bad} rank(s) saw a non-finite gradient", done.collectives, done.comm_s,
                    done.exposed_s)
    t0 = clock()
    xs = [engine.exchange_of(k, engine.spec) for k in range(len(engine.buckets))]
    with keep(engine, done.untouched):
        for b, x, code in zip(engine.buckets, xs, done.codes):
            engine.layout.apply(b, x, code, engine.buckets.hyper(b), deferred=True)
    finish(engine, clock, xs, done.codes, list(done.collectives), quantize_s=done.quantize_s, comm_s=done.comm_s,
           apply_s=clock() - t0, exposed_s=done.exposed_s)


def finish(engine, clock, xs, codes, collectives, *, quantize_s, comm_s, apply_s, exposed_s=None,
           units=None) -> None:
    """After a compressed step (over `units`, default the buckets): its agreement, the momentum sync if one is
    due, the statistics."""
    engine.momenta_identical = False
    stats, layout = engine.stats, engine.layout
    units = engine.buckets if units is None else units
    stats.last_agreement = layout.agreement(engine.spec.codec, units, xs, codes, engine.levels)
    due = engine.schedule.decide(engine.steps, stats.last_agreement,
                                 credit_bytes(engine, engine.side_collectives + collectives),
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
    collectives, engine.side_collectives = engine.side_collectives + list(collectives), []
    sent, recv = engine.layout.traffic(collectives)
    engine.stats.record(sent, recv, len(collectives), quantize_s, comm_s, apply_s, sync_s, exposed_s,
                        engine.layout.node_bytes(collectives))


def credit_bytes(engine, collectives) -> int:
    """The bytes the adaptive guard's credit counts: those that leave the node (all of them in the flat
    layout). In the node layout the node's fp32 reduce-scatter would otherwise earn credit for momentum
    syncs, which cross the slow links."""
    return engine.layout.traffic(collectives)[0] - engine.layout.node_bytes(collectives)
