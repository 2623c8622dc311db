"""LionCub inside torch DDP, for frameworks that wrap the model themselves (Hugging Face Trainer, accelerate,
Lightning).

`attach_ddp(ddp_model, opt)` registers a DDP communication hook that sends nothing: DDP's fp32 all-reduce is
replaced by LionCub's own exchange, which runs during backward exactly as without DDP (lioncub.optim.backward:
LionCub's buckets, in backward's order, on LionCub's communication thread). Each parameter's final gradient
is copied into LionCub's bucket by LionCub's hook, which runs before DDP's, so the update is bit-identical
to LionCub without DDP, and DDP's bucketing (and its rebuild after the first iteration),
`gradient_as_bucket_view`, `static_graph` and `find_unused_parameters` do not matter. DDP's `no_sync()` is
honoured: backward passes inside it start no exchange. LionCub communicates on its own process group (same
ranks, lioncub.comm.transport.own_group): DDP's own collectives (the unused-parameter map, buffer broadcasts)
run on DDP's group from the autograd thread, and the two must never interleave on one communicator.

What stays in `.grad` after backward is each rank's own (local, not averaged) gradient, which frameworks
may clip or log: the update does not depend on it. Lion's update has magnitude lr whatever the gradient's
norm, and the vote was taken during backward; `torch.nn.utils.clip_grad_norm_` on `.grad` (the Hugging Face
Trainer's max_grad_norm, accelerate's clip_grad_norm_) changes only what is logged. In fp16, after
lioncub.GradScaler.unscale_, a clip that bites can reach the update (measured: the Trainer's max_grad_norm=1.0
changed the parameters in tests/integrations/test_framework_fp16.py; a norm that never bites did not).
"""

from __future__ import annotations

import torch


def _no_allreduce(state, bucket):
    """DDP communication hook: hand DDP back its bucket unchanged (LionCub exchanges the gradients)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def unwrap_optimizer(opt):
    """The LionCub inside a framework's optimizer wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer), or opt itself."""
    from lioncub.optim import LionCub

    seen = 0
    while not isinstance(opt, LionCub) and seen < 4:
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None:
            break
        opt, seen = inner, seen + 1
    if not isinstance(opt, LionCub):
        raise ValueError(f"attach_ddp needs a lioncub.LionCub optimizer, got {type(opt).__name__}")
    return opt


def attach_ddp(ddp_model, opt) -> None:
    """Run LionCub's exchange inside a torch DistributedDataParallel model instead of DDP's all-reduce.

    DDP gets a communication hook that sends nothing; LionCub's own exchange runs during backward, so the update
    is bit-identical to LionCub without DDP whatever DDP's options (`gradient_as_bucket_view`, `static_graph`,
    `find_unused_parameters`, `no_sync()`). `.grad` keeps each rank's own gradient. Calling it again on the
    same model does nothing.

    Args:
        ddp_model: the `torch.nn.parallel.DistributedDataParallel` model, already wrapped.
        opt: a `lioncub.LionCub` built on `ddp_model.module.parameters()`, or a framework's wrapper of one
            (accelerate's `AcceleratedOptimizer`, Lightning's `LightningOptimizer`).

    Raises:
        ValueError: `ddp_model` is not a DDP model, `opt` holds no LionCub, or their parameters differ.

    Example:
        Once, after wrapping and before the first backward:

            model = torch.nn.parallel.DistributedDataParallel(net)
            opt = lioncub.LionCub(model.module.parameters(), method="vote-1bit")
            lioncub.attach_ddp(model, opt)
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"attach_ddp needs a torch DistributedDataParallel model, got {type(ddp_model).__name__}")
    engine = unwrap_optimizer(opt).engine
    if engine.attached_to is ddp_model:
        return
    mine = {id(p) for b in engine.buckets for p in b.params}
    theirs = {id(p) for p in ddp_model.module.parameters() if p.requires_grad}
    if mine != theirs:
        raise ValueError(f"the optimizer's parameters ({len(mine)}) are not the DDP model's trainable parameters "
                         f"({len(theirs)}): build LionCub on model.parameters() of the model DDP wraps")
    from lioncub.comm.transport import own_group

    ddp_model.register_comm_hook(None, _no_allreduce)
    # (a LionCub built before the framework initialised torch.distributed learns its world size here)
    engine.attach(ddp_model, own_group(ddp_model.process_group), lambda: ddp_model.require_backward_grad_sync)
