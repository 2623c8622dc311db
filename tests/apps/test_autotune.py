"""`lioncub autotune`'s search, risk rule and config, checked against direct simulator calls and LionCub."""

from __future__ import annotations

import math

import pytest
from lioncub.simulator import Cache, Cluster, get_profile, simulate_step

from lioncub import methods
from lioncub.apps import autotune
from lioncub.optim import schedules

SCHEDS = ["none", "every:4", "every:16"]  # schedules the simulator takes directly (int K)


def oracle_step(cluster, c, params, compute, backend="nccl", cache=None, memory_bandwidth="2TB/s"):
    """simulate_step's step time for a candidate (every:K / none only)."""
    k = None if c.momentum_sync == "none" else int(c.momentum_sync.split(":")[1])
    return simulate_step(cluster, c.method, params, k, c.bucket_mb, compute, backend=backend,
                         hierarchical=c.layout == "hierarchical", sharded=c.layout == "sharded", levels=c.levels,
                         memory_bandwidth=memory_bandwidth, cache=cache).step_seconds


WARMUP = {"low": 0, "medium": 200, "high": 500}  # dense warm-up steps by risk level, at most a tenth of the run


def oracle_run_step(cluster, c, params, compute, step, steps=10_000, cache=None, **kw):
    """The mean step over the planned run: the dense warm-up the config recommends (allreduce steps in the
    candidate's buckets), then the candidate's step."""
    if methods.get(c.method).dense:
        return step
    k = min(WARMUP[c.risk["level"]], steps // 10)
    dense = simulate_step(cluster, "allreduce", params, None, c.bucket_mb, compute, cache=cache,
                          sharded=c.layout == "sharded", **kw).step_seconds
    return (k * dense + (steps - k) * step) / steps


def check_against_simulator(res, cluster, params, compute, max_risk=math.inf, **kw):
    """Every candidate's step equals simulate_step's, and its mean over the run adds the dense warm-up;
    `ranked` is exactly the candidates within the risk bound, sorted by that mean."""
    cache = Cache()
    oracle = {id(c): oracle_step(cluster, c, params, compute, cache=cache, **kw) for c in res.candidates}
    run = {id(c): oracle_run_step(cluster, c, params, compute, oracle[id(c)], cache=cache,
                                  **{k: v for k, v in kw.items() if k == "backend"})
           for c in res.candidates}
    for c in res.candidates:
        assert c.step_seconds == pytest.approx(oracle[id(c)], rel=1e-12), c.label()
        assert c.run_step_seconds == pytest.approx(run[id(c)], rel=1e-12), c.label()
    eligible = [c for c in res.candidates if c.risk["score"] <= max_risk]
    assert {id(c) for c in res.ranked} == {id(c) for c in eligible}
    times = [run[id(c)] for c in res.ranked]
    assert times == sorted(times)
    assert res.ranked[0].run_step_seconds == pytest.approx(min(run[id(c)] for c in eligible), rel=1e-12)


def test_fast_network_small_model_recommends_the_baseline():
    # 25M parameters on 100 Gbit/s: every method's communication hides behind backward, so the compressed
    # ones save at most a few percent, which does not pay for their convergence risk
    cluster = Cluster.for_ranks(8, bandwidth="100Gbit", latency="5us")
    params, compute = 25_000_000, 0.05
    res = autotune.search(cluster, params, compute, momentum_syncs=SCHEDS, bucket_mbs=[4, 25])
    check_against_simulator(res, cluster, params, compute)
    expected = {("allreduce", None, "none", b) for b in (4, 25)}  # the search space
    for m in methods.NAMES[1:]:
        # more levels than the default only where the rule extrapolates in N (it gives them no benefit)
        l1 = autotune.l1_levels_candidates(8) if 8 > autotune.MEASURED_AT else [127 // 8]
        for lv in (l1 if m == "l1-pbit" else [None]):
            expected |= {(m, lv, s, b) for s in SCHEDS for b in (4, 25)}
    assert {(c.method, c.levels, c.momentum_sync, c.bucket_mb) for c in res.candidates} == expected
    best_ar = next(c for c in res.ranked if c.method == "allreduce")
    assert best_ar.step_seconds / res.ranked[0].step_seconds < 1.05
    rec, verdict = autotune.recommend(res)
    assert rec is best_ar and "does not pay" in verdict

    # 2M parameters (one bucket, nothing to overlap): a 1-bit vote is a few percent faster, which does not
    # pay for its convergence risk: the baseline is recommended, and the verdict says so
    res = autotune.search(cluster, 2_000_000, compute, momentum_syncs=SCHEDS, bucket_mbs=[4, 25])
    check_against_simulator(res, cluster, 2_000_000, compute)
    best_ar = next(c for c in res.ranked if c.method == "allreduce")
    assert 1.0 < best_ar.step_seconds / res.ranked[0].step_seconds < 1.10
    rec, verdict = autotune.recommend(res, min_speedup=1.10)
    assert rec is best_ar and "does not pay enough" in verdict
    assert autotune.recommend(res, min_speedup=1.0)[0] is res.ranked[0]


@pytest.mark.parametrize("steps", [100, 10_000])
def test_adaptive_guard_is_priced_as_its_dense_start_and_its_whole_credit(steps):
    # the guard's cost at worst: momentum_lead_step(0.9, 0.99) = 12 dense steps, then syncs for every byte of
    # credit (budget 1: the method's own bytes per compressed step, less the start's); a short run earns none
    cluster = Cluster.for_ranks(4, bandwidth="1Gbit", latency="50us")
    params, compute = 50_000_000, 0.1
    res = autotune.search(cluster, params, compute, steps=steps, methods=["vote-1bit"], bucket_mbs=[25],
                          momentum_syncs=["adaptive"], batch_size=32, lr=2.5e-4, tuned_lr=5e-4)  # a gentle regime
    assert res.candidates[0].risk["level"] == "low"
    (c,) = res.candidates
    sim = lambda method, k: simulate_step(cluster, method, params, k, 25, compute)
    plain, every, dense = sim("vote-1bit", None), sim("vote-1bit", 1), sim("allreduce", None)
    credit = plain.bytes_sent_per_rank * (steps - 12) - 12 * dense.bytes_sent_per_rank
    syncs = max(0, math.floor(credit / (every.bytes_sent_per_rank - plain.bytes_sent_per_rank)))
    assert (syncs > 0) == (steps == 10_000)
    assert c.dense_steps == 12 and c.syncs_per_step == pytest.approx(syncs / (steps - 12), rel=1e-12)
    step = plain.step_seconds + syncs / (steps - 12) * every.momentum_sync_seconds
    assert c.step_seconds == pytest.approx(step, rel=1e-12)
    assert c.run_step_seconds == pytest.approx((12 * dense.step_seconds + (steps - 12) * step) / steps, rel=1e-12)
    # at most 2x plain vote-1bit's bytes in all, dense start included
    total = 12 * dense.bytes_sent_per_rank + (steps - 12) * c.bytes_per_step
    assert total <= 2 * steps * plain.bytes_sent_per_rank * (1 + 1e-12) or syncs == 0
    cfg = autotune.build_config(c, res, autotune.ModelSpec("custom", params, compute, "given"), cluster, "test",
                                get_profile("nccl"), "v", steps=steps)
    assert cfg["optimizer"]["momentum_sync"] == "adaptive" and "dense_warmup" not in cfg["optimizer"]


def test_a_warmup_longer_than_the_guards_start_replaces_it_and_is_not_charged_to_its_credit():
    # at 4x the map's lr the guard is high risk: 500 dense warm-up steps, which cover its 12-step start
    cluster = Cluster.for_ranks(8, bandwidth="1Gbit", latency="50us")
    params, compute, steps = 50_000_000, 0.1, 10_000
    lr = 4 * autotune.risk_rule.FIT["lr0"]
    res = autotune.search(cluster, params, compute, steps=steps, methods=["vote-1bit"], bucket_mbs=[25],
                          momentum_syncs=["adaptive"], lr=lr)
    (c,) = res.candidates
    assert c.risk["level"] == "high" and c.dense_steps == 500
    sim = lambda method, k: simulate_step(cluster, method, params, k, 25, compute)
    plain, every, dense = sim("vote-1bit", None), sim("vote-1bit", 1), sim("allreduce", None)
    syncs = math.floor(plain.bytes_sent_per_rank * (steps - 500) / (every.bytes_sent_per_rank
                                                                   - plain.bytes_sent_per_rank))
    assert c.syncs_per_step == pytest.approx(syncs / (steps - 500), rel=1e-12)
    step = plain.step_seconds + syncs / (steps - 500) * every.momentum_sync_seconds
    assert c.run_step_seconds == pytest.approx((500 * dense.step_seconds + (steps - 500) * step) / steps, rel=1e-12)
    cfg = autotune.build_config(c, res, autotune.ModelSpec("custom", params, compute, "given"), cluster, "test",
                                get_profile("nccl"), "v", steps=steps)
    assert cfg["optimizer"]["dense_warmup"] == 500 and cfg["optimizer"]["momentum_sync"] == "adaptive"


def test_adaptive_guard_in_the_hierarchical_layout_earns_credit_only_on_bytes_that_leave_the_node():
    # as LionCub counts them: the node's fp32 reduce-scatter earns nothing, the cross-node vote does
    cluster = Cluster.for_ranks(16, gpus_per_node=4, bandwidth="10Gbit", latency="50us")
    params, compute, steps, G = 50_000_000, 0.1, 10_000, 4
    res = autotune.search(cluster, params, compute, steps=steps, methods=["vote-1bit"], bucket_mbs=[25],
                          momentum_syncs=["adaptive"], batch_size=32, lr=2.5e-4, tuned_lr=5e-4)
    c = next(x for x in res.candidates if x.layout == "hierarchical")
    assert c.risk["level"] == "low" and c.dense_steps == 12  # the guard's own start, no warm-up
    sim = lambda k: simulate_step(cluster, "vote-1bit", params, k, 25, compute, hierarchical=True)
    plain, every = sim(None), sim(1)
    dense = simulate_step(cluster, "allreduce", params, None, 25, compute)
    assert plain.bytes_sent_per_rank > 4 * plain.nic_bytes_per_node / G  # mostly node-local bytes
    credit = plain.nic_bytes_per_node / G * (steps - 12) - 12 * dense.nic_bytes_per_node / G
    syncs = max(0, math.floor(credit / ((every.nic_bytes_per_node - plain.nic_bytes_per_node) / G)))
    assert c.syncs_per_step == pytest.approx(syncs / (steps - 12), rel=1e-12)


def test_slow_network_large_model_recommends_a_compressed_method():
    cluster = Cluster.for_ranks(16, bandwidth="1Gbit", latency="50us")
    params, compute = 350_000_000, 0.2
    bound = autotune.parse_max_risk("medium")
    res = autotune.search(cluster, params, compute, momentum_syncs=SCHEDS, bucket_mbs=[25, 100], max_risk=bound)
    check_against_simulator(res, cluster, params, compute, max_risk=bound)
    rec, verdict = autotune.recommend(res)
    assert rec is res.ranked[0] and rec.method != "allreduce"
    assert rec.risk["score"] < 0.45 and "pays" in verdict
    base = simulate_step(cluster, "allreduce", params, None, 25, compute).step_seconds
    assert rec.speedup == pytest.approx(base / rec.step_seconds)
    # a hurdle nothing clears: the baseline is recommended instead, and the verdict says why
    rec2, verdict2 = autotune.recommend(res, min_speedup=1e6)
    assert rec2.method == "allreduce" and "does not pay enough" in verdict2


def test_max_risk_filters_exactly_the_riskier_configurations():
    cluster = Cluster.for_ranks(16, bandwidth="1Gbit", latency="50us")
    # a harsh regime on the convergence map (2x the tuned lr, 8 sequences per rank): the levels differ
    kw = dict(momentum_syncs=["none", "every:1", "every:64"], bucket_mbs=[25], lr=1.4e-3, batch_size=8)
    loose = autotune.search(cluster, 50_000_000, 0.05, **kw)
    for name, bound in (("low", 0.2), ("medium", 0.45)):
        res = autotune.search(cluster, 50_000_000, 0.05, max_risk=autotune.parse_max_risk(name), **kw)
        assert res.ranked and all(c.risk["score"] < bound for c in res.ranked)
        assert len(res.ranked) == sum(c.risk["score"] < bound for c in loose.candidates) < len(loose.candidates)
        assert {c.risk["level"] for c in res.ranked} <= {"low", "medium"}
    res = autotune.search(cluster, 50_000_000, 0.05, momentum_syncs=["none"], max_risk=autotune.parse_max_risk("0.1"),
                          lr=1.4e-3, batch_size=8)
    assert {c.method for c in res.ranked} == {"allreduce"}  # only the baseline scores <= 0.1 without sync
    assert autotune.parse_max_risk("high") == math.inf
    for bad in ("extreme", "-1"):
        with pytest.raises(ValueError, match="max-risk"):
            autotune.parse_max_risk(bad)


def test_schedules_other_than_every_k_cost_their_syncs_over_the_planned_run():
    cluster = Cluster.for_ranks(8, bandwidth="1Gbit", latency="50us")
    params, compute, steps = 20_000_000, 0.05, 400
    res = autotune.search(cluster, params, compute, steps=steps, methods=["vote-1bit"], bucket_mbs=[25],
                          momentum_syncs=["none", "first:2:100", "geometric:4"])
    none = simulate_step(cluster, "vote-1bit", params, None, 25, compute)
    one = simulate_step(cluster, "vote-1bit", params, 1, 25, compute)  # momentum_sync_seconds = one sync
    for c in res.candidates:
        sched = schedules.resolve(c.momentum_sync)
        rate = sum(sched.should_sync(t) for t in range(1, steps + 1)) / steps
        assert c.syncs_per_step == pytest.approx(rate)
        assert c.step_seconds == pytest.approx(none.step_seconds + rate * one.momentum_sync_seconds, rel=1e-12)
        assert c.bytes_per_step == pytest.approx(
            none.bytes_sent_per_rank + rate * (one.bytes_sent_per_rank - none.bytes_sent_per_rank))
    assert {c.momentum_sync for c in res.candidates} == {"none", "first:2:100", "geometric:4"}


def test_hierarchical_layout_is_searched_and_picked_where_faster(tmp_path):
    """Each compressed method in the flat, hierarchical and sharded layouts (allreduce flat and sharded: FSDP's
    HSDP); on 8 nodes x 8 at 10 Gbit the hierarchical vote-1bit is faster than flat, the sharded one (no
    all-gather of the codes, the update on 1/G) faster still, but recommended only where nothing unsharded fits
    the memory (the verdict names it), and the configs carry their keys."""
    cluster = Cluster.for_ranks(64, gpus_per_node=8, bandwidth="10Gbit", latency="50us")
    res = autotune.search(cluster, 100_000_000, 0.05, methods=["allreduce", "vote-1bit"],
                          momentum_syncs=["none"], bucket_mbs=[25])
    assert {(c.method, c.layout) for c in res.candidates} == {
        ("allreduce", "flat"), ("allreduce", "sharded"), ("vote-1bit", "flat"), ("vote-1bit", "hierarchical"),
        ("vote-1bit", "sharded")}
    check_against_simulator(res, cluster, 100_000_000, 0.05)
    rec, verdict = autotune.recommend(res)
    sharded, flat = res.twin(rec, "sharded"), res.twin(rec, "flat")
    assert rec.layout == "hierarchical" and sharded.step_seconds < rec.step_seconds < flat.step_seconds
    assert f"{rec.step_seconds / sharded.step_seconds:.2f}x faster" in verdict and "when memory requires" in verdict
    limit = (sharded.memory_bytes_per_rank + flat.memory_bytes_per_rank) / 2  # the sharded layout's alone fit
    tight = autotune.search(cluster, 100_000_000, 0.05, methods=["allreduce", "vote-1bit"], momentum_syncs=["none"],
                            bucket_mbs=[25], memory_per_rank=limit)
    rec, verdict = autotune.recommend(tight)
    hier = res.twin(rec, "hierarchical")
    assert rec.layout == "sharded" and rec.method == "vote-1bit" and "0.125 of an unsharded replica" in verdict
    model = autotune.ModelSpec("custom", 100_000_000, 0.05, "given")
    cfg = autotune.build_config(hier, res, model, cluster, "test", get_profile("nccl"), verdict, steps=1000)
    for sec in ("optimizer", "train"):
        assert cfg[sec]["hierarchical"] is True and cfg[sec]["node_size"] == 8
    assert cfg["collective"]["layout"] == "hierarchical"
    cfg = autotune.build_config(rec, res, model, cluster, "test", get_profile("nccl"), verdict, steps=1000)
    assert cfg["train"]["method"] == "hsdp+vote-1bit" and cfg["train"]["node_size"] == 8
    assert "hierarchical" not in cfg["optimizer"] and cfg["predicted"]["memory_fraction"] == 0.125
    # where flat is faster (one fast node pair, slow intra links) it is picked, without the keys
    slow = Cluster.for_ranks(4, gpus_per_node=2, bandwidth="100Gbit", latency="5us", intra_bandwidth="1Gbit")
    res = autotune.search(slow, 10_000_000, 0.05, methods=["vote-1bit"], momentum_syncs=["none"], bucket_mbs=[25])
    rec, _ = autotune.recommend(res)
    assert rec.layout == "flat" and "hierarchical" not in autotune.build_config(
        rec, res, model, slow, "test", get_profile("nccl"), "", steps=1000)["optimizer"]
    # --algorithms flat: no hierarchical layout; one GPU per node: none either
    assert {c.layout for c in autotune.search(cluster, 100_000_000, 0.05, methods=["vote-1bit"],
                                              momentum_syncs=["none"], bucket_mbs=[25],
                                              algorithms="flat").candidates} == {"flat"}

def test_l1_levels_candidates_are_the_widest_levels_of_each_field_width():
    for n in (2, 4, 8, 16, 64, 128, 1000):
        cands = autotune.l1_levels_candidates(n)
        assert cands[0] == max(1, 127 // n) and cands == sorted(set(cands))
        widths = [methods.get("l1-pbit").layout(n, s).width for s in cands]
        assert widths == sorted(set(widths))
        for s, w in zip(cands[1:], widths[1:]):
            assert s <= autotune.MAX_LEVELS
            assert methods.get("l1-pbit").layout(n, s + 1).width > w  # one more level needs a wider field


def test_unsynced_share_matches_a_literal_momentum_recurrence():
    """Track, step by step, the weight of m that was averaged at the last sync and the weight that is local."""
    b2, steps = 0.99, 300
    for spec in ("none", "every:1", "every:7", "first:3:50", "geometric:2"):
        sched = schedules.resolve(spec)
        shared = local = 0.0
        shares = []
        for t in range(1, steps + 1):
            if t >= 2:
                shares.append(local / (shared + local))
            shared, local = b2 * shared, b2 * local + (1 - b2)  # m <- b2 m + (1 - b2) g
            if sched.should_sync(t):
                shared, local = shared + local, 0.0
        assert autotune.unsynced_share(spec, steps, b2) == pytest.approx(sum(shares) / len(shares), rel=1e-9)
        assert autotune._sync_steps(spec, steps) == [t for t in range(1, steps + 1) if sched.should_sync(t)]


def test_risk_rule_follows_the_measured_map():
    from lioncub.apps.autotune import risk_rule

    r = lambda m, n, s, **kw: autotune.risk(m, n, None, s, 200, **kw)
    assert r("allreduce", 64, "none")["score"] == 0 and r("allreduce", 64, "none")["level"] == "low"
    assert r("vote-1bit", 1, "none")["score"] == 0  # one rank: nothing is compressed
    # every entry of the fit: a harsher regime (higher lr, smaller batch per rank, more ranks) never scores lower
    lr0 = risk_rule.FIT["lr0"]
    for key in risk_rule.FIT["entries"]:
        method, sync = key.split("|")
        base = r(method, 2, sync)["score"]
        assert r(method, 2, sync, lr=4 * lr0)["score"] >= base
        assert r(method, 2, sync, batch_size=4)["score"] >= base
        assert r(method, 16, sync)["score"] >= r(method, 4, sync)["score"] >= base
        assert r(method, 2, sync)["measured"]
        # a gentler one (lower lr, larger batch) never scores higher, and no lower than the map's gentlest
        assert r(method, 4, sync, lr=lr0 / 2)["score"] <= r(method, 4, sync)["score"]
        assert r(method, 4, sync, batch_size=32)["score"] <= r(method, 4, sync)["score"]
        assert r(method, 4, sync, lr=lr0 / 64, batch_size=4096)["score"] == r(
            method, 4, sync, lr=lr0 * 2 ** risk_rule.FIT["gentlest"][0],
            batch_size=16 * 2 ** -risk_rule.FIT["gentlest"][1])["score"]
        # the lr is read against the model's tuned lr: only the ratio matters
        for tuned in (1e-5, 3e-3):
            assert r(method, 4, sync, lr=2 * tuned, tuned_lr=tuned) == r(method, 4, sync, lr=2 * lr0)
    # the guard never synced on the map's runs: it scores as plain vote-1bit (no credit for a guard not seen act)
    if risk_rule.FIT["entries"]["vote-1bit|adaptive"].get("pooled_with"):
        assert r("vote-1bit", 6, "adaptive", batch_size=8)["score"] == r("vote-1bit", 6, "none", batch_size=8)["score"]
    for bad in (dict(lr=0.0), dict(lr=-1e-3), dict(tuned_lr=0.0)):
        with pytest.raises(ValueError, match="must be > 0"):
            r("vote-1bit", 4, "none", **bad)
    # vote-allgather takes vote-1bit's votes; a method the map does not hold is at least medium
    assert r("vote-allgather", 4, "none") == r("vote-1bit", 4, "none")
    assert r("avg-pbit", 4, "none")["level"] != "low" and not r("avg-pbit", 4, "none")["measured"]
    # periodic schedules: as often as every:10 or more -> that entry; sparser ones between it and none
    if "l1-pbit|every:10" in risk_rule.FIT["entries"]:
        assert r("l1-pbit", 4, "every:5")["score"] == r("l1-pbit", 4, "every:10")["score"]
        lo, hi = sorted([r("l1-pbit", 4, "every:10")["score"], r("l1-pbit", 4, "none")["score"]])
        assert lo <= r("l1-pbit", 4, "every:50")["score"] <= hi
    with pytest.raises(ValueError, match="unknown method"):
        autotune.risk("topk", 4, None, "none", 100)


def test_builtin_parameter_counts_match_the_torch_models():
    from lioncub.apps.train.loop import TrainConfig, build
    from lioncub.apps.train.models import count_params

    for name in autotune.BUILTIN:
        for block in (64, 32):
            model, _ = build(TrainConfig(model=name, block_size=block))
            assert autotune.builtin_params(name, block) == count_params(model), (name, block)


def test_model_and_cluster_specs():
    m = autotune.model_spec("gpt2-124m")
    g = autotune.GPUS[autotune.DEFAULT_GPU]
    assert m.compute_seconds == pytest.approx(6 * 124_439_808 * 8 * 1024 / (g["peak_flops"] * autotune.UTILIZATION))
    assert "A100" in m.compute_basis
    assert autotune.model_spec("resnet50", batch=64, flops="100T").compute_seconds == pytest.approx(
        64 * 3 * 8.2e9 / 100e12)
    assert autotune.model_spec(params="1.3B", compute_seconds="300ms").compute_seconds == pytest.approx(0.3)
    c, desc = autotune.make_cluster("10gbe-4x8", latency="1ms")
    assert (c.nodes, c.gpus_per_node, c.bandwidth, c.latency) == (4, 8, 10e9, 1e-3) and "10gbe-4x8" in desc
    c, _ = autotune.make_cluster(ranks=12, gpus_per_node=4, bandwidth="25Gbit")
    assert (c.nodes, c.ranks, c.bandwidth) == (3, 12, 25e9) and c.latency == pytest.approx(20e-6)
    bad = [
        (lambda: autotune.model_spec("gpt5"), "unknown model"),
        (lambda: autotune.model_spec(), "give the model"),
        (lambda: autotune.model_spec("gpt2-124m", params="1B"), "not both"),
        (lambda: autotune.model_spec(params="-3"), "params"),
        (lambda: autotune.model_spec("resnet50", seq_len=128), "not a sequence model"),
        (lambda: autotune.model_spec("mlp", gpu="tpu"), "gpu"),
        (lambda: autotune.make_cluster(), "describe the cluster"),
        (lambda: autotune.make_cluster("10gbe-4x9"), "unknown cluster preset"),
        (lambda: autotune.make_cluster(ranks=10, gpus_per_node=4), "multiple"),
        (lambda: autotune.make_cluster(ranks=8, bandwidth="fast"), "malformed rate"),
        (lambda: autotune.search(Cluster(nodes=4), 1000, 0.1, momentum_syncs=["every:0"]), "momentum"),
        (lambda: autotune.search(Cluster(nodes=4), 1000, 0.1, steps=100, momentum_syncs=["every:500"]), "never"),
        (lambda: autotune.search(Cluster(nodes=4), 1000, 0.1, methods=["sgd"]), "unknown method"),
        (lambda: autotune.search(Cluster(nodes=4), 1000, 0.1, levels=10**9), "levels"),
        (lambda: autotune.search(Cluster(nodes=4), 1000, 0.1, bucket_mbs=[0]), "bucket"),
    ]
    for fn, match in bad:
        with pytest.raises(ValueError, match=match):
            fn()


def test_hierarchical_risk_counts_nodes_as_voters_with_g_times_the_batch():
    """A node votes as one voter with G times the per-rank batch: the hierarchical candidate's risk is the
    flat rule's at N/G ranks and G x the batch."""
    cluster = Cluster.for_ranks(16, 4, bandwidth="10Gbit", latency="20us")
    res = autotune.search(cluster, 100_000_000, 0.05, methods=["vote-1bit"], momentum_syncs=["none"],
                          bucket_mbs=[25], steps=1000, batch_size=8, lr=7e-4)
    hier = next(c for c in res.candidates if c.layout == "hierarchical")
    flat = next(c for c in res.candidates if c.layout == "flat")
    assert hier.risk == autotune.risk("vote-1bit", 4, None, "none", 1000, batch_size=32, lr=7e-4)
    assert flat.risk == autotune.risk("vote-1bit", 16, None, "none", 1000, batch_size=8, lr=7e-4)
    assert hier.risk != flat.risk


def test_sharded_is_picked_when_nothing_else_fits_the_memory():
    """Slow links inside the node make the sharded layout (FSDP's gathers) the slowest, so without a memory bound
    flat wins; with a bound between a sharded replica (12 P / G bytes) and a hierarchical one ((8 + 4 / G) P)
    only sharded candidates are ranked and one is recommended, with its memory fraction; the same search
    twice gives the same answer."""
    cluster = Cluster.for_ranks(16, gpus_per_node=4, bandwidth="100Gbit", latency="20us", intra_bandwidth="20Gbit")
    P, kw = 500_000_000, dict(methods=["allreduce", "vote-1bit"], momentum_syncs=["none"], bucket_mbs=[25])
    free = autotune.search(cluster, P, 0.2, **kw)
    assert autotune.recommend(free)[0].layout == "flat"
    assert min(free.candidates, key=lambda c: c.step_seconds).layout == "flat"
    limit = 12 * P / 4 * 1.01
    picks = []
    for _ in range(2):
        res = autotune.search(cluster, P, 0.2, memory_per_rank=limit, **kw)
        assert {c.layout for c in res.ranked} == {"sharded"}
        assert all(c.memory_fraction == pytest.approx(1 / 4) for c in res.ranked)
        rec, verdict = autotune.recommend(res)
        assert rec.layout == "sharded" and "0.250 of an unsharded replica" in verdict
        assert "flat layout needs" in verdict
        picks.append((rec.label(), rec.step_seconds, verdict))
    assert picks[0] == picks[1]
    res = autotune.search(cluster, P, 0.2, memory_per_rank="1GiB", **kw)
    assert autotune.recommend(res) == (None, "no configuration fits --memory-per-rank: the least memory is "
                                             "1.397 GiB per rank")
    with pytest.raises(ValueError, match="memory_per_rank must be positive"):
        autotune.search(cluster, P, 0.2, memory_per_rank=0, **kw)


def test_sharded_candidates_every_k_equal_the_simulator():
    """The search prices a sharded every:K as the no-sync step plus one sync / K (the sync runs after everything
    else in that step); simulate_step with momentum_sync=K gives the same step, bytes and ranking."""
    cluster = Cluster.for_ranks(16, gpus_per_node=4, bandwidth="10Gbit", latency="20us")
    res = autotune.search(cluster, 50_000_000, 0.05, methods=["vote-1bit", "allreduce"],
                          momentum_syncs=["none", "every:4", "every:16"], bucket_mbs=[25])
    sharded = [c for c in res.candidates if c.layout == "sharded"]
    assert {c.momentum_sync for c in sharded} == {"none", "every:4", "every:16"}
    check_against_simulator(res, cluster, 50_000_000, 0.05)
    for c in sharded:
        k = None if c.momentum_sync in ("none", "-") or c.dense else int(c.momentum_sync.split(":")[1])
        r = simulate_step(cluster, c.method, 50_000_000, k, c.bucket_mb, 0.05, sharded=True)
        assert c.bytes_per_step == pytest.approx(r.bytes_sent_per_rank, rel=1e-12)
