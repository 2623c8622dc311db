"""Backend profiles: NCCL over TCP reproduces its published large-message behaviour, Gloo is markedly
slower at high latency, and calibration files round-trip and take effect."""

import json

import pytest
from lioncub.simulator import BackendProfile, Cluster, get_profile, simulate_collective

# Ethernet + IPv4 + TCP (with timestamps) at MTU 1500, written out independently of the code:
# 1448 payload bytes per 1500 + 14 + 4 + 8 + 12 = 1538 byte times on the wire.
TCP_GOODPUT = 1448 / 1538
GiB = 2**30


@pytest.mark.parametrize("nodes", [4, 8, 16])
@pytest.mark.parametrize("latency", [20e-6, 1e-3, 5e-3, 10e-3])
def test_nccl_ring_allreduce_is_bandwidth_term_plus_a_few_latencies(nodes, latency):
    bw = 10e9
    n = GiB
    cluster = Cluster(nodes=nodes, bandwidth=bw, latency=latency)
    t = simulate_collective(cluster, "allreduce", "ring", n, backend="nccl").seconds
    t_bw = 2 * (nodes - 1) / nodes * n / (bw / 8 * TCP_GOODPUT)
    assert t >= t_bw
    assert t <= 1.03 * t_bw  # within a few percent ...
    assert t - t_bw <= 3 * latency + 100e-6  # ... of the bandwidth term plus a constant number of latencies


def test_nccl_latency_term_does_not_grow_with_ranks_but_gloo_does():
    lat, n, bw = 5e-3, GiB, 10e9
    excess = {}
    for backend in ("nccl", "gloo"):
        for nodes in (4, 16):
            cluster = Cluster(nodes=nodes, bandwidth=bw, latency=lat)
            t = simulate_collective(cluster, "allreduce", "ring", n, backend=backend).seconds
            excess[backend, nodes] = t - 2 * (nodes - 1) / nodes * n / (bw / 8 * TCP_GOODPUT)
    assert abs(excess["nccl", 16] - excess["nccl", 4]) < lat
    # gloo: step by step, every one of the 2(p-1) steps waits at least one latency
    for nodes in (4, 16):
        assert excess["gloo", nodes] >= 2 * (nodes - 1) * lat


@pytest.mark.parametrize("nodes", [4, 8, 16])
def test_gloo_is_markedly_slower_than_nccl_at_high_latency(nodes):
    n = 256 * 2**20
    high = Cluster(nodes=nodes, bandwidth="10Gbit", latency="10ms")
    ratio = (simulate_collective(high, "allreduce", "ring", n, backend="gloo").seconds
             / simulate_collective(high, "allreduce", "ring", n, backend="nccl").seconds)
    assert ratio > 3
    # the mechanism: one socket per peer, capped at window / RTT
    g = get_profile("gloo")
    assert g.window_bytes / (2 * 10e-3) < 10e9 / 8 / 3
    # on a LAN the window does not bind and the two are within a small factor
    low = Cluster(nodes=nodes, bandwidth="10Gbit", latency="20us")
    ratio = (simulate_collective(low, "allreduce", "ring", n, backend="gloo").seconds
             / simulate_collective(low, "allreduce", "ring", n, backend="nccl").seconds)
    assert 1 <= ratio < 1.5


def test_small_messages_cost_latency_and_overheads():
    # a 4-byte allreduce is pure latency: ring pays 2(p-1) (latency + message overhead) + call overhead
    p, lat = 8, 50e-6
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=lat)
    for backend in ("nccl", "gloo"):
        prof = get_profile(backend)
        t = simulate_collective(cluster, "allreduce", "ring", 4, backend=prof).seconds
        expected = prof.call_overhead + 2 * (p - 1) * (lat + prof.message_overhead)
        assert t == pytest.approx(expected, rel=0.01)


def test_profile_json_round_trip(tmp_path):
    for name in ("ideal", "nccl", "gloo"):
        prof = get_profile(name)
        path = tmp_path / f"{name}.json"
        prof.save(path)
        back = BackendProfile.load(path)
        assert back == prof
        assert back.to_dict() == json.loads(path.read_text())


def test_partial_calibration_file_overlays_its_base(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"name": "gloo-fit", "window_bytes": 64 * 2**20, "message_overhead": 1e-4,
                                "efficiency": {"allreduce": 0.8}}))
    prof = BackendProfile.load(path, base="gloo")
    gloo = get_profile("gloo")
    assert prof.window_bytes == 64 * 2**20 and prof.message_overhead == 1e-4
    assert prof.reduce_bandwidth == gloo.reduce_bandwidth and prof.algorithms == gloo.algorithms
    assert prof.family_efficiency("allreduce") == 0.8 and prof.family_efficiency("alltoall") == 1.0
    # it takes effect: a bigger window makes gloo faster at high latency
    cluster = Cluster(nodes=4, bandwidth="10Gbit", latency="10ms")
    t_fit = simulate_collective(cluster, "allreduce", "ring", 2**28, backend=prof).seconds
    t_def = simulate_collective(cluster, "allreduce", "ring", 2**28, backend="gloo").seconds
    assert t_fit < t_def / 2


@pytest.mark.parametrize("bad", [
    {"window_bytes": -1}, {"wire_efficiency": 1.5}, {"channels": 0}, {"message_overhead": -1e-6},
    {"efficiency": {"allreduce": 0}}, {"efficiency": {"bogus": 0.5}}, {"algorithms": {"allreduce": ["nope"]}},
    {"no_such_field": 1},
])
def test_bad_calibration_is_a_clear_error(tmp_path, bad):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        BackendProfile.load(path, base="gloo")


def test_unreadable_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        BackendProfile.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        BackendProfile.load(tmp_path / "x.json")


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        get_profile("mpi")


def test_message_overhead_is_serialized_per_sender():
    # all-at-once all-to-all of tiny messages: each rank's thread spends o on each of its p-1 messages
    p, lat = 16, 50e-6
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=lat)
    prof = get_profile("gloo")
    t = simulate_collective(cluster, "alltoall", "all-at-once", 16 * p, backend=prof).seconds
    expected = prof.call_overhead + (p - 1) * prof.message_overhead + lat
    assert t == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("nodes", [4, 8, 16])
def test_nccl_ring_with_eight_gpus_per_node(nodes):
    # node-major ring: one flow per NIC, so busbw is still the NIC's goodput
    lat, n = 10e-3, GiB
    cluster = Cluster(nodes=nodes, gpus_per_node=8, bandwidth="10Gbit", latency=lat)
    p = cluster.ranks
    t = simulate_collective(cluster, "allreduce", "ring", n, backend="nccl").seconds
    t_bw = 2 * (p - 1) / p * n / (10e9 / 8 * TCP_GOODPUT)
    assert t_bw <= t <= 1.03 * t_bw and t - t_bw <= 3 * lat
