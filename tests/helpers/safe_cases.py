"""Multi-rank scenarios of the real-script features (clipping, GradScaler, autocast, dense warm-up, DCP
checkpoints, SLURM launch): module-level functions, so spawned ranks can import them."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
from dist_cases import flat, gather

from lioncub import LionCub

LR = 0.01
BUCKET_MB = 1024 / 2**20  # a few buckets for the small model below


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def momenta(opt, net):
    if opt.node_size > 1:  # the hierarchical layout: this rank's momentum shards
        return flat([b.m for b in opt.engine.buckets])
    return flat([opt.state[p]["exp_avg"] for p in net.parameters()])


def replicas_equal(t):
    return all(torch.equal(x, t) for x in gather(t))


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def listen():
    h = Records()
    logging.getLogger("lioncub").addHandler(h)
    return h


# --- clipping -------------------------------------------------------------------------------------------


def _layout(method):
    """"vote-1bit+hier": the method in the hierarchical layout with nodes of 2."""
    name, hier = method.removesuffix("+hier"), method.endswith("+hier")
    return name, (dict(node_size=2) if hier else {})


def clip_run(rank, world_size, method, overlap, max_norm, steps=3, dense_warmup=0, exact=False):
    """Clip with opt.clip_grad_norm_(max_norm, exact=exact) each step; return the norms, the reference norms
    computed from every rank's gradients, parameters and overlap figures."""
    log = listen()
    net = model()
    method, layout = _layout(method)
    opt = LionCub(net.parameters(), lr=LR, method=method, overlap=overlap, bucket_mb=BUCKET_MB,
                  dense_warmup=dense_warmup, **layout)
    norms, refs, clipped_ok = [], [], True
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        g = flat([p.grad for p in net.parameters()])
        dense = opt.engine.method_at(step).dense
        if dense and overlap:  # backward averaged them already
            ref = g.double().norm().item()
        elif dense:
            ref = (sum(x.double() for x in gather(g)) / world_size).norm().item()
        else:
            ref = math.sqrt(sum(x.double().square().sum().item() for x in gather(g)) / world_size)
        norm = opt.clip_grad_norm_(max_norm, exact=exact)
        coef = min(1.0, max_norm / (norm + 1e-6))
        after = flat([p.grad for p in net.parameters()])
        want = g  # the rank's own gradient (averaged by backward for a dense step with overlap)
        if dense and not overlap:  # clipping averaged them first
            want = sum(x.double() for x in gather(g)).float() / world_size
        clipped_ok &= bool(torch.allclose(after, want * coef, rtol=1e-5, atol=1e-7))
        norms.append(norm)
        refs.append(ref)
        opt.step()
    params = flat(net.parameters())
    return dict(norms=norms, refs=refs, params=params, clipped_ok=clipped_ok, replicas_equal=replicas_equal(params),
                overlapped=opt.stats.overlapped_steps,
                warned=any("changed after backward" in m for m in log.messages))


def clip_cases(rank, world_size, method, max_norms=(1e-3, 1e3), dense_warmup=0, exact=False):
    return {(m, o): clip_run(rank, world_size, method, o, m, dense_warmup=dense_warmup, exact=exact)
            for m in max_norms for o in (True, False)}


# --- GradScaler and autocast ----------------------------------------------------------------------------


def amp_run(rank, world_size, method, overlap, steps=4, overflow_step=2, overflow_rank=1, clip=None,
            plain_torch_scaler=False, exact=True):
    """fp16 autocast + lioncub.GradScaler; rank `overflow_rank` multiplies its loss by 1e30 at
    `overflow_step` (its fp16 backward overflows)."""
    from lioncub.integrations.amp import GradScaler

    net = model()
    method, layout = _layout(method)
    opt = LionCub(net.parameters(), lr=LR, method=method, overlap=overlap, bucket_mb=BUCKET_MB, **layout)
    scaler = (torch.amp.GradScaler if plain_torch_scaler else GradScaler)("cpu", init_scale=2.0**10)
    out = dict(changed=[], scales=[], trackers=[], local_inf=[])
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
            if step == overflow_step and rank == overflow_rank:
                loss = loss * 1e30
        scaler.scale(loss).backward()
        out["local_inf"].append(not all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()))
        before = flat(net.parameters())
        if clip is not None:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(clip, exact=exact)
        try:
            scaler.step(opt)
        except RuntimeError as exc:
            return dict(error=str(exc))
        scaler.update()
        out["changed"].append(not torch.equal(before, flat(net.parameters())))
        out["scales"].append(scaler.get_scale())
        out["trackers"].append(int(scaler._get_growth_tracker()))
    params = flat(net.parameters())
    out.update(params=params, momenta=momenta(opt, net), replicas_equal=replicas_equal(params),
               opt_steps=opt.engine.steps, overlapped=opt.stats.overlapped_steps)
    return out


def amp_cases(rank, world_size, methods=("vote-1bit", "l1-pbit", "allreduce"), clip=None, exact=True):
    """amp_run with and without overlap; a clip is the exact one unless `exact` is False."""
    return {(m, o): amp_run(rank, world_size, m, o, clip=clip, exact=exact) for m in methods for o in (True, False)}


def plain_torch_scaler(rank, world_size):
    return amp_run(rank, world_size, "vote-1bit", True, plain_torch_scaler=True)


def bf16_run(rank, world_size, method, steps=6):
    """bf16 autocast, no scaler: it trains (the loss falls) and replicas stay identical."""
    net = model()
    opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB)
    x, y = batch(rank, 0)  # one fixed batch per rank: the loss must fall
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = flat(net.parameters())
    return dict(losses=losses, replicas_equal=replicas_equal(params), skipped=opt.stats.skipped_steps,
                overlapped=opt.stats.overlapped_steps)


# --- dense warm-up --------------------------------------------------------------------------------------


def train(rank, opt, net, first, last) -> list:
    """Steps first..last; (parameters, momenta) after each."""
    snapshots = []
    for step in range(first, last + 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        snapshots.append((flat(net.parameters()), momenta(opt, net)))
    return snapshots


def warmup_cases(rank, world_size, method="vote-1bit", K=3, steps=6):
    """dense_warmup=K against plain allreduce for K steps, then against the method started from the
    warm-up's state; overlap against not; a resume across the boundary against the uninterrupted run."""
    out = {}
    kw = dict(lr=LR, bucket_mb=BUCKET_MB, momentum_sync=None)
    # the reference: allreduce for K steps, then `method` from that state (same step count)
    net_a = model()  # (two optimizers on one model: without overlap, or both would hook its backward)
    opt_a = LionCub(net_a.parameters(), method="allreduce", overlap=False, **kw)
    per_step_a = train(rank, opt_a, net_a, 1, K)
    out["momenta_identical_after_warmup"] = replicas_equal(momenta(opt_a, net_a))
    opt_m = LionCub(net_a.parameters(), method=method, overlap=False, **kw)
    opt_m.load_state_dict(opt_a.state_dict())
    train(rank, opt_m, net_a, K + 1, steps)
    reference = (flat(net_a.parameters()), momenta(opt_m, net_a))
    for overlap in (True, False):
        net = model()
        opt = LionCub(net.parameters(), method=method, dense_warmup=K, overlap=overlap, **kw)
        per_step = train(rank, opt, net, 1, steps)
        out[overlap] = dict(
            warmup_equal=all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                             for a, b in zip(per_step_a, per_step, strict=False)),
            after_equal=torch.equal(per_step[-1][0], reference[0]) and torch.equal(per_step[-1][1], reference[1]),
            changed_after_warmup=not torch.equal(per_step[K][0], per_step[K - 1][0]),
            momenta_differ_after=not replicas_equal(per_step[-1][1]),
            replicas_equal=replicas_equal(per_step[-1][0]))
    # resume at step K-1 (inside the warm-up) and at K+1 (after it)
    for stop in (K - 1, K + 1):
        net = model()
        opt = LionCub(net.parameters(), method=method, dense_warmup=K, **kw)
        train(rank, opt, net, 1, stop)
        saved_p, saved_o = [p.detach().clone() for p in net.parameters()], opt.state_dict()
        net2 = model()
        with torch.no_grad():
            for p, s in zip(net2.parameters(), saved_p):
                p.copy_(s)
        opt2 = LionCub(net2.parameters(), method=method, dense_warmup=K, **kw)
        opt2.load_state_dict(saved_o)
        train(rank, opt2, net2, stop + 1, steps)
        out[f"resume_at_{stop}"] = (torch.equal(flat(net2.parameters()), reference[0])
                                    and torch.equal(momenta(opt2, net2), reference[1]))
    out["state_dict_warmup"] = opt2.state_dict()["lioncub"]["dense_warmup"]
    return out


# --- checkpoints ----------------------------------------------------------------------------------------


def ckpt_train(rank, world_size, path, steps, method="vote-1bit", save=True, resume=False, total=None):
    """Train `steps` steps and save (lioncub.integrations.checkpoint) to `path`; or resume from `path` and train on to
    `total`. Returns parameters and momenta."""
    from lioncub.integrations import checkpoint

    net = model()
    opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB, momentum_sync=None)
    log = listen()
    first = 1
    if resume:
        checkpoint.load(path, net, opt)
        first = opt.engine.steps + 1
    train(rank, opt, net, first, total if resume else steps)
    if save and not resume:
        checkpoint.save(path, net, opt)
    return dict(params=flat(net.parameters()), momenta=momenta(opt, net), step=opt.engine.steps,
                messages=log.messages, stats_steps=opt.stats.steps)


def ckpt_loaded(rank, world_size, path, method="vote-1bit"):
    """Load `path` and return what was loaded (no training)."""
    from lioncub.integrations import checkpoint

    net = model()
    opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB)
    log = listen()
    info = checkpoint.load(path, net, opt)
    return dict(params=flat(net.parameters()), momenta=momenta(opt, net), step=opt.engine.steps, info=info,
                messages=log.messages, stats_steps=opt.stats.steps)


# --- SLURM ----------------------------------------------------------------------------------------------


def fake_slurm_rank(procid, ntasks, port, queue):
    """A process that srun would have started: SLURM's variables only, initialised by init_distributed."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update(SLURM_PROCID=str(procid), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(procid),
                      SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="123",
                      SLURM_STEP_ID="0", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        from lioncub.comm.distributed import finish, init_distributed

        rank, world = init_distributed(backend="gloo", timeout=30)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        queue.put((procid, rank, world, t.item(), os.environ.get("LOCAL_RANK")))
        finish()
    except BaseException as exc:  # noqa: BLE001  (reported to the test)
        queue.put((procid, None, None, repr(exc), None))


# --- inside torch DDP (lioncub.attach_ddp) --------------------------------------------------------------


def ddp_clip_amp(rank, world_size, method, steps=4, max_norm=0.05):
    """fp16 + lioncub.GradScaler + unscale_ + opt.clip_grad_norm_, rank 1 overflowing at step 2: with
    LionCub alone and with LionCub attached to a DDP model."""
    from lioncub.integrations.amp import GradScaler
    from lioncub.integrations.ddp import attach_ddp

    out = []
    for hooked in (False, True):
        net = model()
        opt = LionCub(net.parameters(), lr=LR, method=method, bucket_mb=BUCKET_MB)
        fwd = net
        if hooked:
            fwd = torch.nn.parallel.DistributedDataParallel(net)
            attach_ddp(fwd, opt)
        scaler = GradScaler("cpu", init_scale=2.0**10)
        norms = []
        for step in range(1, steps + 1):
            opt.zero_grad()
            x, y = batch(rank, step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(fwd(x).float(), y)
                if step == 2 and rank == 1:
                    loss = loss * 1e30
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(opt.clip_grad_norm_(max_norm))
            scaler.step(opt)
            scaler.update()
        params = flat(net.parameters())
        out.append(dict(params=params, momenta=momenta(opt, net), norms=norms, scale=scaler.get_scale(),
                        replicas_equal=replicas_equal(params), steps=opt.engine.steps))
    return out
