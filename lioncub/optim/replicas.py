"""Whether every rank brought the same gradients to a step. They should differ: each rank reads its own data.
The same gradients everywhere mean a model wrapped in DistributedDataParallel, whose all-reduce already
averaged them (LionCub then exchanges the mean again, and the step costs DDP's fp32 all-reduce and LionCub's
exchange), or every rank reading the same data (N ranks doing one rank's work). Neither corrupts anything, and
nothing else shows it, so the run's first compressed step (phase.py: after any dense start; a run resumed
before it checks there too) sends one 32-byte MAX all-reduce and warns once; the result is identical on every
rank and changes nothing.

A DDP model that LionCub was not attached to (lioncub.attach_ddp) averages the gradients at the end of backward,
after LionCub's overlap has exchanged the local ones, which step() would then see changed and exchange again. So
the first backward looks for one (`wrapping_ddp`) and, if there is one, LionCub exchanges only in step(), on
DDP's mean, with a warning.
"""

from __future__ import annotations

import gc
import logging

import torch

log = logging.getLogger("lioncub")

WARNING = ("LionCub: every rank brought the same gradients to step %d: a model wrapped in DistributedDataParallel "
           "(its all-reduce already averaged them: build LionCub on the unwrapped model, or call "
           "lioncub.attach_ddp(model, opt)) or every rank reading the same data (shard it, e.g. DistributedSampler)")


def fingerprint(grads) -> torch.Tensor:
    """[sum, sum of magnitudes] of the gradients in float64: bit-equal gradients give bit-equal figures."""
    out = torch.zeros(2, dtype=torch.float64)
    for g in grads:
        out += torch.stack([g.sum(dtype=torch.float64), g.abs().sum(dtype=torch.float64)]).cpu()
    return out


def check(engine) -> None:
    """On a run's first compressed step: warn (rank 0) if every rank's gradients are the same (the layout decides
    where that can be told: not with one rank, nor where the buckets hold shards)."""
    same, collectives = engine.layout.same_gradients(fingerprint(b.g for b in engine.buckets), engine.buckets.device)
    engine.side_collectives += collectives
    if same and engine.rank == 0:
        log.warning(WARNING, engine.steps)


DDP_WARNING = ("LionCub: the model is wrapped in DistributedDataParallel, which LionCub was not attached to: DDP "
               "averages the gradients, then LionCub exchanges the mean in step() (both are paid). Call "
               "lioncub.attach_ddp(model, opt) after wrapping (LionCub then replaces DDP's all-reduce), or build "
               "LionCub on the unwrapped model")


def wrapping_ddp(params):
    """The torch DistributedDataParallel model that holds any of `params`, or None (a scan of the objects the
    garbage collector tracks, about 0.1 s per million; types only, so it reads no attribute of theirs)."""
    objects = gc.get_objects()
    ddp = [t for t in set(map(type, objects)) if issubclass(t, torch.nn.parallel.DistributedDataParallel)]
    if not ddp:
        return None
    mine = {id(p) for p in params}
    for obj in objects:
        if type(obj) in ddp and any(id(p) in mine for p in obj.module.parameters()):
            return obj
    return None
