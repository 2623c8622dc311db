"""What everyday training scripts do with an optimizer, on LionCub across ranks (tests/optim/test_everyday.py):
torch's lr schedulers, closures, param groups with their own weight decay, hyper-parameters edited between
steps, step hooks, state_dict round trips, frozen and tied parameters, accumulation, torch's clipping, bf16,
torch.compile, SWA. Each case returns whether it behaved (replicas identical included) or what it said."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
from dist_cases import flat, gather

from lioncub import LionCub

LR = 1e-3


def _net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank: int, k: int):
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _loss(model, rank, k):
    x, y = _batch(rank, k)
    return (model(x) - y).square().mean()


def _train(model, opt, rank, steps=3, sched=None, k0=0):
    for k in range(k0, k0 + steps):
        opt.zero_grad()
        _loss(model, rank, k).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _same(model) -> bool:
    t = flat(model.parameters())
    return all(torch.equal(t, x) for x in gather(t))


def _fresh(method, **kw):
    model = _net()
    return model, LionCub(model.parameters(), lr=LR, method=method, **kw)


def schedulers(rank, method):
    out = {}
    for name, make, steps in (
            ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3), 3),
            ("onecycle", lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=LR, total_steps=5), 4),
            ("sequential", lambda o: torch.optim.lr_scheduler.SequentialLR(
                o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
                    torch.optim.lr_scheduler.CosineAnnealingLR(o, 3)], [2]), 4)):
        model, opt = _fresh(method)
        _train(model, opt, rank, steps, make(opt))
        out[name] = dict(same=_same(model), lr=opt.param_groups[0]["lr"])
    model, opt = _fresh(method)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    for k in range(3):
        _train(model, opt, rank, 1, k0=k)
        plateau.step(1.0)
    out["plateau"] = dict(same=_same(model), lr=opt.param_groups[0]["lr"])
    return out


def closure(rank, method):
    model, opt = _fresh(method)
    losses = []
    for k in range(3):
        def again(k=k):
            opt.zero_grad()
            loss = _loss(model, rank, k)
            loss.backward()
            return loss
        losses.append(opt.step(again))
    return _same(model) and all(torch.is_tensor(x) for x in losses)


def edits(rank, method):
    """lr set to 0 between steps freezes the model; new betas are taken; weight decay per group."""
    model, opt = _fresh(method)
    _train(model, opt, rank, 1)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = flat(model.parameters()).clone()
    _train(model, opt, rank, 2, k0=1)
    frozen = torch.equal(before, flat(model.parameters()))
    for g in opt.param_groups:
        g["lr"], g["betas"] = LR, (0.95, 0.98)
    _train(model, opt, rank, 2, k0=3)
    model2 = _net()
    decay = [p for p in model2.parameters() if p.ndim == 2]
    rest = [p for p in model2.parameters() if p.ndim < 2]
    opt2 = LionCub([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)], lr=LR,
                   method=method)
    _train(model2, opt2, rank)
    return dict(frozen=frozen, same=_same(model) and _same(model2))


def hooks(rank, method):
    model, opt = _fresh(method)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    _train(model, opt, rank, 2)
    return seen


def state_round_trip(rank, method):
    """Save after 2 steps, run 2 more; a new model and optimizer loaded from the save (weights_only) run the same
    2 steps: bit-identical. Rank 0's state broadcast to every rank loads too."""
    model, opt = _fresh(method)
    _train(model, opt, rank, 2)
    buf = io.BytesIO()
    torch.save(dict(model=model.state_dict(), opt=opt.state_dict()), buf)
    _train(model, opt, rank, 2, k0=2)
    buf.seek(0)
    saved = torch.load(buf)
    model2 = _net(5)
    model2.load_state_dict(saved["model"])
    opt2 = LionCub(model2.parameters(), lr=LR, method=method)
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, rank, 2, k0=2)
    exact = torch.equal(flat(model.parameters()), flat(model2.parameters()))
    obj = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(obj, 0)
    opt.load_state_dict(obj[0])
    _train(model, opt, rank, 1, k0=4)
    return dict(exact=exact, same=_same(model))


def frozen_and_tied(rank, method):
    model = _net()
    model[0].weight.requires_grad_(False)
    w = model[0].weight.detach().clone()
    opt = LionCub(model.parameters(), lr=LR, weight_decay=0.1, method=method)
    _train(model, opt, rank)
    untouched = torch.equal(w, model[0].weight)
    model2 = _net()
    model2[0].weight.requires_grad_(False)
    opt2 = LionCub(filter(lambda p: p.requires_grad, model2.parameters()), lr=LR, method=method)
    _train(model2, opt2, rank)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, i):
            return self.head(self.emb(i))

    tied = Tied()
    opt3 = LionCub(tied.parameters(), lr=LR, method=method)
    for k in range(3):
        i = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(10 * k + rank))
        opt3.zero_grad()
        tied(i).square().mean().backward()
        opt3.step()
    return dict(untouched=untouched, same=_same(model) and _same(model2) and _same(tied),
                still_tied=tied.head.weight is tied.emb.weight)


def accumulate_and_clip(rank, method):
    """Two micro-batches per step (model.zero_grad, as many scripts do), torch's clip_grad_norm_ on .grad."""
    model, opt = _fresh(method)
    for k in range(3):
        model.zero_grad()
        for j in range(2):
            (_loss(model, rank, 10 * k + j) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return _same(model)


def bf16_compile_swa(rank, method):
    model = _net().to(torch.bfloat16)
    opt = LionCub(model.parameters(), lr=LR, method=method)
    for k in range(3):
        x, y = _batch(rank, k)
        opt.zero_grad()
        (model(x.bfloat16()) - y.bfloat16()).float().square().mean().backward()
        opt.step()
    plain = _net()
    compiled = torch.compile(plain, backend="eager")
    opt2 = LionCub(compiled.parameters(), lr=LR, method=method)
    _train(compiled, opt2, rank)
    model3, opt3 = _fresh(method)
    swa = torch.optim.swa_utils.AveragedModel(model3)
    _train(model3, opt3, rank, sched=torch.optim.swa_utils.SWALR(opt3, swa_lr=1e-4))
    swa.update_parameters(model3)
    ema = copy.deepcopy(model3)
    return _same(model) and _same(plain) and _same(model3) and _same(ema)


def refusals(rank, method):
    out = {}
    for name, make in (("empty", lambda: LionCub([], lr=LR, method=method)),
                       ("duplicate", lambda: LionCub([dict(params=list(_net().parameters())[:2])] * 2, lr=LR,
                                                     method=method))):
        try:
            make()
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    model, opt = _fresh(method)
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad()
    scaler.scale(_loss(model, rank, 0)).backward()
    try:
        scaler.step(opt)
        out["torch_scaler"] = "accepted"
    except RuntimeError as exc:
        out["torch_scaler"] = str(exc)
    return out


CASES = (schedulers, closure, edits, hooks, state_round_trip, frozen_and_tied, accumulate_and_clip,
         bf16_compile_swa, refusals)


def everyday(rank, world_size, method):
    return {case.__name__: case(rank, method) for case in CASES}
