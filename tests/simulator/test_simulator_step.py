"""Training-step model against hand-computed schedules (ideal profile, closed-form collectives)."""

import math

import pytest
from lioncub.simulator import Cluster, simulate_collective, simulate_step, sweep

from lioncub.comm import wire

B = 10e9 / 8
A = 30e-6
MEM = 2e12


def lg(p):
    return math.ceil(math.log2(p))


def allreduce_best(p, n):
    f = (p - 1) / p
    return min(2 * (p - 1) * A + 2 * f * n / B, lg(p) * (A + n / B), 2 * lg(p) * A + 2 * f * n / B,
               2 * lg(p) * (A + n / B))


def allgather_best(p, n):
    f = (p - 1) / p
    return min((p - 1) * A + f * n / B, lg(p) * A + f * n / B)


def alltoall_best(p, n):
    return A + (p - 1) / p * n / B  # all at once beats pairwise


def buckets(P, mb):
    per = int(mb * 2**20 // 4)
    return [per] * (P // per) + ([P % per] if P % per else [])


@pytest.mark.parametrize("compute", [0.02, 2.0])
def test_ddp_baseline_overlaps_bucketed_allreduce_with_backward(compute):
    p, P, mb = 4, 30_000_000, 25
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    r = simulate_step(cluster, "allreduce", params=P, bucket_mb=mb, compute_seconds=compute, backend="ideal",
                      memory_bandwidth=MEM)
    fwd, bwd = compute / 3, compute * 2 / 3
    end, done, comm = fwd, 0, 0.0
    for e in buckets(P, mb):
        done += e
        t = allreduce_best(p, 4 * e)
        end = max(end, fwd + bwd * done / P) + t
        comm += t
    exposed = max(0.0, end - compute)
    assert r.communication_seconds == pytest.approx(comm, rel=0.01)
    assert r.exposed_communication_seconds == pytest.approx(exposed, rel=0.01, abs=1e-9)
    assert r.step_seconds == pytest.approx(compute + exposed + 20 * P / MEM, rel=0.01)
    assert r.speedup == 1.0
    if compute == 2.0:
        # long backward: everything hides but the last bucket, which is only ready when backward ends
        assert r.exposed_communication_seconds == pytest.approx(allreduce_best(p, 4 * buckets(P, mb)[-1]), rel=0.01)


def test_baseline_without_overlap_reduces_after_backward():
    """LionCub(method="allreduce") communicates inside step(): nothing hides behind backward."""
    p, P, mb, compute = 4, 30_000_000, 25, 2.0
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    r = simulate_step(cluster, "allreduce", params=P, bucket_mb=mb, compute_seconds=compute, backend="ideal",
                      memory_bandwidth=MEM, overlap=False)
    comm = sum(allreduce_best(p, 4 * e) for e in buckets(P, mb))
    assert r.exposed_communication_seconds == pytest.approx(comm, rel=0.01)
    assert r.step_seconds == pytest.approx(compute + comm + 20 * P / MEM, rel=0.01)
    v = simulate_step(cluster, "vote-1bit", params=P, bucket_mb=mb, compute_seconds=compute, backend="ideal",
                      memory_bandwidth=MEM, overlap=False)
    assert v.baseline_step_seconds == pytest.approx(r.step_seconds, rel=1e-9)


def test_vote_1bit_step_and_momentum_sync_amortization():
    """LionCub(..., overlap=False): the control allreduce and every bucket after backward."""
    p, P, mb, K = 4, 30_000_000, 25, 10
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    kw = dict(params=P, bucket_mb=mb, compute_seconds=0.1, backend="ideal", memory_bandwidth=MEM, overlap=False)
    r = simulate_step(cluster, "vote-1bit", **kw)
    rk = simulate_step(cluster, "vote-1bit", momentum_sync=K, **kw)
    planes = 2  # even world size: majority sign + "not a tie"
    comm = allreduce_best(p, wire.CONTROL.nbytes)  # the step's control allreduce
    msync = 0.0
    for e in buckets(P, mb):
        chunk = math.ceil(e / (8 * p))  # bytes of one rank's 1-bit chunk
        comm += alltoall_best(p, p * chunk) + allgather_best(p, p * chunk * planes)
        msync += allreduce_best(p, 4 * e)
    assert r.communication_seconds == pytest.approx(comm, rel=0.01)
    assert r.exposed_communication_seconds == r.communication_seconds  # after backward: nothing hidden
    assert r.step_seconds == pytest.approx(0.1 + r.codec_seconds + comm + 20 * P / MEM, rel=1e-9)
    assert rk.momentum_sync_seconds == pytest.approx(msync / K, rel=0.01)
    assert rk.step_seconds - r.step_seconds == pytest.approx(msync / K, rel=0.01)
    # bytes: (p-1)/p of the 1-bit vector in the all-to-all, (p-1)/p of `planes` bit planes in the
    # all-gather, plus fp32 momentum every K steps
    per_step_bits = (p - 1) / p * (1 + planes) * P
    assert r.bytes_sent_per_rank == pytest.approx(per_step_bits / 8, rel=0.01)
    assert rk.bytes_sent_per_rank - r.bytes_sent_per_rank == pytest.approx(2 * (p - 1) / p * 4 * P / K, rel=0.01)


@pytest.mark.parametrize("compute", [0.005, 0.5])
def test_overlapped_vote_encodes_and_exchanges_buckets_during_backward(compute):
    """LionCub's default: each bucket's codec and collectives start once backward has produced it, one
    bucket after another; the control allreduce follows backward; momentum syncs come after the update."""
    p, P, mb, K = 4, 30_000_000, 25, 10
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    kw = dict(params=P, bucket_mb=mb, compute_seconds=compute, backend="ideal", memory_bandwidth=MEM)
    r = simulate_step(cluster, "vote-1bit", **kw)
    rk = simulate_step(cluster, "vote-1bit", momentum_sync=K, **kw)
    codec_per_elem = r.codec_seconds / P
    fwd, bwd = compute / 3, compute * 2 / 3
    end, done, comm, msync = fwd, 0, 0.0, 0.0
    for e in buckets(P, mb):
        done += e
        chunk = math.ceil(e / (8 * p))
        t = alltoall_best(p, p * chunk) + allgather_best(p, p * chunk * 2)
        end = max(end, fwd + bwd * done / P) + codec_per_elem * e + t
        comm += t
        msync += allreduce_best(p, 4 * e)
    end = max(end, compute) + allreduce_best(p, wire.CONTROL.nbytes)
    exposed = end - compute
    assert r.communication_seconds == pytest.approx(comm + allreduce_best(p, wire.CONTROL.nbytes), rel=0.01)
    assert r.exposed_communication_seconds == pytest.approx(exposed, rel=0.01)
    assert r.step_seconds == pytest.approx(compute + exposed + 20 * P / MEM, rel=0.01)
    assert rk.step_seconds - r.step_seconds == pytest.approx(msync / K, rel=0.01)
    after = simulate_step(cluster, "vote-1bit", overlap=False, **kw)
    assert r.step_seconds < after.step_seconds
    if compute == 0.5:  # a long backward hides all but the last bucket and the control message
        last = buckets(P, mb)[-1]
        chunk = math.ceil(last / (8 * p))
        tail = codec_per_elem * last + alltoall_best(p, p * chunk) + allgather_best(p, p * chunk * 2)
        control = allreduce_best(p, wire.CONTROL.nbytes)
        assert r.exposed_communication_seconds == pytest.approx(tail + control, rel=0.01)


def test_pbit_composite_sends_the_field_width_for_n_ranks():
    # 4 ranks voting 0/1/2: sums up to 8 need 4-bit fields, two per uint8 word (words padded to 16)
    cluster = Cluster(nodes=4, bandwidth="10Gbit", latency=A)
    n = 1_000_001
    words = math.ceil(math.ceil(n / 2) / 16) * 16
    r = simulate_collective(cluster, "vote-pbit", "ring", 4 * n, backend="ideal")
    assert [(x["op"], x["size_bytes"], x["dtype"]) for x in r.parts] == [("allreduce", words, "uint8")]
    assert r.seconds == pytest.approx(6 * A + 1.5 * words / B, rel=1e-6)
    # vote-allgather: everyone's packed signs
    r = simulate_collective(cluster, "vote-allgather", "ring", 4 * n, backend="ideal")
    assert r.parts[0]["op"] == "allgather" and r.parts[0]["size_bytes"] == 4 * math.ceil(n / 8)
    # momentum sync: the fp32 bucket itself
    r = simulate_collective(cluster, "momentum-sync", "ring", 4 * n, backend="ideal")
    assert r.seconds == pytest.approx(6 * A + 1.5 * 4 * n / B, rel=1e-6)


def test_compute_from_flops_and_tokens():
    cluster = Cluster(nodes=2, bandwidth="100Gbit", latency=A)
    r = simulate_step(cluster, "allreduce", params="125M", flops_per_second="100T", tokens_per_step=4096,
                      backend="ideal")
    assert r.compute_seconds == pytest.approx(6 * 125e6 * 4096 / 100e12)


def test_speedup_falls_as_bandwidth_rises():
    speedups = []
    for bw in ("1Gbit", "10Gbit", "100Gbit", "1Tbit"):
        cluster = Cluster.for_ranks(16, 8, bandwidth=bw, latency="20us")
        speedups.append(simulate_step(cluster, "vote-1bit", params="350M", compute_seconds=0.2,
                                      momentum_sync=100).speedup)
    assert speedups == sorted(speedups, reverse=True)
    assert speedups[0] > 2 and speedups[-1] < 1.1


def test_single_rank_step_has_no_communication():
    r = simulate_step(Cluster(nodes=1), "vote-1bit", params=10**6, compute_seconds=0.1, momentum_sync=5)
    assert r.communication_seconds == 0 and r.bytes_sent_per_rank == 0


def test_sweep_rows_and_cache():
    rows = sweep(ranks=[4, 8], bandwidths=["1Gbit", "10Gbit"], methods=["vote-1bit", "l1-pbit"],
                 momentum_syncs=[None, 50], params="50M", compute_seconds=0.05, backend="nccl", progress=False)
    assert len(rows) == 2 * 2 * 2 * 2
    one = simulate_step(Cluster(nodes=8, bandwidth="1Gbit", latency="20us"), "l1-pbit", params="50M",
                        compute_seconds=0.05, momentum_sync=50)
    row = [r for r in rows if r["ranks"] == 8 and r["bandwidth"] == 1e9 and r["method"] == "l1-pbit"
           and r["momentum_sync"] == 50][0]
    assert row["step_seconds"] == pytest.approx(one.step_seconds, rel=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="vote-2bit"), "unknown method"),
    (dict(params=0), "params"),
    (dict(momentum_sync=-3), "momentum_sync"),
    (dict(compute_seconds=None), "compute_seconds"),
    (dict(algorithm="fastest"), "unknown algorithm"),
    (dict(grad_dtype="int8"), "grad_dtype"),
    (dict(compute_seconds="5 minutes"), "malformed time"),
])
def test_step_bad_input(kwargs, match):
    args = dict(method="vote-1bit", params=10**6, compute_seconds=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate_step(Cluster(nodes=4), **args)


def test_codec_on_compute_cores_adds_to_backward_and_hides_only_communication():
    """CPU ranks (profile.codec_on_compute): each bucket's codec runs on the cores that compute, so backward
    lasts the codecs longer and only the collectives overlap it."""
    from lioncub.simulator import get_profile

    p, P, mb, compute = 4, 30_000_000, 25, 0.3
    cluster = Cluster(nodes=p, bandwidth="10Gbit", latency=A)
    ideal = get_profile("ideal")
    cpu = ideal.replace(codec_on_compute=True)
    kw = dict(params=P, bucket_mb=mb, compute_seconds=compute, memory_bandwidth=MEM)
    gpu_like = simulate_step(cluster, "vote-1bit", backend=ideal, **kw)
    r = simulate_step(cluster, "vote-1bit", backend=cpu, **kw)
    codec_per_elem = r.codec_seconds / P
    fwd, bwd = compute / 3, compute * 2 / 3 + r.codec_seconds
    end, done = fwd, 0
    for e in buckets(P, mb):
        done += e
        chunk = math.ceil(e / (8 * p))
        end = max(end, fwd + bwd * done / P) + alltoall_best(p, p * chunk) + allgather_best(p, p * chunk * 2)
    end = max(end, fwd + bwd) + allreduce_best(p, 4)
    assert r.codec_seconds == pytest.approx(gpu_like.codec_seconds) and codec_per_elem > 0
    assert r.exposed_communication_seconds == pytest.approx(end - (fwd + bwd), rel=0.01)
    assert r.step_seconds == pytest.approx(compute + r.codec_seconds + (end - fwd - bwd) + 20 * P / MEM, rel=0.01)
    assert r.step_seconds > gpu_like.step_seconds


@pytest.mark.parametrize("bucket_mb", [0.5, 2.0, None])
def test_the_models_tensors_give_lioncubs_own_buckets(bucket_mb):
    """simulate_step(tensors=...) cuts the buckets where LionCub cuts them (at tensor boundaries, each closing once
    it holds bucket_mb; None: LionCub's automatic size, passed as wire.auto_bucket_mb), checked against an
    optimizer's buckets on a model of uneven tensors."""
    import collections

    import torch

    from lioncub import LionCub
    from lioncub.comm import wire

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 256), torch.nn.Linear(256, 1500), torch.nn.LayerNorm(1500),
                                torch.nn.Linear(1500, 512), torch.nn.Linear(512, 3000, bias=False))
    sizes = [p.numel() for p in model.parameters()]
    opt = LionCub(model.parameters(), lr=1e-3, method="vote-1bit", bucket_mb=bucket_mb)
    engine = collections.Counter(sum(p.numel() for p in b.params) for b in opt.engine.buckets)
    mb = bucket_mb or wire.auto_bucket_mb(4 * sum(sizes))
    r = simulate_step(Cluster(nodes=4, bandwidth="1Gbit"), "vote-1bit", None, None, mb, 0.1, tensors=sizes)
    sim = collections.Counter()
    for c in r.collectives:
        if c["what"] == "vote-1bit":
            sim[c["size_bytes"] // 4] += c["count"]
    assert r.params == sum(sizes) and r.buckets == len(opt.engine.buckets) > 1
    assert sim == engine
    with pytest.raises(ValueError, match="tensors hold"):
        simulate_step(Cluster(nodes=4, bandwidth="1Gbit"), "vote-1bit", sum(sizes) + 1, None, mb, 0.1, tensors=sizes)
    with pytest.raises(ValueError, match="tensors must be"):
        simulate_step(Cluster(nodes=4, bandwidth="1Gbit"), "vote-1bit", None, None, mb, 0.1, tensors=[3, 0])


def test_a_step_spec_is_the_keyword_form():
    """simulate_step(cluster, StepSpec(...)) is simulate_step(cluster, **the same options); a spec and options
    beside it are refused, a variant is dataclasses.replace."""
    import dataclasses

    from lioncub.simulator import StepSpec

    cluster = Cluster.for_ranks(16, gpus_per_node=4, bandwidth="1Gbit", latency="50us")
    for options in (dict(momentum_sync=10), dict(hierarchical=True, grad_dtype="bfloat16"), dict(local_steps=10),
                    dict(sharded=True, overlap=False), dict(tensors=[3000, 5000, 2000], bucket_mb=0.01)):
        spec = StepSpec("vote-1bit", params=None if "tensors" in options else "10M", compute_seconds=0.1, **options)
        keywords = simulate_step(cluster, "vote-1bit", spec.params, compute_seconds=0.1, **options)
        assert simulate_step(cluster, spec) == keywords, options
    spec = StepSpec("vote-1bit", params="10M", compute_seconds=0.1)
    assert simulate_step(cluster, dataclasses.replace(spec, momentum_sync=10)) == simulate_step(
        cluster, "vote-1bit", "10M", 10, compute_seconds=0.1)
    for beside in (dict(params="20M"), dict(overlap=False), dict(backend="gloo")):
        with pytest.raises(ValueError, match="a StepSpec or its options, not both"):
            simulate_step(cluster, spec, **beside)
