"""simulate_step(local_steps=H): the outer exchange of LionCub(local_steps=H), the method's collectives and the
control message every H steps after backward, amortized per step; checked against the primitives simulated
one by one."""

import pytest
from lioncub.simulator import Cluster, simulate_collective, simulate_step
from lioncub.simulator.step import OUTER_BYTES_PER_PARAM, UPDATE_BYTES_PER_PARAM

from lioncub import methods
from lioncub.comm import wire

E = 1_000_000  # parameters: one bucket of 4 MiB
MEM = 2e12
STEP = dict(params=E, bucket_mb=4.0, compute_seconds=0.01, backend="ideal", memory_bandwidth=MEM)


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit", "allreduce"])
def test_the_outer_exchange_is_amortized_over_h_steps(method):
    cluster = Cluster(nodes=4, bandwidth="10Mbit", latency="30us")
    meth, H = methods.get(method), 25
    r = simulate_step(cluster, method, local_steps=H, **STEP)
    parts = [simulate_collective(cluster, c.op, "auto", c.nbytes, backend="ideal")
             for c in meth.collectives(E, 4, meth.resolve_levels(4))]
    control = simulate_collective(cluster, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, backend="ideal")
    comm = (sum(p.seconds for p in parts) + control.seconds) / H
    codec = (meth.codec_bytes_per_element(4, meth.resolve_levels(4)) + OUTER_BYTES_PER_PARAM) * E / MEM / H
    assert r.local_steps == H and r.momentum_sync_seconds == 0
    assert r.communication_seconds == pytest.approx(comm, rel=1e-9)
    assert r.exposed_communication_seconds == pytest.approx(comm, rel=1e-9)
    assert r.codec_seconds == pytest.approx(codec, rel=1e-9)
    assert r.step_seconds == pytest.approx(0.01 + UPDATE_BYTES_PER_PARAM * E / MEM + codec + comm, rel=1e-9)
    assert r.bytes_sent_per_rank == pytest.approx(
        (sum(p.bytes_sent_per_rank for p in parts) + control.bytes_sent_per_rank) / H, rel=1e-9)
    assert all(c["per_step"] == 1 / H for c in r.collectives)
    every_step = simulate_step(cluster, method, overlap=False, **STEP)
    assert r.step_seconds < every_step.step_seconds  # on a slow link the interval pays


def test_local_steps_are_checked_and_free_on_one_rank():
    cluster = Cluster(nodes=4, bandwidth="10Mbit")
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="local_steps"):
            simulate_step(cluster, "vote-1bit", local_steps=bad, **STEP)
    with pytest.raises(ValueError, match="local_steps"):
        simulate_step(cluster, "vote-1bit", local_steps=4, momentum_sync=10, **STEP)
    one = simulate_step(Cluster(nodes=1, bandwidth="10Mbit"), "vote-1bit", local_steps=4, **STEP)
    assert one.communication_seconds == 0 and one.bytes_sent_per_rank == 0
