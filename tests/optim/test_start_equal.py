"""Replicas start equal, as DDP guarantees (issue 51, item 1): before its first update LionCub checks the ranks'
parameters in one 16-byte all-reduce of a fingerprint of their bytes; ranks that differ all take rank 0's, with
one warning. Every path: the flat layout's methods, no overlap, a dense warm-up, the node layout, local steps
and torch DDP (attach_ddp), on 2 and 4 Gloo ranks."""

import pytest
import start_equal_cases as cases
import torch

from lioncub import LionCub
from lioncub.comm import transport
from lioncub.comm.spawn import spawn
from lioncub.optim.layout import bytes_fingerprint

ON_2 = ["vote-1bit", "l1-pbit", "allreduce", "no-overlap", "warmup", "local", "ddp"]
ON_4 = ["vote-1bit", "l1-pbit", "node", "local"]


@pytest.mark.parametrize("path,world", [(p, 2) for p in ON_2] + [(p, 4) for p in ON_4])
def test_ranks_seeded_apart_train_as_one(path, world):
    reports = spawn(cases.run, world, path, True, timeout=120)
    for rank, r in enumerate(reports):
        assert r["equal"] and all(r["equal"]), (path, rank)
        assert r["calls"][cases.CHECK] == 1, (path, rank)
        if path == "ddp":  # DDP broadcast at construction: nothing to fix
            assert cases.FIX not in r["calls"] and not r["warnings"], rank
        else:
            assert r["calls"][cases.FIX] == r["buckets"], (path, rank)
            assert len(r["warnings"]) == (rank == 0), (path, rank)  # one line, rank 0's
    if path != "ddp":
        assert "lioncub.broadcast_parameters(model)" in reports[0]["warnings"][0]


def compare(rank, world_size, path):
    return [cases.run(rank, world_size, path, False, check) for check in (True, False)]


@pytest.mark.parametrize("path,world", [("vote-1bit", 2), ("local", 2), ("vote-1bit", 4), ("node", 4)])
def test_equal_replicas_cost_one_small_collective(path, world):
    for rank, (checked, unchecked) in enumerate(spawn(compare, world, path, timeout=120)):
        assert all(checked["equal"]) and not checked["warnings"], rank
        extra = {k: n - unchecked["calls"].get(k, 0) for k, n in checked["calls"].items()}
        assert {k: n for k, n in extra.items() if n} == {cases.CHECK: 1}, (path, rank)


def test_one_process_checks_nothing():
    transport.record_call_times(False)
    transport.record_call_times(True)
    try:
        net = cases.model(0)
        opt = LionCub(net.parameters(), lr=0.01, method="vote-1bit")
        net(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        assert cases.CHECK not in transport.call_times()
    finally:
        transport.record_call_times(False)


def test_the_fingerprint_sees_any_word_and_any_swap():
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1000, generator=gen), torch.randn(37, generator=gen).bfloat16()]
    f = bytes_fingerprint(base)
    assert f.dtype == torch.int64 and torch.equal(f, bytes_fingerprint([t.clone() for t in base]))
    for t, i in ((0, 0), (0, 999), (1, 5)):
        changed = [x.clone() for x in base]
        changed[t][i] = changed[t][i].nextafter(torch.tensor(float("inf"), dtype=changed[t].dtype))
        assert not torch.equal(bytes_fingerprint(changed), f), (t, i)
    swapped = [x.clone() for x in base]
    swapped[0][[3, 700]] = swapped[0][[700, 3]]
    assert not torch.equal(bytes_fingerprint(swapped), f)
    signed = [torch.zeros(4), torch.tensor([0.0, -0.0, 0.0, 0.0])]  # the bytes, not the values
    assert not torch.equal(bytes_fingerprint(signed[:1]), bytes_fingerprint(signed[1:]))
    moved = [torch.cat([base[0][1:], base[0][:1]])]  # the same words, in another order
    assert not torch.equal(bytes_fingerprint(moved), bytes_fingerprint(base[:1]))
