"""simulate_step(local_steps=H): the outer exchange of LionCub(local_steps=H), the method's collectives and the
control message every H steps after backward, amortized per step; checked against the primitives simulated
one by one."""

import pytest
from lioncub.simulator import Cluster, simulate_collective, simulate_step
from lioncub.simulator.step.local import OUTER_BYTES_PER_PARAM
from lioncub.simulator.step.model import UPDATE_BYTES_PER_PARAM

from lioncub import methods
from lioncub.comm import wire

E = 1_000_000  # parameters: one bucket of 4 MiB
MEM = 2e12
STEP = dict(params=E, bucket_mb=4.0, compute_seconds=0.01, backend="ideal", memory_bandwidth=MEM)


@pytest.mark.parametrize("method", ["vote-1bit", "l1-pbit", "allreduce"])
def test_the_outer_exchange_is_amortized_over_h_steps(method):
    cluster = Cluster(nodes=4, bandwidth="10Mbit", latency="30us")
    meth, H = methods.get(method), 25
    r = simulate_step(cluster, method, local_steps=H, **STEP)
    parts = [simulate_collective(cluster, c.op, "auto", c.nbytes, backend="ideal")
             for c in meth.collectives(E, 4, meth.resolve_levels(4))]
    control = simulate_collective(cluster, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, backend="ideal")
    comm = (sum(p.seconds for p in parts) + control.seconds) / H
    codec = (meth.codec_bytes_per_element(4, meth.resolve_levels(4)) + OUTER_BYTES_PER_PARAM) * E / MEM / H
    assert r.local_steps == H and r.momentum_sync_seconds == 0
    assert r.communication_seconds == pytest.approx(comm, rel=1e-9)
    assert r.exposed_communication_seconds == pytest.approx(comm, rel=1e-9)
    assert r.codec_seconds == pytest.approx(codec, rel=1e-9)
    assert r.step_seconds == pytest.approx(0.01 + UPDATE_BYTES_PER_PARAM * E / MEM + codec + comm, rel=1e-9)
    assert r.bytes_sent_per_rank == pytest.approx(
        (sum(p.bytes_sent_per_rank for p in parts) + control.bytes_sent_per_rank) / H, rel=1e-9)
    assert all(c["per_step"] == 1 / H for c in r.collectives)
    every_step = simulate_step(cluster, method, overlap=False, **STEP)
    assert r.step_seconds < every_step.step_seconds  # on a slow link the interval pays


def test_local_steps_are_checked_and_free_on_one_rank():
    cluster = Cluster(nodes=4, bandwidth="10Mbit")
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="local_steps"):
            simulate_step(cluster, "vote-1bit", local_steps=bad, **STEP)
    with pytest.raises(ValueError, match="local_steps"):
        simulate_step(cluster, "vote-1bit", local_steps=4, momentum_sync=10, **STEP)
    one = simulate_step(Cluster(nodes=1, bandwidth="10Mbit"), "vote-1bit", local_steps=4, **STEP)
    assert one.communication_seconds == 0 and one.bytes_sent_per_rank == 0


def test_streamed_waits_are_what_each_fragment_outlasts_its_delay():
    """stream_waits' timeline against the closed form: with D * F < H every fragment is applied before the next
    one's exchange can start, so step() waits max(0, busy_f - D x inner) for each fragment, once per interval."""
    from lioncub.simulator.step.local import stream_waits

    from lioncub.comm import fragment_schedule

    for H, F, D, inner, busy in [(4, 2, 1, 1.0, [1.5, 0.5]), (25, 5, 1, 0.1, [0.3, 0.05, 0.2, 0.1, 0.25]),
                                 (25, 5, 4, 0.1, [0.5] * 5), (10, 1, 0, 0.2, [3.0]), (7, 3, 2, 1.0, [2.5, 0.1, 9.0]),
                                 (5, 2, 2, 1.0, [4.0, 4.0])]:
        want = sum(max(0.0, b - D * inner) for b in busy)
        waits = stream_waits(H, fragment_schedule.offsets(H, F), D, inner, busy)
        assert waits == pytest.approx(want, abs=1e-12), (H, F, D)


@pytest.mark.parametrize("bandwidth", ["10Mbit", "10Gbit"])
def test_streamed_outer_steps_hide_what_the_delay_covers(bandwidth):
    """F = 1 with D = 0 is the unstreamed step; F fragments with delay D expose only what each fragment's exchange
    outlasts D inner steps (codec on the thread: the ideal backend's devices are not the computing cores)."""
    cluster, H, F, D = Cluster(nodes=4, bandwidth=bandwidth, latency="30us"), 20, 4, 2
    P = 2**20
    step = dict(STEP, params=P, bucket_mb=1.0)  # four buckets of 1 MiB
    plain = simulate_step(cluster, "vote-1bit", local_steps=H, **step)
    one = simulate_step(cluster, "vote-1bit", local_steps=H, fragments=1, outer_delay=0, **step)
    assert one.step_seconds == pytest.approx(plain.step_seconds, rel=1e-12)
    assert one.bytes_sent_per_rank == pytest.approx(plain.bytes_sent_per_rank, rel=1e-12)
    r = simulate_step(cluster, "vote-1bit", local_steps=H, fragments=F, outer_delay=D, **step)
    assert (r.fragments, r.outer_delay) == (F, D)
    meth = methods.get("vote-1bit")
    bucket = [simulate_collective(cluster, c.op, "auto", c.nbytes, backend="ideal")
              for c in meth.collectives(P // 4, 4, 0)]
    control = simulate_collective(cluster, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, backend="ideal")
    codec = meth.codec_bytes_per_element(4, 0) * (P // 4) / MEM
    busy = control.seconds + codec + sum(p.seconds for p in bucket)
    inner = 0.01 + UPDATE_BYTES_PER_PARAM * P / MEM + OUTER_BYTES_PER_PARAM * P / MEM / H
    assert r.exposed_communication_seconds == pytest.approx(F * max(0.0, busy - D * inner) / H, rel=1e-9)
    assert r.communication_seconds == pytest.approx(F * (busy - codec) / H, rel=1e-9)
    assert r.step_seconds <= plain.step_seconds
    assert r.bytes_sent_per_rank == pytest.approx(plain.bytes_sent_per_rank + 3 * control.bytes_sent_per_rank / H,
                                                  rel=1e-9)


def test_local_steps_in_the_node_layout():
    """hierarchical=True: every step the node's fp32 all-reduce of each bucket; every H steps local rank 0 of each
    node votes across the nodes (one voter per NIC) and broadcasts the flag and the agreed update in the node."""
    from lioncub.simulator.step.local import NODE_BROADCAST, NODE_MEAN

    cluster, H = Cluster(nodes=3, gpus_per_node=2, bandwidth="10Mbit", latency="30us"), 10
    r = simulate_step(cluster, "vote-1bit", local_steps=H, hierarchical=True, **STEP)
    node = Cluster(nodes=1, gpus_per_node=2, bandwidth="10Mbit", latency="30us")
    cross = Cluster(nodes=3, bandwidth="10Mbit", latency="30us")
    meth = methods.get("vote-1bit")
    mean = simulate_collective(node, "allreduce", "auto", 4 * E, backend="ideal")
    votes = [simulate_collective(cross, c.op, "auto", c.nbytes, backend="ideal") for c in meth.collectives(E, 3, 0)]
    control = simulate_collective(cross, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, backend="ideal")
    bcast = [simulate_collective(node, "allgather", "auto", n, backend="ideal") for n in (4, 4 * E)]
    outer = control.seconds + sum(v.seconds for v in votes) + sum(b.seconds for b in bcast)
    assert r.exposed_communication_seconds == pytest.approx(mean.seconds + outer / H, rel=1e-9)
    assert r.nic_bytes_per_node == pytest.approx((control.nic_bytes_per_node
                                                  + sum(v.nic_bytes_per_node for v in votes)) / H, rel=1e-9)
    assert {c["what"] for c in r.collectives} == {NODE_MEAN, NODE_BROADCAST, "control allreduce", "vote-1bit"}
    codec = (meth.codec_bytes_per_element(3, 0) + OUTER_BYTES_PER_PARAM) * E / MEM / H
    assert r.step_seconds == pytest.approx(0.01 + UPDATE_BYTES_PER_PARAM * E / MEM + codec + mean.seconds + outer / H,
                                           rel=1e-9)
    flat = simulate_step(cluster, "vote-1bit", local_steps=H, **STEP)
    assert r.nic_bytes_per_node < flat.nic_bytes_per_node  # one voter per node instead of two


@pytest.mark.parametrize("bandwidth", ["10Mbit", "10Gbit"])
def test_streamed_outer_steps_in_the_node_layout(bandwidth):
    """hierarchical=True with fragments: every step the node's mean of each bucket (exposed, in step()); on the
    thread, per fragment, the voters' exchange across the nodes and the leader's broadcasts of the flag and of
    the fragment's agreed update inside the node; step() waits for what each fragment outlasts D inner steps."""
    from lioncub.simulator.step.local import NODE_BROADCAST, NODE_MEAN

    kw = dict(bandwidth=bandwidth, latency="30us")
    cluster, H, F, D, P = Cluster(nodes=3, gpus_per_node=2, **kw), 20, 4, 2, 2**20
    step = dict(STEP, params=P, bucket_mb=1.0)  # four buckets of 1 MiB: one per fragment
    r = simulate_step(cluster, "vote-1bit", local_steps=H, fragments=F, outer_delay=D, hierarchical=True, **step)
    node, cross = Cluster(nodes=1, gpus_per_node=2, **kw), Cluster(nodes=3, **kw)
    meth, e = methods.get("vote-1bit"), P // 4
    mean = 4 * simulate_collective(node, "allreduce", "auto", 4 * e, backend="ideal").seconds
    votes = [simulate_collective(cross, c.op, "auto", c.nbytes, backend="ideal") for c in meth.collectives(e, 3, 0)]
    control = simulate_collective(cross, wire.CONTROL.op, "auto", wire.CONTROL.nbytes, backend="ideal")
    bcast = sum(simulate_collective(node, "allgather", "auto", n, backend="ideal").seconds for n in (4, 4 * e))
    codec = meth.codec_bytes_per_element(3, 0) * e / MEM
    wire_s = control.seconds + sum(v.seconds for v in votes) + bcast
    inner = 0.01 + UPDATE_BYTES_PER_PARAM * P / MEM + mean + OUTER_BYTES_PER_PARAM * P / MEM / H
    assert (r.fragments, r.outer_delay) == (F, D)
    assert r.exposed_communication_seconds == pytest.approx(mean + F * max(0.0, wire_s + codec - D * inner) / H,
                                                            rel=1e-9)
    assert r.communication_seconds == pytest.approx(mean + F * wire_s / H, rel=1e-9)
    assert r.nic_bytes_per_node == pytest.approx(F * (control.nic_bytes_per_node
                                                      + sum(v.nic_bytes_per_node for v in votes)) / H, rel=1e-9)
    assert {c["what"] for c in r.collectives} == {NODE_MEAN, NODE_BROADCAST, "control allreduce", "vote-1bit"}
    one = simulate_step(cluster, "vote-1bit", local_steps=H, fragments=1, outer_delay=0, hierarchical=True, **step)
    plain = simulate_step(cluster, "vote-1bit", local_steps=H, hierarchical=True, **step)
    assert one.step_seconds == pytest.approx(plain.step_seconds, rel=1e-12)  # F = 1, D = 0: the unstreamed step
    assert r.step_seconds <= plain.step_seconds


def test_streaming_options_are_checked_as_lioncub_checks_them():
    cluster = Cluster(nodes=4, bandwidth="10Mbit")
    for kw, msg in [(dict(fragments=2), "only with local_steps"), (dict(local_steps=4, outer_delay=1), "only with"),
                    (dict(local_steps=4, fragments=5), r"fragments must be an int in \[1, local_steps=4\]"),
                    (dict(local_steps=4, fragments=2, outer_delay=2), "outer_delay must be")]:
        with pytest.raises(ValueError, match=msg):
            simulate_step(cluster, "vote-1bit", **kw, **STEP)
    with pytest.raises(ValueError, match="more than the optimizer's 1 buckets"):
        simulate_step(cluster, "vote-1bit", local_steps=4, fragments=2, **STEP)


def _host_profile(**host):
    from lioncub.simulator import get_profile
    from lioncub.simulator.step.hosts import HostModel

    return get_profile("ideal").replace(host=HostModel(**host).to_dict())


HOST_STEP = dict(STEP, params=2**20, bucket_mb=1.0, backend=None)


def test_ranks_drift_apart_between_exchanges_and_each_waits_for_the_latest_voter():
    """With a host model whose steps vary (step_cv), an exchange after k steps without a collective starts when the
    latest of the m voters arrives: step_cv x step x sqrt(k) x E[max of m normals] later (HostModel.drift). Not
    streamed: k = H; streamed: k = H / F, each fragment's exchange starting that much later (here every
    fragment's exchange outlasts the D inner steps that could hide it, so each wait grows by all of it)."""
    from lioncub.simulator.step.hosts import expected_max

    cluster, H, F, D, cv = Cluster(nodes=4, bandwidth="10Mbit", latency="30us"), 20, 4, 1, 0.1
    inner = 0.01 + UPDATE_BYTES_PER_PARAM * 2**20 / MEM
    for kw, k, waits in [(dict(), H, 1), (dict(fragments=F, outer_delay=D), H / F, F)]:
        a = simulate_step(cluster, "vote-1bit", local_steps=H, **{**HOST_STEP, "backend": _host_profile(
            cores=64.0, shared_by=1)}, **kw)
        b = simulate_step(cluster, "vote-1bit", local_steps=H, **{**HOST_STEP, "backend": _host_profile(
            cores=64.0, shared_by=1, step_cv=cv)}, **kw)
        late = cv * inner * k ** 0.5 * expected_max(4)
        assert b.exposed_communication_seconds - a.exposed_communication_seconds == pytest.approx(
            waits * late / H, rel=1e-9), kw
        assert b.communication_seconds == pytest.approx(a.communication_seconds, rel=1e-12)


def test_local_steps_on_devices_never_shared_give_the_analytic_step():
    # a core per job and nothing else on the host: the processes (step/local.py's LocalSim) reproduce the analytic
    # step of an outer step in step(), its exposed time being all of the outer step (as LionCub times it)
    cluster, H = Cluster(nodes=4, bandwidth="10Mbit", latency="30us"), 25
    for method in ("vote-1bit", "allreduce"):
        a = simulate_step(cluster, method, local_steps=H, **STEP)
        b = simulate_step(cluster, method, local_steps=H, **{**STEP, "backend": _host_profile(cores=1000.0)})
        assert b.step_seconds == pytest.approx(a.step_seconds, rel=1e-9)
        assert b.exposed_communication_seconds == pytest.approx(
            a.exposed_communication_seconds + a.codec_seconds, rel=1e-9)
        assert b.optimizer_seconds == pytest.approx(a.optimizer_seconds, rel=1e-9)


def test_shared_cores_slow_the_inner_update_and_a_streamed_exchange_pays_wakes_while_they_compute():
    """4 ranks on 2 cores: the inner Lion update runs at the share each rank gets (2 / 4 of a core), and the
    outer exchange's collectives wait for a core at each of their waits only while the ranks compute: a streamed
    exchange (on the thread, beside the next inner steps) pays the wakes, the same exchange in step() does not."""
    cluster, H = Cluster(nodes=4, bandwidth="10Mbit", latency="30us"), 20
    roomy, busy = (dict(cores=1000.0, shared_by="cluster", waits_by="gloo", groups=True),
                   dict(cores=2.0, shared_by="cluster", waits_by="gloo", groups=True))
    update = UPDATE_BYTES_PER_PARAM * 2**20 / MEM
    r = simulate_step(cluster, "vote-1bit", local_steps=H, **{**HOST_STEP, "backend": _host_profile(**busy)})
    assert r.optimizer_seconds == pytest.approx(update * 4 / 2, rel=1e-9)
    streamed = dict(fragments=4, outer_delay=1)
    for kw, pays in [(dict(), False), (streamed, True)]:
        quiet, woken = (simulate_step(cluster, "vote-1bit", local_steps=H, **kw, **{
            **HOST_STEP, "backend": _host_profile(**busy, wake=wake)}) for wake in (0.0, 5e-3))
        if pays:
            assert woken.communication_seconds > quiet.communication_seconds + 5e-3 / H
        else:
            assert woken.communication_seconds == pytest.approx(quiet.communication_seconds, rel=1e-12)
    one = simulate_step(cluster, "vote-1bit", local_steps=H, **{**HOST_STEP, "backend": _host_profile(**roomy)})
    assert r.step_seconds > one.step_seconds
