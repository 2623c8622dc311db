"""opt.clip_grad_norm_: one norm and one coefficient on every rank (RMS of the ranks' norms for compressed
methods, the norm of the mean for the dense one); the exact clip (exact=True) bit-identical with and without
overlap, overlapped while it does not bite, and no warning when it does (the default: test_clip_overlap)."""

import pytest
import safe_cases
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("method,world_size,warmup", [("vote-1bit", 2, 0), ("allreduce", 2, 0), ("l1-pbit", 3, 0),
                                                      ("vote-pbit", 2, 2), ("vote-1bit+hier", 4, 0)])
def test_clip_grad_norm_is_one_norm_on_every_rank(method, world_size, warmup):
    reports = spawn(safe_cases.clip_cases, world_size, method, (1e-3, 1e3), warmup, True, timeout=120)
    for key, r0 in reports[0].items():
        max_norm, overlap = key
        for rank, report in enumerate(reports):
            r = report[key]
            assert r["norms"] == r0["norms"], (key, rank)  # the same float on every rank
            assert r["norms"] == pytest.approx(r["refs"], rel=1e-5), (key, rank)  # the documented definition
            assert r["clipped_ok"] and r["replicas_equal"], (key, rank)
            assert not r["warned"], (key, rank)  # re-exchanging clipped gradients is expected: no warning
            other = report[(max_norm, not overlap)]
            assert torch.equal(r["params"], other["params"]), (key, rank)  # overlap or not: bit-identical
        if overlap:
            if method == "allreduce" or max_norm > 1:  # averaged gradients, or clipping did not bite
                assert r0["overlapped"] == 3, key
            elif not warmup:
                assert r0["overlapped"] == 0, key  # clipped: step() exchanged again
    assert all(n > 1e-3 for n in reports[0][(1e-3, True)]["norms"])  # it did bite


def test_clip_grad_norm_on_one_rank_is_torchs():
    nets = [safe_cases.model() for _ in range(2)]
    x, y = safe_cases.batch(0, 1)
    for net in nets:
        torch.nn.functional.mse_loss(net(x), y).backward()
    opt = LionCub(nets[0].parameters(), lr=0.01, method="vote-1bit")
    ours = opt.clip_grad_norm_(0.05)
    theirs = torch.nn.utils.clip_grad_norm_(nets[1].parameters(), 0.05)
    assert ours == pytest.approx(theirs.item(), rel=1e-6) and ours > 0.05
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(0.0)
