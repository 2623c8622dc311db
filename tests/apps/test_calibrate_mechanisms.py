"""The simulator mechanisms calibration fits, against closed forms worked out by hand.

* link_burst: a NIC port is a token bucket of link_burst seconds of line time (Linux tbf): after idling
  it passes that much at (effectively) once, and it refills at the line rate while idle.
* rendezvous: a send waits for the receiver's ready notice (Gloo's TCP pairs); with
  rendezvous_stagger, the ranks enter one after another and pairs that exchange both ways on one
  connection take turns.
* codec_bandwidth: measured kernel speeds replace memory_bandwidth in the step model.
"""

import pytest
from lioncub.simulator import (
    BackendProfile,
    Cluster,
    get_profile,
    simulate_collective,
    simulate_step,
    simulate_transfers,
)
from lioncub.simulator.collectives.groups import Groups, cross_cluster
from lioncub.simulator.collectives.primitive import primitive
from lioncub.simulator.net.network import BURST_SPEEDUP

MiB = 2**20


def line(rate_bps: float) -> float:
    return rate_bps / 8  # bytes/s


# ---- burst credit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [100e6, 1e9])
@pytest.mark.parametrize("burst", [0.001, 0.004])
def test_a_transfer_after_idle_gets_the_bucket_at_once(rate, burst):
    w = 0.95
    prof = get_profile("ideal").replace(wire_efficiency=w, link_burst=burst)
    cluster = Cluster(nodes=2, bandwidth=rate, latency=0)
    C = line(rate)
    credit = burst * C * w  # payload bytes the bucket covers
    for m in (0.5 * credit, 3 * credit, 20 * credit):
        t = simulate_transfers(cluster, [(0, 1, m)], prof)
        if m <= credit:
            expected = m / (BURST_SPEEDUP * C * w)
        else:  # the bucket's share at memory speed, the rest at the line rate
            expected = credit / (BURST_SPEEDUP * C * w) + (m - credit) / (C * w)
        assert t == pytest.approx(expected, rel=2e-3)
    # no bucket: the line rate from the first byte
    flat = simulate_transfers(cluster, [(0, 1, 20 * credit)], prof.replace(link_burst=0.0))
    assert flat == pytest.approx(20 * credit / (C * w), rel=1e-9)


@pytest.mark.parametrize("gap_fraction", [0.25, 0.5, 2.0])
def test_the_bucket_refills_at_the_line_rate_while_the_port_idles(gap_fraction):
    # two messages on one connection; the sender's thread spends o on each before it enters the network,
    # so with o longer than the first transfer the port idles in between and refills for that long
    rate, burst = 1e9, 0.004
    C = line(rate)
    m = 3 * burst * C  # each message needs more than a full bucket
    t1 = burst / BURST_SPEEDUP + (m - burst * C) / C  # the first transfer: full bucket
    gap = gap_fraction * burst
    o = t1 + gap  # the second message enters `gap` after the first one has left
    prof = get_profile("ideal").replace(link_burst=burst, message_overhead=o)
    cluster = Cluster(nodes=2, bandwidth=rate, latency=0)
    got = simulate_transfers(cluster, [(0, 1, m), (0, 1, m)], prof)
    refill = min(gap, burst)  # seconds of line time regained while idle, capped by the bucket
    t2 = refill / BURST_SPEEDUP + (m - refill * C) / C
    assert got == pytest.approx(2 * o + t2, rel=2e-3)


def test_a_ring_allreduce_spends_the_bucket_once():
    # 2 ranks, no latency or overheads: every port is busy from start to end, so the bucket saves
    # exactly its own length of line time once
    rate, burst, n = 1e9, 0.002, 64 * MiB
    C = line(rate)
    cluster = Cluster(nodes=2, bandwidth=rate, latency=0)
    prof = get_profile("ideal").replace(link_burst=burst)
    t = simulate_collective(cluster, "allreduce", "ring", n, prof).seconds
    assert t == pytest.approx(n / C - burst + burst / BURST_SPEEDUP, rel=1e-3)


# ---- rendezvous ------------------------------------------------------------------------------------
def gloo_like(**kw) -> BackendProfile:
    return get_profile("ideal").replace(rendezvous=True, slice_bytes=float(MiB), **kw)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_small_gloo_allreduce_pays_a_handshake_per_segment(p):
    # a tiny buffer is cut into 2p segments; each phase runs 2p-2 iterations, two in flight, and each
    # segment needs a ready notice (one latency) before its data (another latency): every pair of
    # iterations takes 2L, so a phase takes (2p-2) L and the all-reduce 4(p-1) L.
    L = 1e-3
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=L)
    t = simulate_collective(cluster, "allreduce", "ring", 64, gloo_like()).seconds
    assert t == pytest.approx(4 * (p - 1) * L, rel=1e-3)
    # without the handshake the same ring (one slice per step) pays one latency per step: 2(p-1) L
    eager = simulate_collective(cluster, "allreduce", "ring", 64, gloo_like().replace(rendezvous=False)).seconds
    assert eager == pytest.approx(2 * (p - 1) * L, rel=1e-3)


@pytest.mark.parametrize("stagger", [0.0, 0.3, 1.0])
def test_two_ranks_take_turns_when_they_enter_apart(stagger):
    # all-to-all on 2 ranks: each sends n/2 to the other over one connection. Entering together, both
    # directions run at once: n/2 / C. Entering apart, the late rank's data goes out before its ready
    # notice, so the early rank's data waits for it: twice as long. The all-gather's half blocks
    # overlap one half: 1.5x.
    rate, n = 1e9, 16 * MiB
    C = line(rate)
    cluster = Cluster(nodes=2, bandwidth=rate, latency=0)
    prof = gloo_like(rendezvous_stagger=stagger)
    a2a = simulate_collective(cluster, "alltoall", "all-at-once", n, prof).seconds
    assert a2a == pytest.approx((1 - stagger) * (n / 2 / C) + stagger * (2 * n / 2 / C), rel=1e-3)
    ag = simulate_collective(cluster, "allgather", "ring", n, prof).seconds
    assert ag == pytest.approx((1 - stagger) * (n / 2 / C) + stagger * (1.5 * n / 2 / C), rel=1e-3)
    # the all-reduce posts each receive before its send: never serialized, entering apart or not
    ar = simulate_collective(cluster, "allreduce", "ring", n, prof).seconds
    assert ar == pytest.approx(n / C, rel=0.01)


def test_more_ranks_serialize_only_part_of_the_all_to_all():
    rate, n = 1e9, 16 * MiB
    C = line(rate)
    for p in (3, 4, 8):
        cluster = Cluster(nodes=p, bandwidth=rate, latency=0)
        bound = (p - 1) / p * n / C
        together = simulate_collective(cluster, "alltoall", "all-at-once", n, gloo_like()).seconds
        apart = simulate_collective(cluster, "alltoall", "all-at-once", n, gloo_like(rendezvous_stagger=1.0)).seconds
        assert together == pytest.approx(bound, rel=1e-3)
        assert 1.3 * bound < apart < 2 * bound  # some pairs take turns, never all of a rank's traffic
        # ring all-gather on p >= 3: data flows one way on each connection, nothing to serialize
        ag = simulate_collective(cluster, "allgather", "ring", n, gloo_like(rendezvous_stagger=1.0)).seconds
        assert ag == pytest.approx(bound, rel=0.01)


def test_nodes_of_several_ranks_take_turns_entering():
    # 2 nodes of 4 ranks: 16 pairs cross the link, each exchanging both ways on one connection, the late member's
    # data first. Staggered, the nodes take turns entering (a rank's lateness does not depend on its node): the
    # late member of 10 pairs is on node 1, of 6 on node 0, so both directions carry data from the start. Had
    # node 0's ranks all entered first, every pair would send one way, then the other: twice the bytes bound.
    rate, n, p, G = 1e9, 16 * MiB, 8, 4
    C = line(rate)
    cluster = Cluster.for_ranks(p, G, bandwidth=rate, latency=0)
    bound = G * (p - G) * (n / p) / C  # what a NIC carries out
    together = simulate_collective(cluster, "alltoall", "all-at-once", n, gloo_like()).seconds
    apart = simulate_collective(cluster, "alltoall", "all-at-once", n, gloo_like(rendezvous_stagger=1.0)).seconds
    assert together == pytest.approx(bound, rel=0.01)
    assert together < apart < 1.5 * bound


@pytest.mark.parametrize("nodes,G", [(2, 2), (2, 4), (4, 2)])
def test_cross_groups_enter_in_turns_and_the_fast_path_agrees(nodes, G):
    # the hierarchical layout's cross all-to-all: G groups of one rank per node share each NIC. The fast path
    # simulates one group standing for all G in lockstep; staggered, the groups start at different nodes
    # (runner._every_group simulates every group), as the exact run of every group on the whole cluster does
    cluster = Cluster.for_ranks(nodes * G, G, bandwidth=1e9, latency=0)
    n, C = 16 * MiB, line(1e9)
    prof = gloo_like(rendezvous_stagger=1.0)
    fast = primitive(cross_cluster(cluster), prof, "alltoall", "all-at-once", n, None).seconds
    exact = primitive(cluster, prof, "alltoall", "all-at-once", n, None, exact=True, groups=Groups("cross", G)).seconds
    assert fast == pytest.approx(exact, rel=1e-6)
    if nodes == 2:  # G pairs per NIC, each sending n/2: half of them go one way first, half the other
        bound = G * (n / 2) / C
        assert primitive(cross_cluster(cluster), gloo_like(), "alltoall", "all-at-once", n, None).seconds \
            == pytest.approx(bound, rel=0.01)
        assert fast < 1.25 * bound  # in lockstep: 2 x bound


def test_mechanisms_are_off_by_default_and_in_the_builtin_profiles():
    for name in ("ideal", "nccl", "gloo"):
        prof = get_profile(name)
        assert prof.link_burst == 0 and prof.rendezvous is False and prof.rendezvous_stagger == 0
        assert prof.codec_bandwidth == {}


# ---- codec speeds in the step model ------------------------------------------------------------------
def test_step_model_uses_measured_codec_speeds():
    P = 1_000_000
    cluster = Cluster(nodes=4, bandwidth="1Gbit", latency=0)
    base = get_profile("gloo")
    fast = simulate_step(cluster, "vote-pbit", params=P, compute_seconds=0.1, backend=base, memory_bandwidth=1e12)
    prof = base.replace(codec_bandwidth={"vote-pbit": 1e9, "update": 2e9})
    slow = simulate_step(cluster, "vote-pbit", params=P, compute_seconds=0.1, backend=prof, memory_bandwidth=1e12)
    # vote-pbit at 4 ranks: fields of (4*2).bit_length() = 4 bits, two per uint8; the codec reads m and g
    # (8 bytes), writes the packed fields and reads the summed ones (2 * 4/8 bytes): 9 bytes per parameter
    assert slow.codec_seconds == pytest.approx(9 * P / 1e9, rel=1e-9)
    assert slow.optimizer_seconds == pytest.approx(20 * P / 2e9, rel=1e-9)
    assert fast.codec_seconds == pytest.approx(9 * P / 1e12, rel=1e-9)
    assert slow.communication_seconds == pytest.approx(fast.communication_seconds, rel=1e-9)
    # a method the profile does not name keeps memory_bandwidth
    other = simulate_step(cluster, "l1-pbit", params=P, compute_seconds=0.1, backend=prof, memory_bandwidth=1e12)
    ref = simulate_step(cluster, "l1-pbit", params=P, compute_seconds=0.1, backend=base, memory_bandwidth=1e12)
    assert other.codec_seconds == pytest.approx(ref.codec_seconds, rel=1e-9)


@pytest.mark.parametrize("bad, match", [
    (dict(link_burst=-0.001), "link_burst"),
    (dict(link_burst=2.0), "link_burst"),
    (dict(rendezvous=1), "rendezvous must be true or false"),
    (dict(rendezvous_stagger=1.5), "rendezvous_stagger"),
    (dict(codec_bandwidth={"vote-9bit": 1e9}), "unknown kernel"),
    (dict(codec_bandwidth={"update": -1.0}), "codec_bandwidth"),
])
def test_bad_mechanism_values_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        BackendProfile.from_dict(bad, base="gloo")


@pytest.mark.parametrize("nodes, gpus", [(3, 1), (4, 1), (6, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("op, alg", [("allreduce", "ring"), ("allgather", "ring"), ("alltoall", "all-at-once")])
def test_rendezvous_representative_ranks_give_the_full_simulation(nodes, gpus, op, alg):
    # entering together the handshake is as symmetric as the eager algorithms: simulating one rank per
    # orbit must give exactly what simulating every rank gives
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus, bandwidth="1Gbit", latency="50us")
    prof = gloo_like(message_overhead=20e-6, call_overhead=40e-6, link_burst=0.001, reduce_bandwidth=4e9)
    for n in (64, 3 * MiB, 20 * MiB):
        fast = simulate_collective(cluster, op, alg, n, prof)
        full = simulate_collective(cluster, op, alg, n, prof, use_symmetry=False)
        assert fast.seconds == pytest.approx(full.seconds, rel=1e-9), n
        assert fast.messages == full.messages and fast.bytes_sent_per_rank == full.bytes_sent_per_rank
        assert fast.simulated_ranks <= gpus < full.simulated_ranks
