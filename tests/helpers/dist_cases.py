"""Multi-rank scenarios run by the distributed tests (module-level functions, so spawned ranks can
import them). Each returns plain data that the test asserts on."""

from __future__ import annotations

import os
import signal
import time

import oracle
import torch
import torch.distributed as dist

from lioncub import LionCub
from lioncub.comm.transport import CommError
from lioncub.methods import NAMES as METHODS
from lioncub.methods.l1_pbit import default_levels

SHAPES = [(7, 5), (13,), (3, 3, 3), (1,), (33,), (2, 17)]
BUCKET_MB = 256 / 2**20  # a few tensors per bucket, several buckets
LR, WD, B1, B2 = 0.01, 0.1, 0.9, 0.99


def make_params():
    gen = torch.Generator().manual_seed(0)
    fp32 = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    bf16 = [torch.nn.Parameter(torch.randn(5, 3, generator=gen).bfloat16())]
    fp16 = [torch.nn.Parameter(torch.randn(11, generator=gen).half())]
    groups = [dict(params=fp32), dict(params=bf16, lr=0.02, weight_decay=0.0),
              dict(params=fp16, lr=0.005, betas=(0.8, 0.95))]
    return fp32 + bf16 + fp16, groups


def make_grads(params, rank, step):
    """Deterministic per (rank, step): exact zeros on every 5th element (c == 0 on all ranks at step 1,
    when m == 0), extra zeros on some ranks, and a None gradient on odd ranks at odd steps."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    grads = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        g.view(-1)[::5] = 0
        if (rank + i) % 3 == 0:
            g.view(-1)[1::4] = 0
        grads.append(None if (i == 3 and rank % 2 and step % 2) else g.to(p.dtype))
    return grads


def assign(params, grads, step):
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            p.grad = None
        elif (i + step) % 2:  # alternately copy into the bucket view and replace the tensor
            p.grad.copy_(g)
        else:
            p.grad = g.clone()


def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def flat(tensors):
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _index_offsets(opt):
    """Each parameter's offset inside its bucket (the 1-bit tie-break uses bucket-global indices)."""
    offsets = {}
    for b in opt.engine.buckets:
        for p, start in zip(b.params, b.offsets):
            offsets[p] = start
    return offsets


def check_methods(rank, world_size, steps=4, momentum_sync=3):
    """For every method: each step's applied update vs the oracle, momenta, replicas bit-identical."""
    report = {}
    for method in METHODS:
        params, groups = make_params()
        opt = LionCub(groups, lr=LR, betas=(B1, B2), weight_decay=WD, method=method, bucket_mb=BUCKET_MB,
                      momentum_sync=None if method == "allreduce" else momentum_sync)
        hyper = {id(p): (g["lr"], g["weight_decay"], *g["betas"]) for g in opt.param_groups for p in g["params"]}
        offsets = _index_offsets(opt)
        levels = default_levels(world_size) if method == "l1-pbit" else 0
        r = dict(mismatch=0, rounding=0, elements=0, ties=0, zero_votes=0, momentum_err=0.0, replicas_equal=True)
        for step in range(1, steps + 1):
            grads = make_grads(params, rank, step)
            assign(params, grads, step)
            before = [p.detach().clone() for p in params]
            moms = [opt.state[p]["exp_avg"].detach().clone() for p in params]
            effective = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            opt.step()
            all_g = gather(flat(effective))
            all_m = gather(flat(moms))
            start = 0
            for p, p0 in zip(params, before):
                n = p.numel()
                lr, wd, b1, b2 = hyper[id(p)]
                gs = [x[start : start + n] for x in all_g]
                ms = [x[start : start + n] for x in all_m]
                if method == "allreduce":
                    gs, ms = [x.to(p.dtype).float() for x in gs], [x.to(p.dtype).float() for x in ms]
                U = oracle.expected_update(method, gs, ms, b1, step, levels, offsets[p], p.dtype)
                want = oracle.expected_params(p0.reshape(-1), U, lr, wd)
                got = p.detach().reshape(-1)
                if method == "avg-pbit":
                    bad = ~torch.isclose(got.float(), want.float(), rtol=1e-6, atol=1e-9)
                else:
                    bad = got != want
                if method == "allreduce":  # the all-reduce sums in its own order: flips only at |c| ~ 0
                    c = oracle.direction(oracle.mean_gradient(gs, p.dtype), ms[0], b1)
                    rounding = bad & (c.abs() <= 1e-6 * (c.abs().max() + 1e-30))
                    r["rounding"] += int(rounding.sum())
                    bad &= ~rounding
                r["mismatch"] += int(bad.sum())
                r["elements"] += n
                if method != "allreduce":
                    cs = [oracle.direction(x, y, b1) for x, y in zip(gs, ms)]
                    r["zero_votes"] += int(sum((c == 0).sum() for c in cs))
                    r["ties"] += int((U == 0).sum())
                start += n
            # momenta: local EMA of the local gradient (global for the baseline), averaged after syncs
            for p, m0, g in zip(params, moms, effective):
                lr, wd, b1, b2 = hyper[id(p)]
                if method == "allreduce":
                    g = p.grad  # the averaged gradient
                want_m = (torch.mul(m0.float(), b2).add_(g.float(), alpha=1 - b2)).to(p.dtype)
                if method != "allreduce" and step % momentum_sync == 0:
                    want_m = (sum(gather(want_m.float())) / world_size).to(p.dtype)
                err = (opt.state[p]["exp_avg"].float() - want_m.float()).abs().max().item()
                r["momentum_err"] = max(r["momentum_err"], err)
            r["replicas_equal"] &= all(torch.equal(x, gather(flat(params))[0]) for x in gather(flat(params)))
            m_all = gather(flat([opt.state[p]["exp_avg"] for p in params]))
            if method == "allreduce" or step % momentum_sync == 0:
                r["replicas_equal"] &= all(torch.equal(m_all[0], x) for x in m_all)
        r["stats"] = opt.stats.as_dict()
        report[method] = r
    return report


def nonfinite_skip(rank, world_size, method, bad_rank, value):
    params, groups = make_params()
    opt = LionCub(groups, lr=LR, method=method, bucket_mb=BUCKET_MB)
    out = []
    for step in range(1, 4):
        grads = make_grads(params, rank, step)
        if step == 2 and rank == bad_rank:
            grads[4].view(-1)[7] = value
        assign(params, grads, step)
        before = flat(params)
        m_before = flat([opt.state[p]["exp_avg"] for p in params])
        opt.step()
        out.append(dict(params_changed=not torch.equal(before, flat(params)),
                        momenta_changed=not torch.equal(m_before, flat([opt.state[p]["exp_avg"] for p in params])),
                        finite=bool(torch.isfinite(flat(params)).all())))
    return dict(steps=out, skipped=opt.stats.skipped_steps)


def train_steps(rank, world_size, method, steps, state=None, sync_before_save=False):
    """Run `steps` steps (continuing from `state` if given); return the state to resume from."""
    params, groups = make_params()
    opt = LionCub(groups, lr=LR, method=method, bucket_mb=BUCKET_MB, momentum_sync=2)
    start = 0
    if state is not None:
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start + 1, start + steps + 1):
        assign(params, make_grads(params, rank, step), step)
        opt.step()
    if sync_before_save:
        opt.sync_momentum()
    return dict(params=[p.detach().clone() for p in params], opt=opt.state_dict(), step=start + steps)


def resume_from(rank, world_size, method, states):
    """Each rank resumes from the state its own rank saved."""
    return train_steps(rank, world_size, method, 3, states[rank])


def dead_rank(rank, world_size, how):
    """Rank world_size-1 dies (or stalls) before step 2; the others must raise CommError, not hang."""
    params, groups = make_params()
    opt = LionCub(groups, lr=LR, method="vote-1bit", bucket_mb=BUCKET_MB)
    for step in range(1, 4):
        if step == 2 and rank == world_size - 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(12)  # stall well past the 5 s process-group timeout
            return dict(error=None, stalled=True)
        assign(params, make_grads(params, rank, step), step)
        t0 = time.monotonic()
        try:
            opt.step()
        except CommError as exc:
            return dict(error=str(exc), seconds=time.monotonic() - t0, step=step)
    return dict(error=None)


class _Net(torch.nn.Module):
    """Mixed dtypes and shapes; `side` is used only on even ranks (unused elsewhere), `tail` frozen later."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(9, 16)
        self.mid = torch.nn.Linear(16, 16).bfloat16()
        self.side = torch.nn.Linear(16, 16)
        self.tail = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, use_side):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h.bfloat16()).float())
        if use_side:
            h = h + self.side(h)
        if self.tail.weight.requires_grad:
            h = h + self.tail(h)
        return self.out(h)


def overlap_run(rank, world_size, overlap, method, momentum_sync, steps=5, bad_step=3, freeze_at=4):
    """Train _Net with real backward passes: step 2 accumulates two micro-batches (no_sync on the first),
    step `bad_step` has a non-finite gradient on the last rank only, `tail` is frozen from `freeze_at`."""
    torch.manual_seed(0)
    net = _Net()
    opt = LionCub(net.parameters(), lr=LR, betas=(B1, B2), weight_decay=WD, method=method, bucket_mb=BUCKET_MB * 8,
                  momentum_sync=None if method == "allreduce" else momentum_sync, overlap=overlap)
    gen = torch.Generator().manual_seed(77 + rank)
    skipped_momenta_same = True
    for step in range(1, steps + 1):
        if step == freeze_at:
            net.tail.requires_grad_(False)
        opt.zero_grad()
        micro = 2 if step == 2 else 1
        for i in range(micro):
            x = torch.randn(8, 9, generator=gen)
            if step == bad_step and rank == world_size - 1:
                x[0, 0] = float("inf")
            ctx = opt.no_sync() if i + 1 < micro else _nullcontext()
            with ctx:
                loss = net(x, use_side=rank % 2 == 0).square().mean()
                loss.backward()
        moms = [opt.state[p]["exp_avg"].clone() for p in net.parameters() if p in opt.state]
        opt.step()
        if step == bad_step:
            after = [opt.state[p]["exp_avg"] for p in net.parameters() if p in opt.state]
            skipped_momenta_same = all(torch.equal(a, b) for a, b in zip(moms, after))
    params = [p.detach().clone() for p in net.parameters()]
    flat = torch.cat([p.float().reshape(-1) for p in params])
    replicas = gather(flat)
    return dict(params=params, momenta=[opt.state[p]["exp_avg"].clone() for p in net.parameters()],
                replicas_equal=all(torch.equal(r, flat) for r in replicas), skipped=opt.stats.skipped_steps,
                skipped_momenta_same=skipped_momenta_same, overlapped=opt.stats.overlapped_steps)


def overlap_vs_step(rank, world_size, methods=METHODS, syncs=(None, 2)):
    out = {}
    for method in methods:
        for sync in syncs:
            if method == "allreduce" and sync is not None:
                continue
            out[method, sync] = (overlap_run(rank, world_size, True, method, sync),
                                 overlap_run(rank, world_size, False, method, sync))
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def clipped_after_backward(rank, world_size):
    """torch's clip_grad_norm_ between backward and step changes local gradients after the overlapped vote:
    step() must take the vote again, giving what the non-overlapped optimizer gives."""
    results = []
    for overlap in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = LionCub(net.parameters(), lr=LR, method="vote-1bit", overlap=overlap)
        gen = torch.Generator().manual_seed(5 + rank)
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(4, 6, generator=gen)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    replicas = gather(results[0])
    return dict(same_as_plain=torch.equal(results[0], results[1]),
                replicas_equal=all(torch.equal(r, results[0]) for r in replicas))


def hook_vs_optimizer(rank, world_size, method, momentum_sync, ddp_kwargs, steps=4, lioncub_kwargs=None):
    """The same training with LionCub alone and with LionCub attached to a DDP model: parameters after each
    run, replicas. Step 2 accumulates two micro-batches (no_sync), step 3 has an inf on the last rank; with
    find_unused_parameters, `side` is unused on odd ranks."""
    from lioncub.integrations.ddp import attach_ddp

    unused = ddp_kwargs.get("find_unused_parameters", False)
    out = []
    for hooked in (False, True):
        torch.manual_seed(0)
        net = _Net()
        opt = LionCub(net.parameters(), lr=LR, betas=(B1, B2), weight_decay=WD, method=method,
                      bucket_mb=BUCKET_MB * 8, momentum_sync=None if method == "allreduce" else momentum_sync,
                      **(lioncub_kwargs or {}))
        model = net
        if hooked:
            model = torch.nn.parallel.DistributedDataParallel(net, **ddp_kwargs)
            attach_ddp(model, opt)
        gen = torch.Generator().manual_seed(77 + rank)
        for step in range(1, steps + 1):
            opt.zero_grad()
            micro = 2 if step == 2 else 1
            for i in range(micro):
                x = torch.randn(8, 9, generator=gen)
                if step == 3 and rank == world_size - 1:
                    x[0, 0] = float("inf")
                last = i + 1 == micro
                ctx = _nullcontext() if last else (model.no_sync() if hooked else opt.no_sync())
                with ctx:
                    model(x, use_side=not unused or rank % 2 == 0).square().mean().backward()
            if hooked and step == 1:  # what a framework does between backward and step: no effect
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
            opt.step()
        flat = torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])
        out.append(dict(flat=flat, replicas_equal=all(torch.equal(r, flat) for r in gather(flat)),
                        overlapped=opt.stats.overlapped_steps, skipped=opt.stats.skipped_steps))
    return out


def session_of(rank, world_size):
    """This rank's (session id, process id, parent's session id as the parent passed it)."""
    return os.getsid(0), os.getpid(), int(os.environ["TEST_PARENT_SID"])
