"""The forecast of the hsdp configurations (lioncub.apps.train.predict with the simulator's sharded layout), against
the byte count `lioncub train` reports for FSDP's collectives (sharding.fsdp_bytes, its own ring arithmetic)."""

import pytest
from lioncub.simulator import Cluster, simulate_step

from lioncub.apps.train import sharding
from lioncub.apps.train.loop import TrainConfig, build
from lioncub.apps.train.models import count_params
from lioncub.apps.train.predict import predict_step


@pytest.mark.parametrize("nodes,g", [(4, 2), (2, 4)])
def test_the_simulators_bytes_are_fsdp_bytes_for_the_same_model(nodes, g):
    cfg = TrainConfig(model="char-tiny", method="hsdp+lion", node_size=g)
    model = build(cfg)[0]
    units = sharding.unit_params(model)
    assert len(units) == 1 + len(model.blocks) and sum(units) == count_params(model)
    cross, node = sharding.fsdp_bytes(cfg, model, nodes * g)
    r = simulate_step(Cluster(nodes=nodes, gpus_per_node=g), "allreduce", sum(units), compute_seconds=0.1,
                      sharded=True, units=units)
    assert r.node_bytes_per_rank == pytest.approx(node, abs=1)
    assert r.bytes_sent_per_rank - r.node_bytes_per_rank == pytest.approx(cross, abs=1)


def test_hsdp_rows_are_forecast_with_the_sharded_baseline():
    P, kw = 3_220_480, dict(ranks=8, bandwidth="25Mbit", ranks_per_host=2, profile="gloo")
    units = sharding.unit_params(build(TrainConfig(model="char-small", method="hsdp+lion", block_size=32))[0])
    assert sum(units) == P
    lion = predict_step(TrainConfig(model="char-small", method="hsdp+lion", block_size=32), P, 0.5, **kw)  # its units
    vote = predict_step(TrainConfig(model="char-small", method="hsdp+vote-1bit"), P, 0.5, units=units, **kw)
    assert lion.sharded and lion.method == "allreduce" and lion.node_size == 2 and lion.buckets == 5
    assert vote.sharded and vote.method == "vote-1bit"
    assert vote.baseline_step_seconds == pytest.approx(lion.step_seconds)
    assert vote.step_seconds < lion.step_seconds  # 25 Mbit/s: the fp32 all-reduce of 1.6M elements per rank dominates
    assert lion.memory_fraction == pytest.approx(0.5)


def test_the_forecast_takes_the_hosts_as_nodes():
    cfg = TrainConfig(model="char-tiny", method="hsdp+vote-1bit", node_size=4)
    with pytest.raises(NotImplementedError, match="nodes are the hosts"):
        predict_step(cfg, 10**5, 0.1, ranks=8, bandwidth="25Mbit", ranks_per_host=2, units=[10**5], profile="gloo")
