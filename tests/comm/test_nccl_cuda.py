"""The user's path at world size 1 on the device (`pytest -m cuda`): `lioncub.init_distributed()` under
torchrun's variables, so NCCL on the GPU (Gloo in the CPU rehearsal). Every method's exchange of one bucket
through its own collectives on the default group and on a subgroup, against the same exchange with the CPU twins
on a Gloo group; LionCub with every method, flat and hierarchical, overlap on and off; `attach_ddp` on a DDP
model; `GradScaler` with fp16 autocast and an overflow; `checkpoint` save and load. NCCL-specific misuse (a dtype
or device NCCL refuses, a subgroup, a stream) raises in these. At world size 1 LionCub takes its single-process
path, so the exchanges are what put every method's collectives through NCCL. `make gpu-check` sets
CUBLAS_WORKSPACE_CONFIG=:4096:8 for these (the resumed run is compared bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from cuda_cases import CFG, DEVICE, report

import lioncub
from lioncub import methods

pytestmark = pytest.mark.cuda
LR, WD = 1e-3, 0.1
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def group():
    """init_distributed() as under torchrun at world size 1; (backend, world size). Torn down with finish()."""
    from lioncub.comm.distributed import free_port

    saved = {k: os.environ.get(k) for k in TORCHRUN}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _, world = lioncub.init_distributed(timeout=60)
        yield dist.get_backend(), world
    finally:
        if dist.is_initialized():
            lioncub.finish()
        torch.use_deterministic_algorithms(deterministic)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to(DEVICE)


def _batches(steps: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 32, generator=gen).to(DEVICE), torch.randint(10, (16,), generator=gen).to(DEVICE))
            for _ in range(steps)]


def _train(net, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def test_init_distributed_chooses_nccl_on_the_gpu(group):
    assert group == ("nccl" if DEVICE.type == "cuda" else "gloo", 1)


def _one_exchange(spec, n: int, device, grp) -> list:
    """(parameters, momenta) after one exchange of a bucket of n elements (fixed values) on `grp`, on the CPU."""
    gen = torch.Generator().manual_seed(7)
    g, m, p = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    if spec.dense:
        ex = spec.exchange(n, device, grp, grads=g)
        ex()
        return [g.cpu()]
    ex = spec.exchange(n, device, grp, levels=spec.resolve_levels(1))
    ex.encode(g, m, beta1=0.9, beta2=0.99, offsets=[0, n // 3, n])
    ex.apply(p, ex(), lr=LR, wd=WD)
    return [p.cpu(), m.cpu()]


def test_every_methods_exchange_equals_the_cpu_twins_on_gloo(group):
    """On the default group and on a subgroup; a flip where |c| is at rounding level is allowed (the kernels and
    the twins agree bit for bit otherwise: tests/kernels/test_kernels_triton.py)."""
    n = CFG["exchange_n"]
    gloo, sub = dist.new_group([0], backend="gloo"), dist.new_group([0])
    res = {}
    for name in methods.NAMES:
        spec = methods.get(name)
        ref = _one_exchange(spec, n, torch.device("cpu"), gloo)
        for where, grp in (("default group", None), ("subgroup", sub)):
            got = _one_exchange(spec, n, DEVICE, grp)
            res[f"{name} ({where})"] = sum(int((a != b).sum()) for a, b in zip(got, ref))
    report("exchange mismatches against the CPU twins on Gloo", mismatches=res, elements=n)
    assert set(res) == {f"{m} ({g})" for m in methods.NAMES for g in ("default group", "subgroup")}
    assert all(v <= max(2, n // 100_000) for v in res.values()), res


@pytest.fixture(scope="module")
def finals(group):
    """LionCub with every method, flat and (compressed methods) hierarchical (node size 1), overlap on and off:
    the parameters after 3 steps of a small model, by (method, hierarchical, overlap)."""
    batches, out = _batches(3), {}
    for name in methods.NAMES:
        for hier in [False] if methods.get(name).dense else [False, True]:
            for overlap in (True, False):
                model = _model()
                opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=name, overlap=overlap,
                                      hierarchical=hier, node_size=1 if hier else None)
                _train(model, opt, batches)
                out[(name, hier, overlap)] = [p.detach().clone() for p in model.parameters()]
    return out


def test_every_method_layout_and_overlap_steps_the_same(finals):
    start = [p.detach() for p in _model().parameters()]
    assert len(finals) == sum(2 if methods.get(m).dense else 4 for m in methods.NAMES)
    for key, ps in finals.items():
        assert all(bool(torch.isfinite(p).all()) for p in ps), key
        assert not all(torch.equal(a, b) for a, b in zip(ps, start)), f"{key}: nothing moved"
        assert all(torch.equal(a, b) for a, b in zip(ps, finals[(key[0], False, True)])), \
            f"{key}: the layout or the overlap changed the parameters"


def test_attach_ddp_trains_as_lioncub_alone(finals):
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if DEVICE.type == "cuda" else None)
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method="vote-1bit")
    lioncub.attach_ddp(ddp, opt)
    _train(ddp, opt, _batches(3))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), finals[("vote-1bit", False, True)]))


@pytest.mark.parametrize("method", ["allreduce", "vote-1bit"])
def test_grad_scaler_skips_the_overflowing_step_and_halves_the_scale(group, method):
    """fp16 autocast and opt.clip_grad_norm_, 4 steps, an inf gradient in the third."""
    model = _model()
    opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method=method)
    scaler = lioncub.GradScaler(DEVICE.type)
    scales, moved = [], []
    for i, (x, y) in enumerate(_batches(4)):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if i == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        opt.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        moved.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    assert moved == [True, True, False, True] and scales[2] == scales[1] / 2
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_checkpoint_resumed_run_equals_the_uninterrupted_one(group, tmp_path):
    """2 steps, save, 2 steps; a new model and optimizer (started elsewhere) load the checkpoint and take the
    same 2 steps."""
    batches, results = _batches(4), []
    path = str(tmp_path / "ckpt")
    for resume in (False, True):
        model = _model(seed=1 if resume else 0)
        opt = lioncub.LionCub(model.parameters(), lr=LR, weight_decay=WD, method="vote-1bit")
        if resume:
            info = lioncub.checkpoint.load(path, model, opt)
            assert info["momenta"] == "own", info
        else:
            _train(model, opt, batches[:2])
            lioncub.checkpoint.save(path, model, opt)
        _train(model, opt, batches[2:])
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
