"""The sharded layout (HSDP) in the step model: simulate_step(sharded=True), simulator/step/sharded.py.

Oracles: the ring formulas written out here (bytes), the hierarchical layout's cross-node collectives as
simulate_collective costs them on the same shard (another code path: the methods' hierarchical_collectives),
and, on the ideal profile, step times assembled by hand from the collectives' own tallied times (which
collective waits for which is the mechanism under test).
"""

import pytest
from lioncub.simulator import Cluster, simulate_collective, simulate_step
from lioncub.simulator.profiles import get_profile

from lioncub.comm import wire

B, B_INTRA = 10e9, 80e9


def _cluster(nodes, g, intra=B_INTRA):
    return Cluster(nodes=nodes, gpus_per_node=g, bandwidth=B, latency=0, intra_bandwidth=intra, intra_latency=0)


def _seconds(r, what) -> list[float]:
    return [c["seconds"] for c in r.collectives if c["what"] == what]


@pytest.mark.parametrize("nodes,g", [(4, 2), (2, 4), (3, 8)])
def test_with_instant_node_links_the_step_is_the_hierarchical_cross_part(nodes, g):
    """Infinitely fast links inside the node and free kernels, the exchange after backward (overlap=False),
    no compute: what is left of a sharded vote-1bit step is the control message and, per unit, the method's
    collectives across nodes on the 1/G shard: the cross parts of the hierarchical layout's exchange of the
    same bucket (units of a multiple of 64 G elements, so both layouts cut the same shard)."""
    n, k = 64 * g * 1000, 3
    c = _cluster(nodes, g, intra=1e30)
    r = simulate_step(c, "vote-1bit", k * n, bucket_mb=4 * n / 2**20, compute_seconds=0, backend="ideal",
                      memory_bandwidth=1e30, overlap=False, sharded=True)
    hier = simulate_collective(c, "vote-1bit", "auto", 4 * n, "ideal", hierarchical=True)
    cross = sum(p["seconds"] for p in hier.parts if p["scope"] == "cross")
    control = simulate_collective(c, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, "ideal").seconds
    assert cross > 0 and r.buckets == k
    assert _seconds(r, "vote-1bit") == [pytest.approx(cross, rel=1e-12)]
    assert r.step_seconds == pytest.approx(control + k * cross, rel=1e-9)


@pytest.mark.parametrize("nodes,g,units", [(4, 2, [1000, 4000, 4000, 2000]), (2, 4, [4096, 8192]), (8, 8, [640])])
def test_bytes_are_the_ring_formulas(nodes, g, units):
    """Per rank inside the node: a reduce-scatter of every unit's fp32 gradients and the parameters'
    all-gathers, twice per unit but once for the root (unit 0), (G-1)/G of the unit each; across nodes for
    the baseline: the ring all-reduce of the fp32 shard, 2 (M-1)/M x 4 S, which every rank of the node sends
    through the NIC."""
    M, P = nodes, sum(units)
    r = simulate_step(_cluster(nodes, g), "allreduce", P, compute_seconds=0.01, backend="ideal", sharded=True,
                      units=units)
    shard = [-(-n // g) for n in units]
    node = sum((g - 1) * 4 * s * (1 + (2 if i else 1)) for i, s in enumerate(shard))
    cross = sum(2 * (M - 1) / M * 4 * s for s in shard)
    assert r.node_bytes_per_rank == pytest.approx(node)
    assert r.bytes_sent_per_rank == pytest.approx(node + cross)
    assert r.nic_bytes_per_node == pytest.approx(g * cross)


def test_the_baseline_is_fsdps_fp32_allreduce_of_the_shard_and_bf16_gathers_halve():
    P, g = 8 * 2**20, 4
    c, units = _cluster(4, g), [P // 2, P // 2]
    r = simulate_step(c, "vote-1bit", P, compute_seconds=0.05, backend="ideal", sharded=True, units=units)
    base = r.baseline
    assert base["sharded"] and base["method"] == "allreduce" and base["momentum_sync"] is None
    assert base["bytes_sent_per_rank"] - base["node_bytes_per_rank"] == pytest.approx(2 * 3 / 4 * 4 * P / g)
    assert r.speedup == pytest.approx(base["step_seconds"] / r.step_seconds)
    S = P // 2 // g
    scatter, gather = 2 * (g - 1) * 4 * S, 3 * (g - 1) * 4 * S  # the root is gathered once, the other unit twice
    assert base["node_bytes_per_rank"] == pytest.approx(scatter + gather)
    bf16 = simulate_step(c, "allreduce", P, compute_seconds=0.05, backend="ideal", sharded=True, units=units,
                         param_dtype="bfloat16")
    assert bf16.node_bytes_per_rank == pytest.approx(scatter + gather / 2)


def test_memory_per_rank_is_1_over_g():
    P = 4 * 2**20
    for g in (2, 4, 8):
        c = _cluster(2, g)
        r = simulate_step(c, "vote-1bit", P, compute_seconds=0.1, backend="ideal", sharded=True)
        assert r.memory_fraction == pytest.approx(1 / g)
        assert r.memory_bytes_per_rank == pytest.approx(12 * P / g)
        hier = simulate_step(c, "vote-1bit", P, compute_seconds=0.1, backend="ideal", hierarchical=True)
        assert hier.memory_fraction == pytest.approx((8 + 4 / g) / 12)
    flat = simulate_step(_cluster(2, 2), "vote-1bit", P, compute_seconds=0.1, backend="ideal")
    assert flat.memory_fraction == 1.0 and flat.memory_bytes_per_rank == 12 * P


def test_cpu_ranks_wait_for_every_fsdp_collective():
    """CPU ranks (codec_on_compute): FSDP2's collectives are synchronous, so with the baseline (no LionCub
    thread) the step is compute, every FSDP collective one after another, and the update."""
    prof = get_profile("ideal").replace(codec_on_compute=True)
    compute, units = 0.2, [200_000, 400_000, 400_000]
    r = simulate_step(_cluster(4, 2), "allreduce", sum(units), compute_seconds=compute, backend=prof, sharded=True,
                      units=units, memory_bandwidth=1e30)
    fsdp = sum(c["count"] * c["seconds"] for c in r.collectives)
    assert fsdp > 1e-3
    assert r.step_seconds == pytest.approx(compute + fsdp, rel=1e-9)
    assert r.fsdp_exposed_seconds == pytest.approx(fsdp, rel=1e-9) and r.exposed_communication_seconds == 0
    gpu = simulate_step(_cluster(4, 2), "allreduce", sum(units), compute_seconds=compute, backend="ideal",
                        sharded=True, units=units, memory_bandwidth=1e30)
    assert gpu.step_seconds < compute + fsdp / 2


def test_gpu_ranks_hide_fsdp_behind_compute_but_the_ends():
    """GPU ranks: with compute long enough, all that shows is the first forward all-gather, the all-gather of
    the first unit backward reaches (issued when forward ends), the root's reduce-scatter and all-reduce
    after its backward, and the update."""
    units, compute = [4096] * 4, 10.0
    r = simulate_step(_cluster(4, 2), "allreduce", sum(units), compute_seconds=compute, backend="ideal",
                      sharded=True, units=units, memory_bandwidth=1e30)
    ag, rs, ar = (_seconds(r, w)[0] for w in ("fsdp allgather", "fsdp reducescatter", "fsdp allreduce"))
    assert r.step_seconds == pytest.approx(compute + 2 * ag + rs + ar, rel=1e-9)
    assert r.fsdp_exposed_seconds == pytest.approx(2 * ag + rs + ar, rel=1e-9)


def test_overlap_hides_the_vote_behind_backward():
    c, P = _cluster(4, 4), 16 * 2**20
    kw = dict(compute_seconds=2.0, backend="ideal", sharded=True, bucket_mb=8)
    over, after = (simulate_step(c, "vote-1bit", P, overlap=o, **kw) for o in (True, False))
    votes = sum(x["count"] * x["seconds"] for x in after.collectives if x["what"] in ("vote-1bit", "control allreduce"))
    assert after.exposed_communication_seconds == pytest.approx(votes + after.codec_seconds, rel=1e-6)
    assert over.exposed_communication_seconds < after.exposed_communication_seconds / 2


def test_momentum_sync_is_the_shard_s_allreduce_amortized():
    c, P, K = _cluster(4, 2), 4 * 2**20, 10
    r0, rk = (simulate_step(c, "vote-1bit", P, k, compute_seconds=0.1, backend="ideal", sharded=True)
              for k in (None, K))
    assert rk.bytes_sent_per_rank - r0.bytes_sent_per_rank == pytest.approx(2 * 3 / 4 * 4 * P / 2 / K)


@pytest.mark.parametrize("kw, match", [
    (dict(cluster=Cluster(nodes=4, gpus_per_node=1)), "several ranks"),
    (dict(cluster=Cluster(nodes=1, gpus_per_node=4)), "one: give several nodes"),
    (dict(method="allreduce", momentum_sync=4), "momentum_sync does not apply"),
    (dict(hierarchical=True), "not with hierarchical"),
    (dict(local_steps=4), "not with hierarchical or local_steps"),
    (dict(units=[1, 2]), "add up to params"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(sharded=False, units=[2**20]), "give sharded=True"),
])
def test_bad_inputs_are_one_line_errors(kw, match):
    args = dict(cluster=Cluster(nodes=2, gpus_per_node=2), method="vote-1bit", params=2**20, compute_seconds=0.1,
                sharded=True)
    args.update(kw)
    with pytest.raises(ValueError, match=match) as e:
        simulate_step(**args)
    assert "\n" not in str(e.value)


def test_plain_fsdp_on_one_node_sends_nothing_across():
    r = simulate_step(Cluster(nodes=1, gpus_per_node=4), "allreduce", 2**20, compute_seconds=0.1, sharded=True)
    assert r.nic_bytes_per_node == 0 and r.bytes_sent_per_rank == r.node_bytes_per_rank > 0


def test_shared_cores_give_the_contention_phases_and_an_interval():
    from lioncub.simulator.step.hosts import HostModel

    host = HostModel(cores=2, shared_by="cluster", background=1.0, wake=1e-3, call_cpu=1e-3, byte_cpu=1e-9,
                     intra_bandwidth=8e9)
    prof = get_profile("gloo").replace(host=host.to_dict(), codec_on_compute=True, forecast_error=[-0.1, 0.2])
    c = Cluster(nodes=4, gpus_per_node=2, bandwidth="25Mbit", latency=0)
    r = simulate_step(c, "vote-1bit", 3_000_000, compute_seconds=0.5, backend=prof, sharded=True)
    assert r.contention["ranks_per_host"] == 8 and r.contention["compute"] > 0.5
    assert r.step_interval == pytest.approx((0.9 * r.step_seconds, 1.2 * r.step_seconds))
    again = simulate_step(c, "vote-1bit", 3_000_000, compute_seconds=0.5, backend=prof, sharded=True)
    assert again.step_seconds == r.step_seconds


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_step_is_the_processes_on_unshared_devices(seed):
    """simulate_step without a host takes the one-pass arithmetic (shardsim.unshared_step); the SimPy processes
    (ShardedSim, which the contention model runs) on devices nobody shares give the same figures for random
    plans: CPU and GPU ranks, with and without overlap, with LionCub's control message or without (the baseline),
    with the root's missing backward all-gather."""
    import random

    from lioncub.simulator.step.contention import Call
    from lioncub.simulator.step.sharded import UNSHARED, ShardedSim, unshared_step

    rng = random.Random(seed)

    def calls(k):
        return [Call("x", "ring", 1.0, rng.uniform(0, 0.02), 1.0, 2, 0.0) for _ in range(k)]

    plan = []
    for u in range(rng.randint(1, 7)):
        gather = calls(1)
        plan.append(dict(gather=gather, gather_back=gather if u else [], scatter=calls(1),
                         reduce=calls(rng.randint(0, 1)), cross=calls(rng.randint(0, 2)), sync=calls(1),
                         fwd=rng.uniform(0, 0.03), bwd=rng.uniform(0, 0.06), codec=rng.uniform(0, 0.01)))
    sync = [c for u in plan for c in u["sync"]]
    for synchronous in (False, True):
        for overlap in (False, True):
            for control in (None, calls(1)[0]):
                args = (plan, 0.004, control, sync, synchronous, overlap)
                sim = ShardedSim(UNSHARED, 1, plan, 0.004, control, sync, synchronous, overlap).run()
                one = unshared_step(*args)
                for k in ("step", "forward", "compute", "exposed", "update", "msync", "fsdp", "comm", "codec",
                          "computing", "fsdp_exposed", "device_seconds"):
                    assert one[k] == pytest.approx(sim[k], rel=1e-9, abs=1e-12), (k, synchronous, overlap, control)


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_the_sharded_steps_apply_runs_in_step_after_the_exchange(share):
    # as in the flat layout (test_simulator_hosts): `apply_share` moves that share of the codec, unit by unit,
    # from the communication thread into step(), where it replaces the Lion update; a dense step keeps its update
    from lioncub.simulator.step.hosts import HostModel

    def prof(**host):
        return get_profile("gloo").replace(host=HostModel(cores=1000.0, shared_by="node", **host).to_dict(),
                                           codec_on_compute=False, codec_bandwidth={"vote-1bit": 1e9, "update": 4e9})

    c = Cluster(nodes=4, gpus_per_node=2, bandwidth="25Mbit", latency=0)
    kw = dict(compute_seconds=0.5, sharded=True, memory_bandwidth="1TB/s")
    whole = simulate_step(c, "vote-1bit", 3_000_000, backend=prof(), **kw)
    split = simulate_step(c, "vote-1bit", 3_000_000, backend=prof(apply_share={"vote-1bit": share}), **kw)
    assert whole.codec_seconds > 0
    assert split.optimizer_seconds == pytest.approx(share * whole.codec_seconds, rel=1e-9, abs=1e-12)
    assert split.codec_seconds == pytest.approx((1 - share) * whole.codec_seconds, rel=1e-9, abs=1e-12)
    dense = [simulate_step(c, "allreduce", 3_000_000, backend=p, **kw).optimizer_seconds
             for p in (prof(), prof(apply_share={"vote-1bit": share}))]
    assert dense[0] == pytest.approx(dense[1])


@pytest.mark.parametrize("skew,cv", [(0.0, 0.1), (0.01, 0.0), (0.01, 0.2)])
def test_each_blocking_fsdp_collective_waits_for_its_latest_member(skew, cv):
    """CPU ranks run FSDP's collectives on the main thread: each starts when the latest of its m members arrives,
    E[max of m] x sqrt(start_skew^2 + (step_cv x compute)^2 x k) after the representative, k the share of the step's
    compute since the previous one (after which they are together again): closed form, on cores nobody waits for."""
    import math

    from lioncub.simulator.step.contention import Call
    from lioncub.simulator.step.hosts import HostModel, expected_max
    from lioncub.simulator.step.sharded import ShardedSim

    def call(m):
        return Call("x", "ring", 1.0, 0.002, 1.0, m, 0.0)

    fwd, bwd = [0.01, 0.03, 0.02], [0.02, 0.06, 0.04]
    plan = [dict(gather=[call(4)], gather_back=[call(4)] if u else [], scatter=[call(4)], reduce=[call(2)],
                 cross=[], sync=[], fwd=f, bwd=b, codec=0.0) for u, (f, b) in enumerate(zip(fwd, bwd))]
    compute = sum(fwd) + sum(bwd)
    host = HostModel(cores=1000.0, shared_by="node", step_cv=cv, start_skew=skew)
    still = HostModel(cores=1000.0, shared_by="node")
    run = [ShardedSim(h, 1, plan, 0.004, None, [], True, False, compute=compute).run() for h in (host, still)]

    def wait(c, since):
        return expected_max(c.members) * math.sqrt(skew ** 2 + (cv * compute) ** 2 * since / compute)

    since = waits = 0.0  # the main thread's blocking calls in order, with the compute since the previous one
    for u in plan:
        waits += sum(wait(c, since) for c in u["gather"])
        since = (0.0 if u["gather"] else since) + u["fwd"]
    for u in reversed(plan):
        waits += sum(wait(c, since if j == 0 else 0.0) for j, c in enumerate(u["gather_back"]))
        since = (0.0 if u["gather_back"] else since) + u["bwd"]
        waits += sum(wait(c, since if j == 0 else 0.0) for j, c in enumerate(u["scatter"] + u["reduce"]))
        since = 0.0
    assert run[0]["step"] - run[1]["step"] == pytest.approx(waits, rel=1e-9)
    assert run[0]["fsdp"] - run[1]["fsdp"] == pytest.approx(waits, rel=1e-9)
