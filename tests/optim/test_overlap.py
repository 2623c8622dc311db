"""Overlap: the exchange that runs during backward gives the same parameters as the one inside step(), bit for
bit, for every method, with accumulation (no_sync), momentum sync, a non-finite step, a parameter unused on
some ranks and one frozen after construction; replicas stay identical."""

import dist_cases
import pytest
import replica_cases
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_overlap_is_bit_identical_to_communicating_in_step(world_size):
    reports = spawn(dist_cases.overlap_vs_step, world_size, timeout=600)
    for rank, report in enumerate(reports):
        for (method, sync), (over, plain) in report.items():
            where = (rank, method, sync)
            assert all(torch.equal(a, b) for a, b in zip(over["params"], plain["params"])), where
            assert all(torch.equal(a, b) for a, b in zip(over["momenta"], plain["momenta"])), where
            assert over["replicas_equal"] and plain["replicas_equal"], where
            if world_size > 1:  # the last rank's inf made every rank skip step 3, momenta untouched
                assert over["skipped"] == plain["skipped"] == 1, where
                assert over["skipped_momenta_same"] and plain["skipped_momenta_same"], where
                assert over["overlapped"] == 5 and plain["overlapped"] == 0, where  # every step overlapped


def test_no_sync_and_a_step_without_backward_fall_back_to_step():
    model = torch.nn.Linear(4, 2)
    opt = LionCub(model.parameters(), lr=0.1, method="vote-1bit")
    with opt.no_sync():  # world size 1: a no-op context
        model(torch.randn(3, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.allclose((model.weight - before).abs(), torch.full_like(before, 0.1))


def test_gradients_changed_after_backward_are_exchanged_again():
    reports = spawn(dist_cases.clipped_after_backward, 2)
    for r in reports:
        assert r["same_as_plain"] and r["replicas_equal"]


@pytest.mark.parametrize("method", ["vote-1bit", "allreduce"])
def test_a_model_that_communicates_in_backward_trains_as_without_overlap(method):
    """Tensor-parallel layers and SyncBatchNorm all-reduce during backward on the default group; the overlap's
    thread sends then too, on a group of its own, so the two never interleave (on one group they did, in a
    different order on each rank: 5 of 5 runs hung)."""
    over = spawn(replica_cases.collectives_in_backward, 2, method, True, timeout=120)
    plain = spawn(replica_cases.collectives_in_backward, 2, method, False, timeout=120)
    for a, b in zip(over, plain):
        assert torch.equal(a["params"], b["params"]) and a["replicas_equal"]
        assert a["overlapped"] == 4 and b["overlapped"] == 0


def test_overlapping_optimizers_share_one_group_of_their_own():
    for r in spawn(replica_cases.own_groups, 2, timeout=120):
        assert r == dict(shared=True, own=True, plain_on_world=True, ranks=[0, 1])
