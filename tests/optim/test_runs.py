"""Runs of adjacent buckets (lioncub.optim.buckets.Run): what step() exchanges when nothing overlaps, bit for bit what
the buckets exchanged one by one give, in fewer collectives."""

import pytest
import run_cases
import torch

from lioncub import LionCub
from lioncub.comm.spawn import spawn
from lioncub.optim.buckets import BUCKET_ALIGN, Run
from lioncub.optim.buckets import plan as plan_runs

COMPRESSED = ["vote-1bit", "vote-pbit", "avg-pbit", "l1-pbit", "vote-allgather"]


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("method", COMPRESSED)
def test_runs_give_the_bits_of_the_buckets(method, world_size):
    alone = spawn(run_cases.steps, world_size, method, False, False)
    merged = spawn(run_cases.steps, world_size, method, True, False)
    for a, m in zip(alone, merged):
        assert a["buckets"] == m["buckets"] > 3
        assert all(torch.equal(x, y) for x, y in zip(a["params"], m["params"]))
        assert all(torch.equal(x, y) for x, y in zip(a["momenta"], m["momenta"]))
        assert m["replicas_equal"]
        # three dtypes: three runs, each one set of collectives, against a set per bucket
        assert all(x < y for x, y in zip(m["collectives"], a["collectives"]))


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit"])
def test_runs_when_gradients_are_set_by_hand_with_overlap_on(method):
    """overlap=True, but no backward ran: step() communicates, and exchanges runs (capped: several of them),
    with a momentum sync every other step."""
    alone = spawn(run_cases.steps, 4, method, False, True, 4, 1e6, 2)
    merged = spawn(run_cases.steps, 4, method, True, True, 4, 700, 2)
    for a, m in zip(alone, merged):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], m["params"]))
        assert all(torch.equal(x, y) for x, y in zip(a["momenta"], m["momenta"]))
        assert all(x < y for x, y in zip(m["collectives"], a["collectives"]))


def test_the_dense_method_over_runs_averages_the_same_gradients():
    alone = spawn(run_cases.steps, 3, "allreduce", False, False)
    merged = spawn(run_cases.steps, 3, "allreduce", True, False)
    for a, m in zip(alone, merged):
        for x, y in zip(a["momenta"], m["momenta"]):  # the same mean gradients, summed in another order
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-7)
        for x, y in zip(a["params"], m["params"]):  # a sign that rounding flips moves a coordinate by 2 lr
            torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=2.5e-2)
        assert m["replicas_equal"]
        assert all(x < y for x, y in zip(m["collectives"], a["collectives"]))


def _buckets(shapes, bucket_mb, dtypes=(torch.float32,)):
    params = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s in shapes for d in dtypes]
    return LionCub(params, bucket_mb=bucket_mb).engine.buckets


def test_plan_covers_the_buckets_in_order_within_the_cap():
    buckets = _buckets([(1000,)] * 9 + [(70000,)], 4000 / 2**20, (torch.float32, torch.bfloat16))
    plan = plan_runs(buckets.buckets, 10_000)
    assert sorted(k for run in plan for k in run) == list(range(len(buckets)))
    assert [run[0] for run in plan] == sorted(run[0] for run in plan)
    for run in plan:
        assert run == sorted(run)
        kinds = {(buckets[k].p.dtype, buckets[k].group_index) for k in run}
        assert len(kinds) == 1  # one buffer: one dtype of one group
        size = sum(buckets[k].n * buckets[k].p.element_size() for k in run)
        assert size <= 10_000 or len(run) == 1  # a bucket over the cap stands alone
    assert any(len(run) > 1 for run in plan)


def test_a_run_is_its_buckets_memory_with_the_padding_as_segments():
    buckets = _buckets([(5,), (3000,), (7,), (4100,), (1,)], 3000 * 4 / 2**20)
    run = Run(buckets, list(range(len(buckets))))
    for b in buckets:
        assert b.start % BUCKET_ALIGN == 0
        at = b.start - buckets[0].start
        for i, _, s, e in b.segments():
            assert b.param_view(i).data_ptr() == run.p[at + s : at + e].data_ptr()
            assert at + s in run.offsets and at + e in run.offsets
    assert run.offsets[0] == 0 and run.offsets[-1] == run.n == run.p.numel()
    assert run.offsets == sorted(set(run.offsets))
    # every parameter's segment and every gap are segments: the parameters plus one gap per bucket boundary
    gaps = sum(1 for a, b in zip(buckets.buckets, buckets.buckets[1:]) if b.start > a.start + a.n)
    assert len(run.offsets) - 1 == sum(len(b.params) for b in buckets) + gaps


def test_no_runs_in_the_node_layout_or_with_explicit_buckets():
    params = [torch.nn.Parameter(torch.zeros(3000)) for _ in range(4)]
    opt = LionCub(params, bucket_mb=3000 * 4 / 2**20)
    units, _ = opt.engine.step_units(opt.engine.spec)
    assert units is opt.engine.buckets  # the user chose the buckets: step() keeps them
    for b in opt.engine.buckets:
        b.base = None  # what the node layout's and FSDP's buckets are: shards, not slices of one buffer
    assert plan_runs(opt.engine.buckets.buckets, 2**30) is None
