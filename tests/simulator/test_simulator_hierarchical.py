"""The hierarchical LionCub layout in the simulator: node and cross groups (simulator/collectives/groups.py), the step.

The oracle is hand-derived: on the ideal profile with zero latency every collective is its bytes through
its busiest link, and in the hierarchical layout the G cross groups' flows share each node's NIC.
"""

import pytest
from lioncub.simulator import Cluster, get_profile, simulate_collective, simulate_step

from lioncub import methods
from lioncub.comm import wire
from lioncub.methods.vote_1bit import chunk_bytes

RINGS = "reducescatter=ring,alltoall=all-at-once,allgather=ring"
B, B_INTRA = 10e9, 80e9  # bits/s


def _ideal(nodes, g, **kw):
    return Cluster(nodes=nodes, gpus_per_node=g, bandwidth=B, latency=0, intra_bandwidth=B_INTRA,
                   intra_latency=0, **kw)


@pytest.mark.parametrize("nodes,g", [(4, 4), (3, 2), (8, 8)])
def test_vote_1bit_hierarchical_matches_closed_forms(nodes, g):
    """reduce-scatter (G-1)/G * bytes / intra bandwidth; the cross all-to-all and all-gather with G flows
    on every NIC (bandwidth / G each); the all-gather of the agreed codes (G-1)/G * bytes / intra."""
    n = 2**20
    c = _ideal(nodes, g)
    M, S = nodes, wire.shard_elements(n, g)
    chunk = chunk_bytes(S, M)
    planes = wire.result_planes(M)
    nic, intra = B / 8, B_INTRA / 8
    rs = (g - 1) / g * (g * S * 4) / intra
    a2a = (M - 1) * chunk * g / nic  # each rank sends M-1 pieces; G ranks of a node share its NIC
    ag = (M - 1) * chunk * planes * g / nic
    ag_codes = (g - 1) / g * (g * methods.get("vote-1bit").agreed_bytes(S, M)) / intra
    r = simulate_collective(c, "vote-1bit", RINGS, 4 * n, "ideal", hierarchical=True)
    assert [p["scope"] for p in r.parts] == ["node", "cross", "cross", "node"]
    for part, want in zip(r.parts, (rs, a2a, ag, ag_codes)):
        assert part["seconds"] == pytest.approx(want, rel=1e-12)
    assert r.seconds == pytest.approx(rs + a2a + ag + ag_codes, rel=1e-12)

    msync = simulate_collective(c, "momentum-sync", "ring", 4 * n, "ideal", hierarchical=True)
    assert msync.seconds == pytest.approx(2 * (M - 1) / M * 4 * S * g / nic, rel=1e-12)


def test_nic_bytes_hierarchical_over_flat_is_the_derived_ratio():
    """Bytes out of a node's NIC per bucket, vote-1bit, rings: flat, the all-to-all sends G (N-G) pieces of
    c = n / 8N bytes and the node-major ring all-gather (N-1) c * planes (one hop of G leaves the node);
    hierarchical, each of the G cross groups sends (M-1) c' (1 + planes), c' = S / 8M = c here."""
    nodes, g, n = 8, 8, 2**20
    N, c = nodes * g, 2**20 // (8 * nodes * g)
    cl = _ideal(nodes, g)
    flat = simulate_collective(cl, "vote-1bit", "alltoall=all-at-once,allgather=ring", 4 * n, "ideal")
    hier = simulate_collective(cl, "vote-1bit", RINGS, 4 * n, "ideal", hierarchical=True)
    planes = wire.result_planes(N)
    assert flat.nic_bytes_per_node == pytest.approx(g * (N - g) * c + (N - 1) * c * planes, rel=1e-12)
    assert hier.nic_bytes_per_node == pytest.approx(g * (nodes - 1) * c * (1 + planes), rel=1e-12)
    assert hier.nic_bytes_per_node / flat.nic_bytes_per_node == pytest.approx(168 / 574, rel=1e-12)
    # per rank: what wire.traffic counts for the layout
    colls = methods.get("vote-1bit").hierarchical_collectives(n, N, g)
    assert hier.bytes_sent_per_rank == wire.traffic(colls, N, g)[0]


CLUSTERS = [
    dict(nodes=4, gpus_per_node=2),
    dict(nodes=6, gpus_per_node=3, latency="1ms"),
    dict(nodes=8, gpus_per_node=2, topology="leaf-spine", nodes_per_leaf=2, oversubscription=2.0),
]


@pytest.mark.parametrize("kw", CLUSTERS)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_fast_path_agrees_with_every_rank_simulated(kw, backend):
    """The fast path (one node alone; one cross group alone with its flows counted G times on the NIC) is
    the exact run of all G groups on the full cluster, within float round-off."""
    c = Cluster(bandwidth="10Gbit", **{"latency": "50us", **kw})
    for op in ("vote-1bit", "l1-pbit", "momentum-sync"):
        fast = simulate_collective(c, op, "auto", "3MiB", backend, hierarchical=True)
        exact = simulate_collective(c, op, "auto", "3MiB", backend, hierarchical=True, exact=True)
        assert fast.algorithm == exact.algorithm
        assert fast.seconds == pytest.approx(exact.seconds, rel=1e-9)
        assert fast.nic_bytes_per_node == pytest.approx(exact.nic_bytes_per_node, rel=1e-9)


STEP = dict(params=64 * 2**20, momentum_sync=10, compute_seconds=0.1)


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit", "vote-pbit"])
def test_one_rank_per_node_hierarchical_is_flat(method):
    """G = 1: no node collectives, one cross group of all N ranks, shards of the whole bucket (buckets a
    multiple of 64 elements): the flat step, with the flat mechanisms."""
    c = Cluster(nodes=16, gpus_per_node=1, bandwidth="10Gbit", latency="50us")
    flat = simulate_step(c, method, **STEP)
    hier = simulate_step(c, method, hierarchical=True, **STEP)
    assert hier.hierarchical and hier.node_size == 1 and not flat.hierarchical
    for k in ("step_seconds", "communication_seconds", "codec_seconds", "exposed_communication_seconds",
              "momentum_sync_seconds", "bytes_sent_per_rank", "nic_bytes_per_node"):
        assert getattr(hier, k) == pytest.approx(getattr(flat, k), rel=1e-12, abs=1e-15), k


def test_hierarchical_vote_1bit_beats_flat_at_8x8_on_10gbit():
    c = Cluster(nodes=8, gpus_per_node=8, bandwidth="10Gbit", latency="50us")
    kw = dict(params="350M", momentum_sync=100, compute_seconds=0.1)
    flat = simulate_step(c, "vote-1bit", **kw)
    hier = simulate_step(c, "vote-1bit", hierarchical=True, **kw)
    assert hier.step_seconds < 0.8 * flat.step_seconds
    assert hier.nic_bytes_per_node < 0.5 * flat.nic_bytes_per_node
    assert hier.baseline_step_seconds == flat.baseline_step_seconds  # torch DDP, flat, 25 MiB
    assert hier.node_size == 8 and hier.to_dict()["hierarchical"] is True


def test_hierarchical_codec_runs_on_the_shard():
    """Codec bytes per bucket: the method's bytes for N/G voters on the S-element shard, one pass over the
    bucket into the reduce-scatter (read fp32, write the wire dtype), the decode of G gathered shards."""
    c = Cluster(nodes=4, gpus_per_node=4, bandwidth="10Gbit")
    n, mem = 2**20, 1e12
    r = simulate_step(c, "vote-1bit", params=n, compute_seconds=0.1, bucket_mb=4, memory_bandwidth=mem,
                      hierarchical=True)
    m, S = methods.get("vote-1bit"), wire.shard_elements(n, 4)
    want = m.codec_bytes_per_element(4) * S + (4 + 4) * n + 4 * m.agreed_bytes(S, 4)
    assert r.codec_seconds == pytest.approx(want / mem, rel=1e-12)


def test_hierarchical_copy_into_the_reduce_scatter_runs_at_the_update_speed():
    """Where the codec is slower than a memory pass (CPU ranks: compute-bound), the copy of the bucket into the
    reduce-scatter runs at the Lion update's speed, the codec's own passes at the codec's."""
    c = Cluster(nodes=4, gpus_per_node=4, bandwidth="10Gbit")
    n, codec, update = 2**20, 4e9, 32e9
    prof = get_profile("nccl").replace(codec_bandwidth={"vote-1bit": codec, "update": update})
    r = simulate_step(c, "vote-1bit", params=n, compute_seconds=0.1, bucket_mb=4, backend=prof, hierarchical=True)
    m, S = methods.get("vote-1bit"), wire.shard_elements(n, 4)
    want = (m.codec_bytes_per_element(4) * S + 4 * m.agreed_bytes(S, 4)) / codec + (4 + 4) * n / update
    assert r.codec_seconds == pytest.approx(want, rel=1e-12)


def test_cluster_scale_runs_one_group_alone():
    """100,000 ranks, 8 per node: a node's collectives simulate its 8 ranks, a cross group's one process."""
    c = Cluster.for_ranks(100_000, gpus_per_node=8, bandwidth="100Gbit", latency="20us")
    r = simulate_collective(c, "vote-1bit", "auto", "25MiB", "nccl", hierarchical=True)
    assert [p["scope"] for p in r.parts] == ["node", "cross", "cross", "node"]
    assert r.simulated_ranks <= 8 and r.seconds > 0


def test_refusals():
    c = Cluster(nodes=2, gpus_per_node=2)
    with pytest.raises(ValueError, match="compressed"):
        simulate_step(c, "allreduce", params="1M", compute_seconds=0.1, hierarchical=True)
    with pytest.raises(ValueError, match="composite"):
        simulate_collective(c, "allreduce", "ring", "1MiB", hierarchical=True)
