"""Uncontended settings under the `ideal` profile: every algorithm's simulated time equals its textbook
alpha-beta-gamma expression (Thakur, Rabenseifner & Gropp 2005), written out here independently."""

import math

import pytest
from lioncub.simulator import Cluster, get_profile, simulate_collective

BW_BITS = 10e9
ALPHA = 50e-6
BETA = 8 / BW_BITS  # seconds per byte on a NIC
GAMMA = 1 / 20e9  # seconds per byte reduced
N = 64 * 2**20


def lg(p):
    return math.ceil(math.log2(p))


def formulas(p, n=N, a=ALPHA, b=BETA, g=GAMMA):
    f = (p - 1) / p
    return {
        ("allreduce", "ring"): 2 * (p - 1) * a + 2 * f * n * b + f * n * g,
        ("allreduce", "recursive-doubling"): lg(p) * (a + n * b + n * g),
        ("allreduce", "rabenseifner"): 2 * lg(p) * a + 2 * f * n * b + f * n * g,
        ("allreduce", "binomial-tree"): 2 * lg(p) * (a + n * b) + lg(p) * n * g,
        ("allgather", "ring"): (p - 1) * a + f * n * b,
        ("allgather", "recursive-doubling"): lg(p) * a + f * n * b,
        ("allgather", "bruck"): lg(p) * a + f * n * b,
        ("reducescatter", "ring"): (p - 1) * a + f * n * (b + g),
        ("reducescatter", "halving"): lg(p) * a + f * n * (b + g),
        ("alltoall", "pairwise"): (p - 1) * a + f * n * b,
        # every rank's downlink carries p-1 concurrent flows: the bandwidth term is shared, alpha paid once
        ("alltoall", "all-at-once"): a + f * n * b,
        ("broadcast", "binomial-tree"): lg(p) * (a + n * b),
        ("reduce", "binomial-tree"): lg(p) * (a + n * b + n * g),
    }


def ideal_gamma():
    return get_profile("ideal").replace(reduce_bandwidth=1 / GAMMA)


def agreement(cluster, op, alg, expected, **kw):
    got = simulate_collective(cluster, op, alg, N, backend=ideal_gamma(), **kw).seconds
    return got, abs(got - expected) / expected


@pytest.mark.parametrize("p", [2, 4, 8, 16, 32])
def test_power_of_two_closed_forms(p):
    cluster = Cluster(nodes=p, bandwidth=BW_BITS, latency=ALPHA)
    for (op, alg), expected in formulas(p).items():
        got, err = agreement(cluster, op, alg, expected)
        assert err < 0.01, f"p={p} {op}/{alg}: simulated {got:.6g} s, closed form {expected:.6g} s"


@pytest.mark.parametrize("p", [3, 5, 6, 12])
def test_any_p_closed_forms(p):
    cluster = Cluster(nodes=p, bandwidth=BW_BITS, latency=ALPHA)
    f = formulas(p)
    for key in [("allreduce", "ring"), ("allgather", "ring"), ("allgather", "bruck"),
                ("reducescatter", "ring"), ("alltoall", "pairwise"), ("alltoall", "all-at-once")]:
        got, err = agreement(cluster, *key, f[key])
        assert err < 0.01, f"p={p} {key}: {got} vs {f[key]}"


def test_folded_recursive_doubling_non_power_of_two():
    # MPICH: the extra ranks fold into their neighbours (one exchange of n), the largest power of two q
    # runs recursive doubling, and the result goes back (one more n): 4 (alpha + n beta) for p = 6 when
    # the phases are separated. Sends are eager, so the ranks that did not fold start the core early and
    # their messages overlap the folded ranks' exchanges: at most one more exchange.
    p, q = 6, 4
    phased = lg(q) * (ALPHA + N * BETA) + 2 * (ALPHA + N * BETA)
    r = simulate_collective(Cluster(nodes=p, bandwidth=BW_BITS, latency=ALPHA), "allreduce",
                            "recursive-doubling", N, backend="ideal")
    assert phased * 0.999 <= r.seconds <= phased + (ALPHA + N * BETA) * 1.001
    assert r.bytes_sent_per_rank == pytest.approx((lg(q) + 1) * N)  # a folded rank: core + fold-out


def test_binomial_tree_is_bounded_by_ceil_log_for_other_p():
    for p in (5, 6, 7):
        expected = formulas(p)[("allreduce", "binomial-tree")]
        got = simulate_collective(Cluster(nodes=p, bandwidth=BW_BITS, latency=ALPHA), "allreduce",
                                  "binomial-tree", N, backend=ideal_gamma()).seconds
        assert got <= expected * 1.000001


def test_hierarchical_closed_form():
    # G ranks per node: ring reduce-scatter inside the node, G concurrent rings between nodes on n/G
    # (they share the NIC, so each sees B/G), ring all-gather inside the node.
    nodes, G = 4, 4
    ai, bi = 3e-6, 8 / 400e9
    cluster = Cluster(nodes=nodes, gpus_per_node=G, bandwidth=BW_BITS, latency=ALPHA,
                      intra_bandwidth=400e9, intra_latency=ai)
    m = N / G
    intra_rs = (G - 1) * (ai + (m) * bi + m * GAMMA)
    inter = 2 * (nodes - 1) * ALPHA + 2 * (nodes - 1) / nodes * m * G * BETA + (nodes - 1) / nodes * m * GAMMA
    intra_ag = (G - 1) * (ai + m * bi)
    expected = intra_rs + inter + intra_ag
    got, err = agreement(cluster, "allreduce", "hierarchical", expected)
    assert err < 0.01, (got, expected)


def test_ring_with_gpus_per_node_pays_the_latency_once():
    # node-major ring over a free node fabric: only every G-th hop uses a NIC, and each rank forwards a
    # chunk as soon as it has it, so while chunk*beta > alpha the NIC hop is never idle: the whole ring
    # costs its bandwidth term plus one latency
    nodes, G = 4, 2
    cluster = Cluster(nodes=nodes, gpus_per_node=G, bandwidth=BW_BITS, latency=ALPHA,
                      intra_bandwidth=1e15, intra_latency=0.0)
    p = nodes * G
    assert N / p * BETA > ALPHA
    expected = 2 * (p - 1) / p * N * BETA + ALPHA
    got = simulate_collective(cluster, "allreduce", "ring", N, backend="ideal").seconds
    assert got == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("p", [4, 8])
def test_collective_bytes_per_rank(p):
    cluster = Cluster(nodes=p, bandwidth=BW_BITS, latency=ALPHA)
    f = (p - 1) / p
    sent = {
        ("allreduce", "ring"): 2 * f * N,
        ("allreduce", "rabenseifner"): 2 * f * N,
        ("allreduce", "recursive-doubling"): lg(p) * N,
        ("allgather", "ring"): f * N,
        ("allgather", "bruck"): f * N,
        ("alltoall", "pairwise"): f * N,
        ("reducescatter", "halving"): f * N,
    }
    for (op, alg), expected in sent.items():
        r = simulate_collective(cluster, op, alg, N, backend="ideal")
        assert r.bytes_sent_per_rank == pytest.approx(expected, rel=1e-9), (op, alg)


def test_single_rank_costs_nothing():
    r = simulate_collective(Cluster(nodes=1), "allreduce", "ring", N, backend="nccl")
    assert r.seconds == 0 and r.bytes_sent_per_rank == 0


def test_auto_picks_the_fastest_closed_form():
    for p, n, lat in [(16, 1024, 1e-3), (16, 512 * 2**20, 1e-6), (8, 2**20, 1e-4)]:
        cluster = Cluster(nodes=p, bandwidth=BW_BITS, latency=lat)
        f = formulas(p, n=n, a=lat, g=0.0)
        allreduce = {alg: t for (op, alg), t in f.items() if op == "allreduce"}
        r = simulate_collective(cluster, "allreduce", "auto", n, backend="ideal")
        assert r.seconds == pytest.approx(min(allreduce.values()), rel=0.01)
        assert allreduce[r.algorithm] == pytest.approx(min(allreduce.values()), rel=1e-6)
