"""Multi-rank scenarios of LionCub on FSDP2-sharded models (module-level, so spawned ranks can import them).

The oracle of HSDP + LionCub is LionCub's hierarchical layout on the same model unsharded, with the same units as
buckets (a param group per unit): the same shards (FSDP2's), the same node means, the same votes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_cases import flat, gather
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lioncub

LR, WD = 0.01, 0.1


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 29), torch.nn.Tanh(),
                               torch.nn.Linear(29, 5))


UNITS = (0, 2, 4)  # the Sequential's layers that are FSDP units (and the hierarchical run's param groups)


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 13, generator=gen)


def _train(model, opt, rank, steps):
    for step in range(1, steps + 1):
        x = batch(rank, step)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _train_bf16(model, opt, rank, steps):
    """What FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes, on the unsharded model: forward and backward
    on a bf16 copy of the fp32 parameters, the bf16 gradients handed to the fp32 ones."""
    low = make_model().bfloat16()
    for step in range(1, steps + 1):
        with torch.no_grad():
            for q, p in zip(low.parameters(), model.parameters()):
                q.copy_(p)
        low.zero_grad()
        low(batch(rank, step).bfloat16()).square().mean().backward()
        opt.zero_grad()
        for q, p in zip(low.parameters(), model.parameters()):
            p.grad = q.grad.float()
        opt.step()


def hsdp(rank, world_size, nodes, method, overlap=True, sync=2, steps=4, bf16=False):
    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for i in UNITS:
        fully_shard(model[i], mesh=mesh["shard"], mp_policy=policy)
    fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=method, overlap=overlap,
                          momentum_sync=sync)
    lioncub.attach_fsdp(model, opt, mesh)
    _train(model, opt, rank, steps)  # (FSDP casts the parameters and the input to bf16 itself)
    full = flat([p.full_tensor() for p in model.parameters()])
    return dict(params=full, replicas_equal=all(torch.equal(full, x) for x in gather(full)),
                stats=opt.stats.as_dict(), momenta=torch.cat([b.m for b in opt.engine.buckets]))


def hierarchical(rank, world_size, nodes, method, overlap=True, sync=2, steps=4, bf16=False):
    G = world_size // nodes
    model = make_model()
    groups = [dict(params=list(model[i].parameters())) for i in UNITS]
    opt = lioncub.LionCub(groups, lr=LR, weight_decay=WD, method=method, overlap=overlap, momentum_sync=sync,
                          node_size=G, bucket_mb=64,
                          grad_wire_dtype="bfloat16" if bf16 else "float32")
    (_train_bf16 if bf16 else _train)(model, opt, rank, steps)
    full = flat(model.parameters())
    return dict(params=full, replicas_equal=all(torch.equal(full, x) for x in gather(full)),
                stats=opt.stats.as_dict(), momenta=torch.cat([b.m for b in opt.engine.buckets[::-1]]))


def both(rank, world_size, nodes, method, kw=None):
    kw = kw or {}
    out = dict(hsdp=hsdp(rank, world_size, nodes, method, **kw))
    dist.barrier()
    out["hierarchical"] = hierarchical(rank, world_size, nodes, method, **kw)
    return out


def _sharded(mesh, shard_mesh):
    model = make_model()
    for i in UNITS:
        fully_shard(model[i], mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def plain_fsdp(rank, world_size, method):
    """FSDP over every rank (a 1-D mesh): the dense method is plain Lion on the reduce-scattered mean; a vote is
    refused with a line that names HSDP."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = _sharded(mesh, mesh)
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=method)
    try:
        lioncub.attach_fsdp(model, opt, mesh)
    except ValueError as exc:
        return dict(error=str(exc))
    _train(model, opt, rank, 3)
    ref = make_model()  # the oracle: plain Lion on the mean of every rank's gradient
    ref_opt = lioncub.Lion(ref.parameters(), lr=LR, weight_decay=WD)
    for step in range(1, 4):
        ref_opt.zero_grad()
        losses = [ref(batch(r, step)).square().mean() for r in range(world_size)]
        (sum(losses) / world_size).backward()
        ref_opt.step()
    full = flat([p.full_tensor() for p in model.parameters()])
    return dict(params=full, ref=flat(ref.parameters()), collectives=opt.stats.total_collectives,
                momentum_elements=sum(b.m.numel() for b in opt.engine.buckets))


def nonfinite_on_one_rank(rank, world_size, nodes, bad_rank):
    """A NaN in one rank's batch at step 2: every rank skips that step (params and momenta unchanged)."""
    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh, mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method="vote-1bit")
    lioncub.attach_fsdp(model, opt, mesh)
    changed = []
    for step in range(1, 4):
        x = batch(rank, step)
        if step == 2 and rank == bad_rank:
            x[0, 0] = float("nan")
        before = flat([p.to_local() for p in model.parameters()])
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        changed.append(not torch.equal(before, flat([p.to_local() for p in model.parameters()])))
    return dict(changed=changed, skipped=opt.stats.skipped_steps)


def clipped(rank, world_size, nodes, method, overlap=True, max_norm=0.005, steps=3):
    """HSDP with opt.clip_grad_norm_, and the norm an oracle computes from every rank's gradient on an unsharded
    copy of the model (float64): the RMS over nodes of the node means' norms, or the mean's norm (dense)."""
    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh, mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=method, overlap=overlap)
    lioncub.attach_fsdp(model, opt, mesh)
    ref, norms, oracle = make_model(), [], []
    for step in range(1, steps + 1):
        with torch.no_grad():
            for q, p in zip(ref.parameters(), model.parameters()):
                q.copy_(p.full_tensor())
        ref.zero_grad()
        ref(batch(rank, step)).square().mean().backward()
        grads = [g.double() for g in gather(flat([p.grad for p in ref.parameters()]))]
        means = [sum(grads[n * G:(n + 1) * G]) / G for n in range(nodes)]  # mesh rows: node n = ranks nG..nG+G-1
        oracle.append(float((sum(means) / nodes).norm()) if method == "allreduce" else
                      float(torch.stack([m.square().sum() for m in means]).mean().sqrt()))
        opt.zero_grad()
        model(batch(rank, step)).square().mean().backward()
        norms.append(opt.clip_grad_norm_(max_norm))
        opt.step()
    full = flat([p.full_tensor() for p in model.parameters()])
    return dict(norms=norms, oracle=oracle, replicas_equal=all(torch.equal(full, x) for x in gather(full)),
                skipped=opt.stats.skipped_steps)


def scaled(rank, world_size, nodes, method, steps=4, bad_rank=1):
    """HSDP under lioncub.amp.GradScaler with fp16 autocast, an overflow on one rank at step 2, and clipping after
    unscale_: that step is skipped on every rank and the scale halves; the others step."""
    from lioncub.integrations.amp import GradScaler

    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh, mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=method)
    lioncub.attach_fsdp(model, opt, mesh)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    changed, scales = [], []
    for step in range(1, steps + 1):
        before = flat([p.to_local() for p in model.parameters()])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch(rank, step)).float().square().mean()
            if step == 2 and rank == bad_rank:
                loss = loss * 1e30
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        changed.append(not torch.equal(before, flat([p.to_local() for p in model.parameters()])))
        scales.append(scaler.get_scale())
    full = flat([p.full_tensor() for p in model.parameters()])
    return dict(changed=changed, scales=scales, replicas_equal=all(torch.equal(full, x) for x in gather(full)),
                finite=bool(torch.isfinite(full).all()))


def checkpoint_resume(rank, world_size, nodes, path, steps, total):
    """Train `steps` and save (lioncub.checkpoint, DCP), then a new model and optimizer load it and train on to
    `total`; and an uninterrupted run to `total`."""
    from lioncub import checkpoint

    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name in ("interrupted", "resumed", "straight"):
        model = _sharded(mesh, mesh["shard"])
        opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method="l1-pbit", momentum_sync=3)
        lioncub.attach_fsdp(model, opt, mesh)
        first, last = (1, steps) if name == "interrupted" else (steps + 1, total) if name == "resumed" else (1, total)
        if name == "resumed":
            checkpoint.load(path, model, opt)
        for step in range(first, last + 1):
            x = batch(rank, step)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        if name == "interrupted":
            checkpoint.save(path, model, opt)
        out[name] = flat([p.full_tensor() for p in model.parameters()])
        dist.barrier()
    return out


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def memory(rank, world_size, nodes):
    """Bytes of parameters, gradients and momenta on this rank after a step: HSDP + LionCub against DDP-style
    LionCub (an unsharded replica) on the same model of 4 x Linear(257, 257)."""
    G = world_size // nodes
    mesh = init_device_mesh("cpu", (nodes, G), mesh_dim_names=("replicate", "shard"))
    out = {}
    for sharded in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(257, 257) for _ in range(4)])
        if sharded:
            for layer in model:
                fully_shard(layer, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
        opt = lioncub.LionCub(model.parameters(), lr=LR, method="vote-1bit")
        if sharded:
            lioncub.attach_fsdp(model, opt, mesh)
        opt.zero_grad()
        model(torch.randn(4, 257)).square().mean().backward()
        opt.step()
        params = [p.to_local() if sharded else p for p in model.parameters()]
        grads = [p.grad.to_local() if sharded else p.grad for p in model.parameters()]
        out["hsdp" if sharded else "replica"] = dict(params=_nbytes(params), grads=_nbytes(grads),
                                                     momenta=_nbytes([b.m for b in opt.engine.buckets]))
        dist.barrier()
    return out
