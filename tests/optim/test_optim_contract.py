"""torch.optim's contract, kept by LionCub across ranks: param groups added after construction."""

import contract_cases
import pytest
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("method, overlap", [("vote-1bit", True), ("l1-pbit", False), ("allreduce", True)])
def test_a_param_group_added_later_trains_on_every_rank(method, overlap):
    for r in spawn(contract_cases.add_param_group, 2, method, overlap, timeout=120):
        assert r["groups"] == 2 and r["replicas_equal"]
        assert r["moved"][:2] == [0.0, 0.0]  # not in the optimizer yet
        # Lion moves each element by lr (0.02) times |U| <= 1 (plus weight decay 0): some element by exactly lr
        assert all(m == pytest.approx(0.02) for m in r["moved"][2:]), r["moved"]
        assert all(s > 0 for s in r["momentum_of_second"])


def test_a_bad_param_group_is_refused_before_it_is_added():
    opt = LionCub(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3))], lr=-1.0))
    with pytest.raises(ValueError, match="LionCub supports fp32, bf16 and fp16 parameters"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]))
    assert len(opt.param_groups) == 1


def test_a_parameter_without_a_gradient_is_left_untouched_on_one_rank():
    """As torch optimizers skip .grad None: no weight decay, no momentum step (1.0 -> 0.997 in the report)."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = LionCub([p, q], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        (2 * q).sum().backward()
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(opt.state[p]["exp_avg"], torch.zeros(3))
    assert not torch.equal(q.detach(), torch.ones(3))
    opt.zero_grad(set_to_none=False)  # zeros are a gradient, as in torch
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("method, overlap", [("vote-1bit", True), ("vote-1bit", False), ("l1-pbit", True),
                                             ("allreduce", True), ("allreduce", False)])
def test_no_rank_used_it_untouched_some_rank_used_it_a_zero_gradient_elsewhere(method, overlap):
    for r in spawn(contract_cases.unused_parameters, 2, method, overlap, timeout=120):
        assert r["replicas_equal"] and r["skipped"] == 0
        assert r["moved"] == {"shared": True, "rank0": True, "never": False}, r["moved"]
        assert r["never_momentum"] in (None, [0.0, 0.0])


def test_untouched_in_the_node_layout():
    for r in spawn(contract_cases.unused_parameters, 4, "vote-1bit", True, dict(node_size=2),
                   timeout=120):
        assert r["replicas_equal"] and r["moved"] == {"shared": True, "rank0": True, "never": False}
