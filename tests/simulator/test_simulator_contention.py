"""Contention: incast, NIC sharing, oversubscribed spines, window caps, and the symmetry batching."""

import pytest
from lioncub.simulator import Cluster, get_profile, simulate_collective, simulate_transfers

B = 10e9 / 8  # bytes/s of a 10 Gbit NIC
A = 20e-6
M = 8 * 2**20


def test_incast_shares_the_receivers_downlink():
    p = 8
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    t = simulate_transfers(cluster, [(s, 0, M) for s in range(1, p)])
    assert t == pytest.approx(A + (p - 1) * M / B, rel=1e-6)
    # the same messages to distinct receivers do not contend
    t = simulate_transfers(cluster, [(s, (s + 1) % p, M) for s in range(1, p)])
    assert t == pytest.approx(A + M / B, rel=1e-6)


def test_max_min_fairness_gives_leftover_capacity_to_unconstrained_flows():
    # flows 1->0 and 2->0 share 0's downlink; 2->3 shares 2's uplink with 2->0. Max-min: 1->0 and 2->0
    # get B/2 each, then 2->3 gets the other half of 2's uplink; when they finish it is alone.
    cluster = Cluster(nodes=4, bandwidth="10Gbit", latency=0.0)
    t = simulate_transfers(cluster, [(1, 0, M), (2, 0, M), (2, 3, 3 * M)])
    # first M/(B/2) seconds: 2->3 moves M bytes at B/2; the remaining 2M at B
    assert t == pytest.approx(2 * M / B + 2 * M / B, rel=1e-6)


def test_alltoall_incast_and_nic_sharing():
    p, n = 16, 64 * 2**20
    flat = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    r = simulate_collective(flat, "alltoall", "all-at-once", n, backend="ideal")
    # every downlink has p-1 incoming flows: the transfer takes (p-1) * n/p / B, not n/p / B
    assert r.seconds == pytest.approx(A + (p - 1) / p * n / B, rel=0.01)
    assert r.seconds > 10 * (A + n / p / B)
    # G ranks per node: a NIC carries G * (p - G) flows of n/p (intra-node flows use the node fabric)
    G = 4
    nodes = Cluster(nodes=p // G, gpus_per_node=G, bandwidth="10Gbit", latency=A, intra_bandwidth="10Tbit")
    r = simulate_collective(nodes, "alltoall", "all-at-once", n, backend="ideal")
    assert r.seconds == pytest.approx(A + G * (p - G) * (n / p) / B, rel=0.01)


def test_oversubscribed_spine_halves_cross_leaf_bandwidth():
    k = 4  # nodes per leaf, two leaves
    pairs = [(i, i + k, M) for i in range(k)] + [(i + k, i, M) for i in range(k)]
    for ratio, factor in ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0)):
        cluster = Cluster(nodes=2 * k, bandwidth="10Gbit", latency=A, topology="leaf-spine", nodes_per_leaf=k,
                          oversubscription=ratio)
        assert simulate_transfers(cluster, pairs) == pytest.approx(A + factor * M / B, rel=1e-6)
        # traffic inside a leaf does not touch the spine
        local = [(i, (i + 1) % k, M) for i in range(k)]
        assert simulate_transfers(cluster, local) == pytest.approx(A + M / B, rel=1e-6)


def test_oversubscribed_spine_all_to_all():
    # two leaves of k nodes, 2:1: each leaf uplink (k*B/2) carries k*k cross flows of n/p -> n/B
    k, n = 4, 32 * 2**20
    p = 2 * k
    one = Cluster(nodes=p, bandwidth="10Gbit", latency=A, topology="leaf-spine", nodes_per_leaf=k)
    two = Cluster(nodes=p, bandwidth="10Gbit", latency=A, topology="leaf-spine", nodes_per_leaf=k,
                  oversubscription=2.0)
    t1 = simulate_collective(one, "alltoall", "all-at-once", n, backend="ideal").seconds
    t2 = simulate_collective(two, "alltoall", "all-at-once", n, backend="ideal").seconds
    assert t1 == pytest.approx(A + (p - 1) / p * n / B, rel=0.01)
    assert t2 == pytest.approx(A + n / B, rel=0.01)


def test_window_caps_a_flow_at_window_over_rtt():
    lat = 5e-3
    cluster = Cluster(nodes=2, bandwidth="10Gbit", latency=lat)
    w = 2**20
    prof = get_profile("ideal").replace(window_bytes=w)
    t = simulate_transfers(cluster, [(0, 1, M)], backend=prof)
    assert t == pytest.approx(lat + M / (w / (2 * lat)), rel=1e-6)
    # more sockets, more windows
    t4 = simulate_transfers(cluster, [(0, 1, M)], backend=prof.replace(channels=4))
    assert t4 == pytest.approx(lat + M / (4 * w / (2 * lat)), rel=1e-6)


def test_wire_and_family_efficiency_scale_the_payload_rate():
    cluster = Cluster(nodes=2, bandwidth="10Gbit", latency=0.0)
    prof = get_profile("ideal").replace(wire_efficiency=0.9, efficiency={"p2p": 0.5})
    t = simulate_transfers(cluster, [(0, 1, M)], backend=prof)
    assert t == pytest.approx(M / (B * 0.9 * 0.5), rel=1e-9)


def test_hierarchical_beats_flat_when_intra_node_bandwidth_is_high():
    # a flat node-major ring puts 2(p-1)/p * n through every NIC, the hierarchical one 2(N-1)/N * n
    # (N nodes): with a fast node fabric that is the difference. (Not under gloo, whose intra-node
    # traffic goes through the CPU's socket layer at host_bandwidth, however fast the node fabric.)
    n = 64 * 2**20
    for nodes, bound in ((2, 0.6), (4, 0.85)):
        for backend in ("ideal", "nccl"):
            cluster = Cluster(nodes=nodes, gpus_per_node=8, bandwidth="10Gbit", latency="200us",
                              intra_bandwidth="2400Gbit")
            hier = simulate_collective(cluster, "allreduce", "hierarchical", n, backend=backend).seconds
            flat = simulate_collective(cluster, "allreduce", "ring", n, backend=backend).seconds
            assert hier < bound * flat, (nodes, backend, hier, flat)
            ideal_ratio = (2 * (nodes - 1) / nodes) / (2 * (8 * nodes - 1) / (8 * nodes))
            if backend == "ideal":
                assert hier / flat == pytest.approx(ideal_ratio, rel=0.02)


CASES = [
    ("allreduce", "ring"), ("allreduce", "rabenseifner"), ("allreduce", "recursive-doubling"),
    ("allreduce", "hierarchical"), ("allgather", "ring"), ("allgather", "bruck"),
    ("allgather", "recursive-doubling"), ("reducescatter", "halving"), ("alltoall", "pairwise"),
    ("alltoall", "all-at-once"),
]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("topology", ["switch", "leaf-spine"])
def test_symmetry_batching_matches_simulating_every_rank(backend, topology):
    kw = dict(topology="leaf-spine", nodes_per_leaf=2, oversubscription=3.0) if topology != "switch" else {}
    cluster = Cluster(nodes=8, gpus_per_node=2, bandwidth="10Gbit", latency="100us", intra_bandwidth="200Gbit",
                      **kw)
    n = 3 * 2**20 + 12345
    for op, alg in CASES:
        fast = simulate_collective(cluster, op, alg, n, backend=backend)
        full = simulate_collective(cluster, op, alg, n, backend=backend, use_symmetry=False)
        assert fast.simulated_ranks <= full.simulated_ranks == 16
        assert fast.seconds == pytest.approx(full.seconds, rel=1e-9), (op, alg)
        assert fast.bytes_sent_per_rank == pytest.approx(full.bytes_sent_per_rank, rel=1e-12)
        assert fast.messages == full.messages


def test_symmetric_timeline_matches_full_timeline():
    cluster = Cluster(nodes=4, gpus_per_node=2, bandwidth="10Gbit", latency="50us")
    a = simulate_collective(cluster, "allreduce", "ring", 2**20, backend="gloo", timeline=True)
    b = simulate_collective(cluster, "allreduce", "ring", 2**20, backend="gloo", timeline=True, use_symmetry=False)
    assert a.simulated_ranks == 2 and b.simulated_ranks == 8
    assert sorted(a.timeline) == list(range(8))
    for r in range(8):
        assert len(a.timeline[r]) == len(b.timeline[r])
        for x, y in zip(a.timeline[r], b.timeline[r]):
            assert x[0] == y[0] and x[3] == y[3] and x[4] == pytest.approx(y[4])
            assert x[1] == pytest.approx(y[1], abs=1e-12) and x[2] == pytest.approx(y[2], abs=1e-12)
    sends = [e for e in a.timeline[3] if e[0] == "send"]
    assert {e[3] for e in sends} == {4}  # rank 3 sends to its ring successor only
    assert max(e[2] for evs in a.timeline.values() for e in evs) <= a.seconds + 1e-12


def test_deterministic():
    cluster = Cluster(nodes=6, gpus_per_node=2, bandwidth="25Gbit", latency="1ms")
    for op, alg in [("allreduce", "binomial-tree"), ("alltoall", "all-at-once"), ("vote-1bit", "auto")]:
        a = simulate_collective(cluster, op, alg, 10**7, backend="nccl").to_dict()
        b = simulate_collective(cluster, op, alg, 10**7, backend="nccl").to_dict()
        assert a == b
