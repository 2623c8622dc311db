"""BackwardCheck (lioncub.optim.backward): the non-finite check during backward, and step() reading it instead of the
gradients only while it still describes them."""

import os

import finite_cases
import pytest
import torch
from finite_cases import BUCKET_MB, counted, model

from lioncub import LionCub, kernels
from lioncub.comm.spawn import spawn

DEVICE = os.environ.get("LIONCUB_TEST_DEVICE", "cpu")  # make gpu-check runs this file on CUDA (a side stream)


def _batch(gen):
    return torch.randn(16, 37, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _backward(net, gen, scale=1.0):
    x, y = _batch(gen)
    (torch.nn.functional.cross_entropy(net(x), y) * scale).backward()


@pytest.fixture
def reads(monkeypatch):
    """The finite_flag calls (one read of a bucket's gradients each) from now on."""
    calls: list = []
    monkeypatch.setattr(kernels, "finite_flag", counted("finite_flag", calls))
    return calls


@pytest.mark.parametrize("method", ["vote-1bit", "allreduce"])
def test_backward_checks_each_bucket_and_step_reads_none(reads, method):
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, method=method, bucket_mb=BUCKET_MB)
    n = len(opt.engine.buckets)
    assert n >= 2
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        _backward(net, gen)
        assert len(reads) == n  # one read per bucket, during backward
        reads.clear()
        opt.step()
        assert reads == [] and opt.stats.skipped_steps == 0


def test_flags_that_no_longer_hold_are_not_used(reads):
    """A gradient edited after backward (clipping, unscaling, by hand) bumps its buffer's version: step() reads
    every bucket again, and a NaN put there by hand skips the step."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, bucket_mb=BUCKET_MB)
    n = len(opt.engine.buckets)
    _backward(net, torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in net.parameters()] + [s["exp_avg"].clone() for s in opt.state.values()]
    next(net.parameters()).grad[0, 0] = float("nan")
    reads.clear()
    opt.step()
    assert len(reads) == n and opt.stats.skipped_steps == 1
    after = [p.detach() for p in net.parameters()] + [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("bad_micro_batch", [0, 1])
def test_a_nan_from_any_micro_batch_skips_the_step(bad_micro_batch):
    """Gradient accumulation: the check of the last backward sees the sum, NaN if any micro-batch's was."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, bucket_mb=BUCKET_MB)
    gen = torch.Generator().manual_seed(1)
    before = [p.detach().clone() for p in net.parameters()]
    for k in range(2):
        _backward(net, gen, float("nan") if k == bad_micro_batch else 1.0)
    opt.step()
    assert opt.stats.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(torch.isfinite(s["exp_avg"]).all() for s in opt.state.values())
    opt.zero_grad()
    _backward(net, gen)
    opt.step()
    assert opt.stats.skipped_steps == 1 and not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_accumulated_steps_equal_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    a, b = model(), model()
    opt_a = LionCub(a.parameters(), lr=1e-3, weight_decay=0.1, bucket_mb=BUCKET_MB)
    opt_b = lion_pytorch.Lion(b.parameters(), lr=1e-3, weight_decay=0.1)
    for net, opt in ((a, opt_a), (b, opt_b)):
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            opt.zero_grad()
            for _ in range(2):
                _backward(net, gen)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_buckets_without_a_flag_are_read_in_step(reads):
    """model.zero_grad() sets .grad to None, so backward writes new tensors, not the buckets' views; a parameter
    without a gradient leaves its bucket incomplete. Those buckets are read in step(), the others are not."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, bucket_mb=BUCKET_MB)
    n = len(opt.engine.buckets)
    gen = torch.Generator().manual_seed(1)
    net.zero_grad()
    _backward(net, gen)
    reads.clear()
    opt.step()
    assert len(reads) == n
    opt.zero_grad()
    x, y = _batch(gen)
    torch.nn.functional.cross_entropy(net[2](net[1](x @ net[0].weight.t())), y).backward()  # no bias-0 gradient
    flags = opt.engine.backward_check.flags(opt.engine.buckets)
    k = opt.engine.buckets.where[id(net[0].bias)][0]
    assert flags[k] is None and sum(f is not None for f in flags) >= 1
    bias = net[0].bias.detach().clone()
    reads.clear()
    opt.step()
    assert len(reads) == sum(f is None for f in flags)
    assert torch.equal(bias, net[0].bias)  # no gradient, left as it was


def test_no_check_without_skipping():
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, skip_nonfinite=False)
    assert opt.engine.backward_check is None


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit"])
def test_communicating_step_uses_the_check_and_skips_on_every_rank(method):
    """overlap=False, 3 Gloo ranks, a NaN loss on rank 1 at step 2: every rank skips it. The pre-pass (the check;
    for l1-pbit with its L1 scales) ran in backward: none in step(); with the flags made stale by an in-place
    no-op on every gradient, the pre-pass runs in step() and the parameters come out bit-identical."""
    used = spawn(finite_cases.train, 3, method, 1)
    stale = spawn(finite_cases.train, 3, method, 1, True)
    for r, s in zip(used, stale):
        assert [st["moved"] for st in r["steps"]] == [True, False, True, True] and r["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(r["params"], s["params"]))
        assert all(st["prepass"] > 0 for st in s["steps"])
        assert all(st["prepass"] == 0 for st in r["steps"])
    assert all(torch.equal(a, b) for a, b in zip(used[0]["params"], used[2]["params"]))


@pytest.mark.parametrize("edit", [None, "momentum", "beta1", "clip"])
def test_l1_scales_from_backward_hold_only_while_their_inputs_do(edit):
    """l1-pbit, 2 Gloo ranks, overlap=False, automatic buckets (step() exchanges runs of them): the L1 scales
    backward took give the bits the pre-pass in step() gives. A momentum or beta1 changed after backward, or
    clipping (which scales g), make step() compute them again (the check still holds), with the same result
    as when every flag is stale."""
    used = spawn(finite_cases.train, 2, "l1-pbit", None, False, 4, edit, True)
    stale = spawn(finite_cases.train, 2, "l1-pbit", None, True, 4, edit, True)
    for r, s in zip(used, stale):
        assert r["runs"] < r["buckets"]
        assert [st["prepass"] > 0 for st in r["steps"]] == [False, False, edit is not None, False]
        assert all(torch.equal(a, b) for a, b in zip(r["params"] + r["momenta"], s["params"] + s["momenta"]))
        assert all(st["moved"] for st in r["steps"])


def _checked_and_not(device="cpu"):
    """Two identical models, one under LionCub with its check, one under LionCub without any."""
    nets = [model().to(device), model().to(device)]
    return nets, [LionCub(nets[0].parameters(), lr=1e-2, bucket_mb=BUCKET_MB),
                  LionCub(nets[1].parameters(), lr=1e-2, bucket_mb=BUCKET_MB, skip_nonfinite=False)]


def _steps_read_nothing(reads, nets, opts, device="cpu", scale=1.0, clip=None):
    """Three steps of each (clipped to `clip`): the checked one's step() reads no gradient; both end equal."""
    for net, opt in zip(nets, opts):
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            x, y = _batch(gen)
            (torch.nn.functional.cross_entropy(net(x.to(device)), y.to(device)) * scale).backward()
            if clip is not None:
                assert opt.clip_grad_norm_(clip) > clip
            reads.clear()
            opt.step()
            assert reads == [] or opt is opts[1]
    assert all(torch.equal(p, q) for p, q in zip(*(n.parameters() for n in nets)))


def test_on_the_test_device_equal_to_no_check_and_skipping_a_nan(reads):
    """On LIONCUB_TEST_DEVICE (CUDA: the check runs on a side stream): steps after a checked backward equal
    those of an optimizer that never checks, step() reads no gradient, and a NaN loss skips its step."""
    nets, opts = _checked_and_not(DEVICE)
    _steps_read_nothing(reads, nets, opts, DEVICE)
    before = [p.detach().clone() for p in nets[0].parameters()]
    opts[0].zero_grad()
    x, y = _batch(torch.Generator().manual_seed(2))
    (torch.nn.functional.cross_entropy(nets[0](x.to(DEVICE)), y.to(DEVICE)) * float("nan")).backward()
    opts[0].step()
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, nets[0].parameters()))


@pytest.mark.parametrize("nan", [False, True])
def test_clipping_keeps_the_flags(reads, nan):
    """opt.clip_grad_norm_ scales by a factor in (0, 1], which keeps every element finite or not: step() still
    reads nothing; a NaN gradient (NaN norm: nothing scaled) still skips the step; the clipped steps equal an
    optimizer that never checks."""
    nets, opts = _checked_and_not()
    _steps_read_nothing(reads, nets, opts, scale=50.0, clip=0.1)  # (a norm well above 0.1: every step clipped)
    if nan:
        before = [p.detach().clone() for p in nets[0].parameters()]
        opts[0].zero_grad()
        _backward(nets[0], torch.Generator().manual_seed(2), float("nan"))
        opts[0].clip_grad_norm_(0.1)
        reads.clear()
        opts[0].step()
        assert reads == [] and opts[0].stats.skipped_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(before, nets[0].parameters()))


def test_under_a_loss_scaler_its_unscale_is_the_check(reads):
    """lioncub.GradScaler's unscale_ reads every gradient (and rewrites them): after its first unscale_ the hooks
    stop checking, step() takes unscale_'s verdict and reads nothing, and a step with an inf is skipped by the
    scaler. The steps equal those of an optimizer that never checks."""
    from lioncub import GradScaler

    nets, opts = _checked_and_not()
    out = []
    for net, opt in zip(nets, opts):
        scaler = GradScaler("cpu", init_scale=2.0**10)
        gen = torch.Generator().manual_seed(1)
        backward_reads, step_reads = [], []
        for step in range(4):
            opt.zero_grad()
            reads.clear()
            x, y = _batch(gen)
            scaler.scale(torch.nn.functional.cross_entropy(net(x), y) * (1e38 if step == 2 else 1.0)).backward()
            backward_reads.append(len(reads))
            scaler.unscale_(opt)
            reads.clear()
            scaler.step(opt)
            step_reads.append(len(reads))
            scaler.update()
        out.append((backward_reads, step_reads, scaler.get_scale()))
    assert out[0][0][0] == len(opts[0].engine.buckets) and out[0][0][1:] == [0, 0, 0]
    assert out[0][1] == [0, 0, 0, 0]
    assert out[0][2] == out[1][2] == 2.0**9  # the inf of the third step was found and the scale backed off
    assert all(torch.equal(p, q) for p, q in zip(*(n.parameters() for n in nets)))


def test_no_check_in_backward_where_step_would_not_read_it():
    """2 Gloo ranks, overlap=False: a dense step on several ranks checks their mean, so the hooks read nothing
    there; the vote methods' steps take the check, l1-pbit's the whole pre-pass (the check with its scales)."""
    n = {m: spawn(finite_cases.backward_reads, 2, m) for m in ("allreduce", "l1-pbit", "vote-1bit", "vote-pbit")}
    expected = {"allreduce": None, "l1-pbit": "prepass", "vote-1bit": "finite_flag", "vote-pbit": "finite_flag"}
    for m, out in n.items():
        for reads, buckets in out:
            assert reads == ({expected[m]: buckets} if expected[m] else {}), (m, reads, buckets)


@pytest.mark.parametrize("replaced", [False, True])
def test_a_nan_made_during_backward_skips_the_step(replaced):
    """A tensor hook makes one bias's gradient NaN during backward; with `replaced`, that .grad was a tensor of
    its own (not its view of the bucket) when backward wrote it. Either way the step is skipped."""
    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, bucket_mb=BUCKET_MB)
    net[0].bias.register_hook(lambda g: g * float("nan"))
    if replaced:
        net[0].bias.grad = torch.zeros(64)
    before = [p.detach().clone() for p in net.parameters()]
    _backward(net, torch.Generator().manual_seed(1))
    opt.step()
    assert opt.stats.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_a_loss_scale_below_one_is_not_taken_as_a_check(reads):
    """torch's unscale_ checks the scaled gradients: with a scale below 1 the unscaled ones may overflow, so step()
    reads them itself."""
    from lioncub import GradScaler

    net = model()
    opt = LionCub(net.parameters(), lr=1e-2, bucket_mb=BUCKET_MB)
    scaler = GradScaler("cpu", init_scale=0.5)
    opt.zero_grad()
    x, y = _batch(torch.Generator().manual_seed(1))
    scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
    scaler.unscale_(opt)
    reads.clear()
    scaler.step(opt)
    assert len(reads) == len(opt.engine.buckets)
