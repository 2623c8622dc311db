"""Ranks that bring the same gradients (lioncub.optim.engine's check_replicas, lioncub.optim.backward's
wrapping_ddp): a model wrapped in torch DDP that LionCub was not attached to trains without a hang, and the same
data on every rank is reported once."""

import pytest
import replica_cases
import torch

from lioncub.comm.spawn import spawn
from lioncub.optim import backward, engine

DDP = "wrapped in DistributedDataParallel, which LionCub was not attached to"
SAME = "every rank brought the same gradients"


@pytest.mark.parametrize("method", ["vote-1bit", "vote-pbit"])
def test_ddp_without_attach_trains_as_lion_on_ddp_mean_without_a_hang(method):
    # before the check, DDP's all-reduces and LionCub's thread interleaved on one group: about half the runs hung
    out = spawn(replica_cases.ddp_without_attach, 2, method, timeout=180)
    for rank, r in enumerate(out):
        for run in r["runs"]:
            assert run["replicas_equal"] and run["overlapped"] == 0
            # every rank votes with DDP's mean: unanimous, so the update is Lion's on that mean
            assert run["err"] < 1e-6, run
        warned = [m for m in r["messages"] if DDP in m]
        assert len(warned) == (3 if rank == 0 else 0), r["messages"]
        assert not any(SAME in m for m in r["messages"])  # the DDP warning already says it


@pytest.mark.parametrize("method, overlap", [("vote-1bit", True), ("vote-pbit", False)])
def test_the_same_data_on_every_rank_is_reported_once(method, overlap):
    for shared in (True, False):
        out = spawn(replica_cases.same_data, 2, method, overlap, shared, timeout=120)
        said = [m for m in out[0]["messages"] if SAME in m]
        assert said == ([engine.SAME_GRADIENTS_WARNING % 1] if shared else []), out[0]["messages"]
        assert not any(SAME in m for m in out[1]["messages"])  # rank 0 speaks
        # one 32-byte message on the first step, none after
        counts = [r["collectives"] for r in out]
        assert counts[0] == counts[1] and counts[0][0] == counts[0][1] + 1 == counts[0][2] + 1


def test_the_check_waits_for_the_first_compressed_step():
    out = spawn(replica_cases.same_data, 2, "vote-1bit", True, True, 4, 2, timeout=120)
    assert [m for m in out[0]["messages"] if SAME in m] == [engine.SAME_GRADIENTS_WARNING % 3]


def test_wrapping_ddp_finds_the_ddp_of_these_parameters_only(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        inner, other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        assert backward.wrapping_ddp(inner.parameters()) is None
        model = torch.nn.parallel.DistributedDataParallel(inner)
        assert backward.wrapping_ddp(inner.parameters()) is model
        assert backward.wrapping_ddp(other.parameters()) is None
    finally:
        dist.destroy_process_group()


def test_fingerprint_tells_gradients_apart():
    a = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(engine.fingerprint([a]), engine.fingerprint([a.clone()]))
    assert not torch.equal(engine.fingerprint([a]), engine.fingerprint([a * 2]))
    assert engine.fingerprint([torch.zeros(4)])[1] == 0  # (all zero: never called the same)
