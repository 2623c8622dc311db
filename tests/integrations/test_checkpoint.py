"""lioncub.checkpoint on torch.distributed.checkpoint: per-rank momenta as rank-sharded entries; a resume on
the same world size is bit-exact; on another world size the documented policy (rank 0's momenta if they
were identical, else their average), said in the log, never silently."""

import logging

import local_cases as lc
import pytest
import safe_cases
import torch

from lioncub import LionCub, LocalSteps
from lioncub.comm.spawn import spawn
from lioncub.integrations import checkpoint


def test_save_on_two_resume_on_two_is_bit_exact_and_on_three_averages(tmp_path):
    path = str(tmp_path / "ckpt")
    full = spawn(safe_cases.ckpt_train, 2, None, 6, "vote-1bit", False, timeout=60)
    saved = spawn(safe_cases.ckpt_train, 2, path, 3, timeout=60)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    assert not torch.equal(saved[0]["momenta"], saved[1]["momenta"])  # vote-1bit: each rank its own momentum

    resumed = spawn(safe_cases.ckpt_train, 2, path, 3, "vote-1bit", False, True, 6, timeout=60)
    for a, b in zip(full, resumed):
        assert b["step"] == 6 and b["stats_steps"] == 6
        assert torch.equal(a["params"], b["params"]) and torch.equal(a["momenta"], b["momenta"])

    three = spawn(safe_cases.ckpt_loaded, 3, path, timeout=60)
    mean = ((saved[0]["momenta"] + saved[1]["momenta"]) / 2).float()
    for r in three:
        assert r["info"] == dict(saved_world_size=2, world_size=3, momenta="average", step=3, extra=None)
        assert r["step"] == 3 and torch.equal(r["params"], saved[0]["params"])
        assert torch.equal(r["momenta"], three[0]["momenta"])  # the new ranks start identical
        torch.testing.assert_close(r["momenta"], mean)
    assert any("average" in m for m in three[0]["messages"])  # said, not silent


def test_load_on_one_process(tmp_path, caplog):
    path = str(tmp_path / "ckpt")
    saved = spawn(safe_cases.ckpt_train, 2, path, 2, timeout=60)
    net = safe_cases.model()
    opt = LionCub(net.parameters(), lr=safe_cases.LR, method="vote-1bit", bucket_mb=safe_cases.BUCKET_MB)
    with caplog.at_level(logging.WARNING, logger="lioncub"):
        info = checkpoint.load(path, net, opt)
    assert info["momenta"] == "average" and opt.engine.steps == 2
    assert "average" in caplog.text
    torch.testing.assert_close(safe_cases.momenta(opt, net), (saved[0]["momenta"] + saved[1]["momenta"]) / 2)
    assert torch.equal(safe_cases.flat(net.parameters()), saved[0]["params"])
    # identical momenta (the allreduce method): rank 0's, exactly
    path2 = str(tmp_path / "dense")
    dense = spawn(safe_cases.ckpt_train, 2, path2, 2, "allreduce", timeout=60)
    net = safe_cases.model()
    opt = LionCub(net.parameters(), lr=safe_cases.LR, method="allreduce", bucket_mb=safe_cases.BUCKET_MB)
    assert checkpoint.load(path2, net, opt)["momenta"] == "rank0"
    assert torch.equal(safe_cases.momenta(opt, net), dense[0]["momenta"])


@pytest.mark.parametrize("world, method, outer", [(3, "l1-pbit", "nesterov"), (2, "vote-1bit", "sign:0.5:0.9"),
                                                  (4, "allreduce", "avg")])
def test_local_steps_resume_bit_exactly_mid_interval_and_at_the_boundary(tmp_path, world, method, outer):
    """LionCub(local=LocalSteps(3)), rank 1 skipping its local step 2 alone (an inf): saved after step 4 (mid-interval:
    the replicas differ, each resumes from its own parameters) and after step 3 (an outer step), loaded into a
    fresh model and optimizer, run to 7: every later step, the momenta, each rank's own residuals and counters,
    the anchor and the outer momentum equal the uninterrupted run's."""
    H, steps = 3, 7
    for cut in (4, 3):
        path = str(tmp_path / f"cut{cut}")
        reports = spawn(lc.dcp_resume_case, world, method, H, outer, steps, cut, path, (1, 2), timeout=180)
        for rank, r in enumerate(reports):
            assert r["same"] and r["same_state"] and r["steps"] == steps - cut, (cut, rank)
            assert r["loaded_own"] and r["info"]["momenta"] == "own" and r["info"]["step"] == cut, (cut, rank)
            assert r["counts"][0] == (1 if rank == 1 else 0)  # local skips: rank 1's alone
        apart = not torch.equal(reports[0]["at_cut"], reports[1]["at_cut"])
        assert apart == (cut % H != 0), cut  # mid-interval the replicas differ; after an outer step they agree
        if method != "allreduce":  # each rank's residual is its own (the dense outer step keeps none)
            assert not torch.equal(reports[0]["residual"], reports[1]["residual"]), cut
        else:
            assert reports[0]["residual"] is None


def test_local_steps_in_the_node_layout_resume_bit_exactly(tmp_path):
    """The node layout (node_size=2) with local steps: momentum shards, the node leaders' residuals, mid-interval
    and at the boundary (4 ranks in nodes of 2; rank 1's inf at step 2 makes its node skip that step)."""
    for cut in (4, 3):
        path = str(tmp_path / f"cut{cut}")
        reports = spawn(lc.dcp_resume_case, 4, "vote-1bit", 3, "nesterov", 7, cut, path, (1, 2), 2, timeout=240)
        for rank, r in enumerate(reports):
            assert r["same"] and r["same_state"] and r["steps"] == 7 - cut, (cut, rank)
            assert r["counts"][0] == (1 if rank < 2 else 0)  # the node of ranks 0 and 1 skipped step 2
        assert torch.equal(reports[0]["at_cut"], reports[1]["at_cut"])  # a node's ranks are one replica
        assert torch.equal(reports[0]["at_cut"], reports[2]["at_cut"]) == (cut % 3 == 0)
        assert not torch.equal(reports[0]["residual"], reports[2]["residual"])  # each node leader's own


def test_a_local_steps_checkpoint_refuses_another_world_size_or_options(tmp_path):
    path = str(tmp_path / "ckpt")
    spawn(lc.dcp_resume_case, 2, "vote-1bit", 3, "avg", 5, 4, path, timeout=120)
    params, opt = lc.make("vote-1bit", 3, "avg")
    with pytest.raises(ValueError, match=r"saved by 2 ranks with local steps; this optimizer has 1: .*same world"):
        checkpoint.load(path, torch.nn.ParameterList(params), opt)
    params = [torch.nn.Parameter(t.clone()) for t in lc.initial()]
    plain = LionCub(params, lr=lc.LR, method="vote-1bit", bucket_mb=lc.BUCKET_MB)
    with pytest.raises(ValueError, match="saved with local_steps=3; this optimizer has local_steps=None"):
        checkpoint.load(path, torch.nn.ParameterList(params), plain)
    params = [torch.nn.Parameter(t.clone()) for t in lc.initial()]
    other = LionCub(params, lr=lc.LR, method="vote-1bit", bucket_mb=1.0, local=LocalSteps(3, outer="avg"))
    with pytest.raises(ValueError, match="build it with the saved run's bucket_mb"):
        checkpoint.load(path, torch.nn.ParameterList(params), other)
