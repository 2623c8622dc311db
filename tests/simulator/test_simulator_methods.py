"""The simulator knows the communication methods only through lioncub.methods: its composite ops and the
codec kernels a profile may calibrate come from the registry, and a step costs any method, the baseline
included, by the collectives the method declares. So methods it has never seen (defined here, not
registered) are costed correctly, checked against the primitives simulated one by one."""

import pytest
from lioncub.simulator import BackendProfile, Cluster, simulate_collective, simulate_step
from lioncub.simulator.collectives.simulate import COMPOSITES, OPS

from lioncub import methods
from lioncub.comm import wire
from lioncub.methods.base import FieldMethod, Method

E = 1_000_000  # parameters: one bucket of 4 MiB
STEP = dict(params=E, bucket_mb=4.0, compute_seconds=0.01, backend="ideal", memory_bandwidth=2e12)


class Halves(Method):
    """A dense method that averages the gradients by a reduce-scatter and an all-gather."""

    name = "toy-halves"
    codec = None

    def collectives(self, n, world_size, levels=0, grad_dtype="float32"):
        if world_size == 1:
            return []
        nb = wire.DTYPE_BYTES[grad_dtype] * n
        return [wire.Collective("reducescatter", nb, grad_dtype), wire.Collective("allgather", nb, grad_dtype)]

    def codec_bytes_per_element(self, world_size, levels=0, grad_dtype="float32"):
        return 0.0


class Majority(FieldMethod):
    """vote-pbit under another name."""

    name = "toy-majority"
    codec = wire.Codec("fields", values="vote", decode="sign")


def _primitives(cluster, colls):
    """(seconds, algorithms) of each collective simulated on its own, the ideal profile, auto."""
    rs = [simulate_collective(cluster, c.op, "auto", c.nbytes, backend="ideal") for c in colls]
    return sum(r.seconds for r in rs), [r.algorithm for r in rs]


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_a_dense_method_is_costed_by_its_collectives(grad_dtype):
    cluster = Cluster(nodes=8, bandwidth="10Gbit", latency="30us")
    r = simulate_step(cluster, Halves(), grad_dtype=grad_dtype, overlap=False, **STEP)
    seconds, algs = _primitives(cluster, Halves().collectives(E, 8, grad_dtype=grad_dtype))
    assert r.method == "toy-halves" and r.communication_seconds == pytest.approx(seconds, rel=1e-12)
    assert r.momentum_sync_seconds == 0 and r.exposed_communication_seconds == pytest.approx(seconds, rel=1e-12)
    assert [(c["what"], c["algorithm"], c["size_bytes"]) for c in r.collectives] == [
        ("toy-halves", "+".join(algs), wire.DTYPE_BYTES[grad_dtype] * E)]
    # its speedup is over torch DDP, the baseline method's own step on the same cluster
    ddp = simulate_step(cluster, methods.BASELINE, **{**STEP, "bucket_mb": 25.0}, overlap=False)
    assert r.baseline_step_seconds == ddp.step_seconds and r.speedup == ddp.step_seconds / r.step_seconds


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_the_baseline_is_costed_like_any_other_method(grad_dtype):
    cluster = Cluster(nodes=6, bandwidth="10Gbit", latency="30us")
    base = methods.get(methods.BASELINE)
    r = simulate_step(cluster, methods.BASELINE, grad_dtype=grad_dtype, overlap=False, **STEP)
    seconds, algs = _primitives(cluster, base.collectives(E, 6, grad_dtype=grad_dtype))
    assert r.communication_seconds == pytest.approx(seconds, rel=1e-12)
    assert [(c["what"], c["algorithm"], c["size_bytes"]) for c in r.collectives] == [
        (methods.BASELINE, algs[0], wire.DTYPE_BYTES[grad_dtype] * E)]


def test_a_method_with_a_codec_is_costed_by_its_collectives_whatever_its_name():
    cluster = Cluster(nodes=4, gpus_per_node=2, bandwidth="10Gbit", latency="30us")
    for kw in (dict(overlap=True, momentum_sync=10), dict(overlap=False, momentum_sync=None),
               dict(hierarchical=True, momentum_sync=5)):
        toy = simulate_step(cluster, Majority(), **STEP, **kw)
        known = simulate_step(cluster, "vote-pbit", **STEP, **kw)
        assert toy.method == "toy-majority"
        for field in ("step_seconds", "communication_seconds", "exposed_communication_seconds", "codec_seconds",
                      "momentum_sync_seconds", "bytes_sent_per_rank", "nic_bytes_per_node", "speedup"):
            assert getattr(toy, field) == getattr(known, field), (kw, field)
        whats = [c["what"] for c in toy.collectives]
        assert "toy-majority" in whats and "control allreduce" in whats
    # flat, without overlap: the control allreduce, then the bucket's field allreduce, all exposed
    r = simulate_step(Cluster(nodes=8, bandwidth="10Gbit", latency="30us"), Majority(), overlap=False, **STEP)
    seconds, _ = _primitives(Cluster(nodes=8, bandwidth="10Gbit", latency="30us"),
                             [wire.CONTROL, *Majority().collectives(E, 8)])
    assert r.communication_seconds == pytest.approx(seconds, rel=1e-12)


def test_the_composites_and_codec_kernels_come_from_the_registry():
    assert COMPOSITES == (*methods.COMPRESSED, "momentum-sync")
    assert methods.BASELINE in OPS  # as the primitive collective of that name, not as a method
    r = simulate_collective(Cluster(nodes=4), "allreduce", "ring", 2**20, backend="ideal")
    assert r.algorithm == "ring" and r.parts == []
    for name in methods.COMPRESSED:
        assert simulate_collective(Cluster(nodes=4), name, "auto", 2**20).parts  # a composite
    # every registered method's codec speed is accepted from a calibration, and only kernels that exist
    speeds = {name: 1e9 for name in methods.NAMES} | {"update": 2e9, "vote": 3e9}
    assert BackendProfile(codec_bandwidth=speeds).codec_bandwidth == speeds
    with pytest.raises(ValueError, match="unknown kernel 'toy-majority' in codec_bandwidth"):
        BackendProfile(codec_bandwidth={"toy-majority": 1e9})
