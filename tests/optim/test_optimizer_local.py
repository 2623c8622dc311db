"""LionCub in one process (torch.distributed not initialised): plain Lion, validation, schedules, views."""

import warnings

import pytest
import torch

from lioncub import EveryK, FirstSteps, Geometric, LionCub, LocalSteps
from lioncub.methods import NAMES as METHODS
from lioncub.optim.local import Outer


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.GELU(), torch.nn.Linear(64, 3)).to(dtype)


def _train(model, opt, steps=15, seed=1, zero=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 37, generator=gen).to(next(model.parameters()).dtype)
        y = torch.randint(0, 3, (16,), generator=gen)
        (zero or opt.zero_grad)()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


@pytest.mark.parametrize("method", METHODS)
def test_single_process_is_lion_pytorch_bit_for_bit(method):
    lion_pytorch = pytest.importorskip("lion_pytorch")
    a, b = _model(), _model()
    _train(a, LionCub(a.parameters(), lr=1e-3, weight_decay=0.1, method=method, bucket_mb=0.004))
    _train(b, lion_pytorch.Lion(b.parameters(), lr=1e-3, weight_decay=0.1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_params_use_fp32_math_and_round_once(dtype):
    model = _model(dtype=dtype)
    opt = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        opt.zero_grad()
        x = torch.randn(16, 37, generator=gen).to(dtype)
        model(x).float().pow(2).mean().backward()
        before = [(p.detach().clone(), p.grad.clone(), opt.state[p]["exp_avg"].clone()) for p in model.parameters()]
        opt.step()
        for p, (p0, g, m0) in zip(model.parameters(), before):
            c = m0.float() * 0.9 + g.float() * 0.1
            want_p = (p0.float() * (1 - 1e-4) - 1e-3 * torch.sign(c)).to(dtype)
            want_m = (m0.float() * 0.99 + g.float() * 0.01).to(dtype)
            assert torch.equal(p, want_p)
            assert (opt.state[p]["exp_avg"].float() - want_m.float()).abs().max() <= torch.finfo(dtype).eps * (
                want_m.float().abs().max() + 1e-6)


def test_model_zero_grad_and_replaced_grads_still_work():
    """model.zero_grad() sets .grad to None; the next backward allocates new tensors: LionCub copies them."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    a, b = _model(), _model()
    _train(a, LionCub(a.parameters(), lr=1e-3), zero=a.zero_grad)
    _train(b, lion_pytorch.Lion(b.parameters(), lr=1e-3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_params_and_grads_are_views_into_flat_buckets():
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-3, bucket_mb=0.0005)
    _train(model, opt, steps=2)
    for b in opt.engine.buckets:
        storage = b.p.untyped_storage().data_ptr()
        for p in b.params:
            assert p.untyped_storage().data_ptr() == storage
            assert p.grad.untyped_storage().data_ptr() == b.g.untyped_storage().data_ptr()
    assert len(opt.engine.buckets) >= 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="majority"), "unknown method 'majority'"),
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
        (dict(betas=(-0.1, 0.99)), "betas"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(method="l1-pbit", levels=0), "levels must be a positive integer"),
        (dict(method="l1-pbit", levels=2**40), "cannot fit"),
        (dict(method="vote-1bit", levels=3), "levels applies only to method='l1-pbit'"),
        (dict(momentum_sync=0), "positive integer"),
        (dict(momentum_sync="often"), "momentum-sync schedule"),
        (dict(bucket_mb=0), "bucket_mb"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LionCub(_model().parameters(), **kwargs)


def test_nonfinite_gradient_skips_single_process_step():
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert opt.stats.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert all(torch.isfinite(s["exp_avg"]).all() for s in opt.state.values())


@pytest.mark.parametrize("which,bad", [(0, float("nan")), (1, float("inf")), (2, -float("inf")), (3, float("nan"))])
def test_nonfinite_gradient_in_any_bucket_skips_the_step(which, bad):
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-2, bucket_mb=1024 / 2**20)
    assert len(opt.engine.buckets) > 1
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    list(model.parameters())[which].grad.view(-1)[-1] = bad
    opt.step()
    assert opt.stats.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.stats.skipped_steps == 1 and not all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


def test_all_finite_checks_every_tensor_of_a_list():
    from lioncub import kernels
    ok = [torch.ones(5), torch.zeros(3, dtype=torch.bfloat16)]
    assert kernels.all_finite(ok) and kernels.all_finite([]) and kernels.all_finite(ok[:1])
    for i in range(2):
        bad = [t.clone() for t in ok]
        bad[i][1] = float("nan")
        assert not kernels.all_finite(bad) and not kernels.all_finite(bad[i:i + 1])


def test_state_dict_round_trip_resumes_exactly():
    a = _model()
    opt_a = LionCub(a.parameters(), lr=1e-3)
    _train(a, opt_a, steps=6, seed=3)
    b = _model()
    opt_b = LionCub(b.parameters(), lr=1e-3)
    _train(b, opt_b, steps=3, seed=3)
    saved = {"model": b.state_dict(), "opt": opt_b.state_dict()}
    c = _model(seed=99)
    opt_c = LionCub(c.parameters(), lr=1e-3)
    c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    # replay the remaining 3 batches of the same stream
    gen = torch.Generator().manual_seed(3)
    for i in range(6):
        x, y = torch.randn(16, 37, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        if i < 3:
            continue
        opt_c.zero_grad()
        torch.nn.functional.cross_entropy(c(x), y).backward()
        opt_c.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert opt_c.engine.steps == 6
    # momentum is still a view into the flat buffer after loading
    p0 = next(c.parameters())
    bucket = opt_c.engine.buckets[0]
    assert opt_c.state[p0]["exp_avg"].untyped_storage().data_ptr() == bucket.m.untyped_storage().data_ptr()


def test_schedules():
    assert [s for s in range(1, 13) if EveryK(4).should_sync(s)] == [4, 8, 12]
    assert [s for s in range(1, 30) if FirstSteps(5, until=12).should_sync(s)] == [5, 10]
    # intervals 1, 2, 4, 8, ... -> syncs at 1, 3, 7, 15, 31
    assert [s for s in range(1, 40) if Geometric(k=1).should_sync(s)] == [1, 3, 7, 15, 31]
    # k=2: intervals 1, 1, 2, 2, 4, 5(floor 2**2.5), ...
    assert [s for s in range(1, 12) if Geometric(k=2).should_sync(s)] == [1, 2, 4, 6, 10]
    assert [s for s in range(1, 20) if Geometric(k=1, max_interval=4).should_sync(s)] == [1, 3, 7, 11, 15, 19]
    assert EveryK(10).rate() == 0.1


def test_stats_and_repr():
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-3, method="vote-1bit")
    _train(model, opt, steps=2)
    assert opt.stats.steps == 2 and opt.stats.last_bytes_sent == 0  # nothing to send on one rank
    assert "vote-1bit" in repr(opt)


def _net():
    return torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])  # 8 buckets at bucket_mb=1e-5


def _build(**kwargs):
    return LionCub(_net().parameters(), method="vote-1bit", bucket_mb=1e-5, **kwargs)


def _deprecations(**old):
    """LionCub built with the old keywords `old`, and the DeprecationWarnings it gave (their messages, in order)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _build(**old)
    return opt, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_the_old_keywords_still_work_and_name_their_new_spelling(monkeypatch):
    opt, said = _deprecations(local_steps=4, outer="nesterov", error_feedback=False, fragments=2, outer_delay=1)
    assert said == ["LionCub(local_steps=...) is deprecated: use local=LocalSteps(H)",
                    "LionCub(outer=...) is deprecated: use local=LocalSteps(H, outer=...)",
                    "LionCub(error_feedback=...) is deprecated: use local=LocalSteps(H, error_feedback=...)",
                    "LionCub(fragments=...) is deprecated: use local=LocalSteps(H, fragments=F)",
                    "LionCub(outer_delay=...) is deprecated: use local=LocalSteps(H, fragments=F, delay=D)"]
    new = _build(local=LocalSteps(4, outer="nesterov", error_feedback=False, fragments=2, delay=1))
    for o in (opt, new):
        assert (o.local_steps, o.local.outer, o.local.residual) == (4, Outer("nesterov", 0.7, 0.9), None)
        assert (o.local.stream.F, o.local.stream.D, o.local.stream.offsets) == (2, 1, [2, 0])
    opt, said = _deprecations(timing=True)
    assert opt.timing and said == ["LionCub(timing=...) is deprecated: use opt.timing = True after construction"]
    opt, said = _deprecations(hierarchical=False)
    assert opt.node_size == 1 and said == ["LionCub(hierarchical=...) is deprecated: use node_size=G alone "
                                           "(node_size='local': torchrun's LOCAL_WORLD_SIZE)"]
    with pytest.warns(DeprecationWarning, match="hierarchical"), pytest.raises(ValueError, match="initialised"):
        _build(hierarchical=True, node_size=2)  # the node layout, as node_size=2 alone
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="node_size='local' needs torchrun's"):
        _build(hierarchical=True)  # node_size from LOCAL_WORLD_SIZE, as node_size="local"
    cases = [(dict(hierarchical=False, node_size=2), ValueError, "node_size applies only with hierarchical=True"),
             (dict(outer="nesterov"), ValueError, "outer applies only with local_steps"),
             (dict(fragments=2), ValueError, "fragments applies only with local_steps"),
             (dict(local_steps=4, outer_delay=1), ValueError, "outer_delay applies only with fragments"),
             (dict(local_steps=0), ValueError, "every must be an int >= 1"),
             (dict(local_steps=4, local=LocalSteps(4)), TypeError, "not with the deprecated keywords too")]
    for kwargs, error, match in cases:
        with pytest.warns(DeprecationWarning), pytest.raises(error, match=match):
            _build(**kwargs)
    with pytest.raises(TypeError, match=r"^LionCub.__init__\(\) got an unexpected keyword argument 'hierachical'$"):
        LionCub(torch.nn.Linear(3, 2).parameters(), hierachical=True)
