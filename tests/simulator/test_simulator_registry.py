"""A collective algorithm is one record: a toy algorithm defined here, registered the documented way
(registry.register, docs/simulator.md: Adding a collective algorithm), runs by name, under `auto`, in the
profile of its library, with its symmetry and its bound, without any other simulator file knowing it."""

import pytest
from lioncub.simulator import Cluster, get_profile, simulate_collective
from lioncub.simulator.collectives import registry
from lioncub.simulator.collectives.algorithm import Algorithm
from lioncub.simulator.collectives.choose import bound
from lioncub.simulator.profiles import BackendProfile

MiB = 2**20


def allreduce_direct(ctx, n):
    """Every rank sends its whole buffer to every other rank at once and sums what it receives."""
    p, r = ctx.p, ctx.r
    arrivals = []
    for k in range(1, p):
        ctx.send((r + k) % p, n, ("direct", k))
        arrivals.append(ctx.recv((r - k) % p, ("direct", k), n))
    yield ctx.env.all_of(arrivals)
    yield from ctx.reduce((p - 1) * n)


def direct_bound(h, n):
    """One message's hop; every NIC carries the p-1 copies of its buffer."""
    return h.cheapest(n), h.link_time("nic", (h.p - 1) * n)


DIRECT = Algorithm("allreduce", "direct", allreduce_direct, symmetry="cyclic", bound=direct_bound,
                   libraries=("nccl",))


@pytest.fixture
def direct():
    registry.register(DIRECT)
    try:
        yield DIRECT
    finally:
        registry.unregister(DIRECT)


def test_it_runs_by_name_and_matches_its_closed_form(direct):
    # ideal: no overheads; each NIC's p-1 flows out (and in) share its line rate, all ending together
    p, n, bw, lat = 8, 3 * MiB, 10e9, 50e-6
    cluster = Cluster(nodes=p, bandwidth=bw, latency=lat)
    r = simulate_collective(cluster, "allreduce", "direct", n, backend="ideal")
    assert r.seconds == pytest.approx(lat + (p - 1) * n / (bw / 8), rel=1e-12)
    assert r.bytes_sent_per_rank == (p - 1) * n and r.messages == p * (p - 1)
    # with a reduction speed, the sum of the p-1 received buffers follows
    gamma = get_profile("ideal").replace(reduce_bandwidth=4e9)
    r = simulate_collective(cluster, "allreduce", "direct", n, backend=gamma)
    assert r.seconds == pytest.approx(lat + (p - 1) * n / (bw / 8) + (p - 1) * n / 4e9, rel=1e-12)


def test_its_symmetry_is_used(direct):
    cluster = Cluster(nodes=12, gpus_per_node=2, bandwidth="10Gbit", latency="20us")
    fast = simulate_collective(cluster, "allreduce", "direct", MiB, backend="nccl")
    exact = simulate_collective(cluster, "allreduce", "direct", MiB, backend="nccl", exact=True)
    assert fast.simulated_ranks == 2 and exact.simulated_ranks == 24  # one rank per GPU of a node stands for all
    assert fast.seconds == pytest.approx(exact.seconds, rel=1e-12)
    assert fast.messages == exact.messages == 24 * 23


def test_its_bound_is_used_and_holds(direct):
    cluster = Cluster(nodes=16, bandwidth="10Gbit", latency="20us")
    for backend in ("ideal", "nccl", "gloo"):
        for n in (64, MiB, 64 * MiB):
            b = bound(cluster, get_profile(backend), "allreduce", "direct", n)
            prof = get_profile(backend)
            assert b["chain"] > 0 and b["bytes"] == pytest.approx(15 * n * 8 / 10e9 / prof.wire_efficiency)
            assert b["seconds"] <= simulate_collective(cluster, "allreduce", "direct", n, backend).seconds
    # auto on nccl (its library): a large buffer goes round the ring; the direct exchange's bound, 15 copies
    # of the buffer through each NIC, shows it cannot win without simulating it
    r = simulate_collective(cluster, "allreduce", "auto", 256 * MiB, backend="nccl")
    assert r.algorithm == "ring" and "direct" in r.pruned and "direct" not in r.candidates
    assert r.pruned["direct"]["lower_bound"] == bound(cluster, get_profile("nccl"), "allreduce", "direct",
                                                      256 * MiB)["seconds"]
    assert "bytes over the bottleneck link" in r.pruned["direct"]["reason"]


def test_auto_chooses_it_where_it_wins(direct):
    # a tiny buffer on a high-latency network: one latency instead of the ring's 2(p-1), the tree's 2 lg p
    cluster = Cluster(nodes=16, bandwidth="10Gbit", latency="1ms")
    r = simulate_collective(cluster, "allreduce", "auto", 1024, backend="nccl")
    assert r.algorithm == "direct" and set(r.pruned) == {"ring", "binomial-tree"}  # their bounds exceed it
    every = simulate_collective(cluster, "allreduce", "auto", 1024, backend="nccl", exact=True)
    assert set(every.candidates) == {"ring", "binomial-tree", "direct"} and every.algorithm == "direct"
    assert every.seconds == pytest.approx(r.seconds, rel=1e-12)
    assert r.seconds < min(every.candidates["ring"], every.candidates["binomial-tree"]) / 2
    # a composite's allreduce chooses it too
    v = simulate_collective(cluster, "l1-pbit", "auto", 4096, backend="nccl")
    assert v.parts[0]["algorithm"] == "direct"


def test_the_profiles_know_it(direct):
    assert get_profile("nccl").algorithms["allreduce"] == ["ring", "binomial-tree", "direct"]
    assert "direct" not in get_profile("gloo").algorithms["allreduce"]
    assert "direct" in get_profile("ideal").algorithms["allreduce"]  # every algorithm
    assert BackendProfile.from_dict({"algorithms": {"allreduce": ["direct"]}}).candidates("allreduce") == ["direct"]


def test_unregistered_it_is_unknown():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'direct'"):
        simulate_collective(Cluster(nodes=4), "allreduce", "direct", MiB)
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'direct'"):
        BackendProfile.from_dict({"algorithms": {"allreduce": ["direct"]}})
    assert "direct" not in get_profile("nccl").algorithms["allreduce"]


def test_bad_records_are_refused_in_one_line(direct):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(DIRECT)
    for kwargs, match in [(dict(op="gather"), "op must be one of"), (dict(name="auto"), "other than 'auto'"),
                          (dict(symmetry="mirror"), "symmetry must be"), (dict(libraries=("mpi",)), "libraries"),
                          (dict(program=None), "program must be"),
                          (dict(entry_order_matters=lambda p: True), "rendezvous form")]:
        fields = dict(op="allreduce", name="other", program=allreduce_direct) | kwargs
        with pytest.raises(ValueError, match=match):
            Algorithm(**fields)
    with pytest.raises(ValueError, match="Algorithm record"):
        registry.register(allreduce_direct)
