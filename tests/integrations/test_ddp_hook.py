"""LionCub attached to torch DDP (lioncub.attach_ddp) gives the parameters LionCub gives alone, bit for bit,
whatever DDP's options, with accumulation under DDP's no_sync, a non-finite step and clipping of .grad."""

import dist_cases
import pytest
import torch

from lioncub.comm.spawn import spawn

DDP_OPTIONS = {
    "defaults": {},
    "bucket-view": {"gradient_as_bucket_view": True},
    "static-graph": {"static_graph": True},
    "find-unused": {"find_unused_parameters": True},
    "small-buckets": {"bucket_cap_mb": 0.001},
}


@pytest.mark.parametrize("option", list(DDP_OPTIONS))
@pytest.mark.parametrize("method, world_size", [("vote-1bit", 2), ("l1-pbit", 3), ("allreduce", 2),
                                                 ("vote-pbit", 4)])
def test_hook_mode_is_bit_identical_to_optimizer_mode(option, method, world_size):
    sync = 2 if method == "l1-pbit" else None
    for rank, (alone, hooked) in enumerate(spawn(dist_cases.hook_vs_optimizer, world_size, method, sync,
                                                 DDP_OPTIONS[option], timeout=300)):
        assert torch.equal(alone["flat"], hooked["flat"]), (rank, option, method)
        assert alone["replicas_equal"] and hooked["replicas_equal"]
        assert alone["skipped"] == hooked["skipped"] == 1
        assert hooked["overlapped"] == 4  # every step's vote ran during backward, clipping or not


@pytest.mark.parametrize("option", ["defaults", "find-unused"])
def test_hierarchical_hook_mode_is_bit_identical_to_optimizer_mode(option):
    for rank, (alone, hooked) in enumerate(spawn(dist_cases.hook_vs_optimizer, 4, "vote-1bit", 2,
                                                 DDP_OPTIONS[option], 4, dict(node_size=2),
                                                 timeout=300)):
        assert torch.equal(alone["flat"], hooked["flat"]), (rank, option)
        assert alone["replicas_equal"] and hooked["replicas_equal"]
        assert alone["skipped"] == hooked["skipped"] == 1
        assert hooked["overlapped"] == 4


def test_attach_ddp_rejects_what_it_cannot_serve():
    from lioncub import LionCub
    from lioncub.integrations.ddp import attach_ddp, unwrap_optimizer

    with pytest.raises(ValueError, match="DistributedDataParallel"):
        attach_ddp(torch.nn.Linear(2, 2), LionCub(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(ValueError, match="needs a lioncub.LionCub optimizer, got SGD"):
        unwrap_optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
