"""What a LionCub checkpoint holds beside torch.optim's state (`state_dict()["lioncub"]`), and the checks
that a resume makes sense."""

from __future__ import annotations

import logging

import torch

from lioncub.optim.stats import CommStats

log = logging.getLogger("lioncub")


def extras(engine) -> dict:
    extra = dict(step=engine.steps, world_size=engine.world_size, rank=engine.rank, method=engine.spec.name,
                 levels=engine.levels, dense_warmup=engine.phase.dense_warmup,
                 momenta_identical=engine.momenta_identical or engine.spec.dense, stats=engine.stats.as_dict(),
                 node_size=engine.layout.node_size)
    shards = engine.layout.momentum_shards(engine.buckets)
    if shards is not None:
        extra["momentum_shards"] = shards
    schedule = engine.schedule.state_dict()  # an adaptive schedule's running average and byte credit
    if schedule is not None:
        extra["schedule"] = schedule
    return extra


def check(engine, extra: dict) -> None:
    """Raise if the checkpoint whose extras are `extra` cannot resume here; warn where it resumes otherwise
    than it ran."""
    saved_n = extra.get("world_size", engine.world_size)
    engine.layout.check_resume(extra, extra.get("momentum_shards"), engine.buckets)
    if saved_n != engine.world_size and not extra.get("momenta_identical", False):
        raise ValueError(
            f"this checkpoint was saved by {saved_n} ranks, each with its own momentum, and cannot be "
            f"resumed on {engine.world_size} ranks. Call opt.sync_momentum() (on every rank) right before "
            f"saving, or save after a step that synced momenta, so the momenta are identical.")
    if extra.get("method", engine.spec.name) != engine.spec.name:
        log.warning("LionCub: resuming a %s checkpoint with method=%s", extra["method"], engine.spec.name)
    warmup = engine.phase.dense_warmup
    if extra.get("dense_warmup", warmup) != warmup:
        log.warning("LionCub: the checkpoint was saved with dense_warmup=%d, this optimizer has %d (it applies: "
                    "steps up to %d run dense)", extra["dense_warmup"], warmup, warmup)


@torch.no_grad()
def restore(engine, extra: dict) -> None:
    """After torch.optim's state was loaded (and the momentum views restored): the rest of `extra`."""
    for b, shard in zip(engine.buckets, extra.get("momentum_shards") or ()):
        b.m.copy_(shard)
    engine.steps = extra.get("step", 0)
    engine.momenta_identical = bool(extra.get("momenta_identical", True))
    if "stats" in extra:
        engine.stats = CommStats(**extra["stats"])
    if "schedule" in extra:
        engine.schedule.load_state_dict(extra["schedule"])
