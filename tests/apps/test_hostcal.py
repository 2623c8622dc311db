"""The host calibration's arithmetic (issue 27): the background from a codec's slowdown, the fit recovering a
host whose probes it generated, the held-out band, and the run's forecast-against-measured report."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
from lioncub.simulator import get_profile
from lioncub.simulator.step.contention import loaded_collective
from lioncub.simulator.step.hosts import HostModel

from lioncub import methods
from lioncub.apps.train.forecast import compare, compare_components, forecast_of, format_comparison, so_far
from lioncub.apps.train.hostcal import SIZES, background_from, error_band, fit_host, full_size, probe_call
from lioncub.comm import wire


@pytest.mark.parametrize("cores,ranks", [(2, 4), (4, 4), (8, 2)])
@pytest.mark.parametrize("b", [0.0, 0.5, 3.0, 28.0])
def test_background_is_recovered_from_the_slowdown_processor_sharing_gives(cores, ranks, b):
    # processor sharing written out: a job's speed among n runnable jobs (b of them background) on C cores
    def speed(n):
        return min(1.0, cores / (n + b))

    slowdown = speed(1) / speed(2 * ranks)
    if slowdown == 1.0:  # a core for every job: the slowdown says nothing about b below C - 2R
        assert background_from(slowdown, cores, ranks, speed(1)) <= cores - 2 * ranks + 1e-9
        return
    assert background_from(slowdown, cores, ranks, speed(1)) == pytest.approx(b, abs=1e-9)


def _raw_from(host: HostModel, ranks: int, profile) -> dict:
    """The figures measure_host would report on a machine that behaves exactly as `host` says."""
    small, full, big = wire.CONTROL.nbytes, full_size(ranks), SIZES[-1]
    share = host.share(ranks)

    def cpu(nbytes, element=4):  # what each rank's CPU costs: per call, per message of Gloo's, per byte moved
        moved = 2.0 * wire.bus_factor("allreduce", ranks) * nbytes
        return host.call_work(ranks, moved, "allreduce", nbytes, element)

    # on idle cores a call's CPU work runs at the ranks' share; its CPU time is that work
    idle_cpu = {str(small): cpu(small, 8), str(full): cpu(full), str(big): cpu(big)}
    idle = {k: v / share for k, v in idle_cpu.items()}
    busy = {str(n): loaded_collective(host, ranks, probe_call(profile, ranks, n, host), computing=True)
            for n in (small, full)}
    slowdown = host.share(1) / host.share(2 * ranks)
    return dict(ranks=ranks, cores=host.cores, elements=1000, busy_method="vote-1bit", update_elements=4000,
                alone_share=host.share(1),
                alone={"vote-1bit": 1e-3, "update": 1e-4}, codec_busy=1e-3 * slowdown, idle=idle,
                idle_cpu=idle_cpu, busy=busy,
                compute=[0.1] * 8, compute_under_codec=None)


def test_fit_recovers_the_host_that_generated_its_probes():
    profile = get_profile("gloo")
    truth = HostModel(cores=2.0, shared_by="cluster", background=1.5, call_cpu=2e-4, message_cpu=6e-5,
                      byte_cpu=5e-10, intra_bandwidth=None, waits_by="gloo")
    # the intra speed the fit will find is what the big probe's time implies: give the truth that speed
    raw = _raw_from(truth, 4, profile)
    wire_s = raw["idle"][str(SIZES[-1])] - raw["idle"][str(full_size(4))]
    truth = dataclasses.replace(truth, intra_bandwidth=8.0 * wire.bus_factor("allreduce", 4) * SIZES[-1] / wire_s,
                                wake=1.5e-3)
    raw = _raw_from(truth, 4, profile)
    host, speeds = fit_host(raw, profile)
    assert host.background == pytest.approx(1.5, rel=1e-6)
    assert host.call_cpu == pytest.approx(2e-4, rel=1e-6)
    assert host.message_cpu == pytest.approx(6e-5, rel=1e-6)
    assert host.byte_cpu == pytest.approx(5e-10, rel=1e-6)
    assert host.wake == pytest.approx(1.5e-3, rel=1e-4)
    # from the control message under compute alone (calibrations without the full probe there), the same wake
    control_only = dict(raw, busy={k: v for k, v in raw["busy"].items() if k == str(wire.CONTROL.nbytes)})
    assert fit_host(control_only, profile)[0].wake == pytest.approx(1.5e-3, rel=1e-4)
    # where the two disagree (the full call slower than this wake says), the wake lies between their own
    full = str(full_size(4))
    slow = dict(raw, busy=dict(raw["busy"], **{full: 2 * raw["busy"][full]}))
    full_only = dict(raw, busy={full: 2 * raw["busy"][full]})
    assert 1.5e-3 < fit_host(slow, profile)[0].wake < fit_host(full_only, profile)[0].wake
    assert host.waits_by == "gloo"  # the probes ran on Gloo: its programs' waits
    assert not host.groups  # ranks in one session (the raw figures say nothing else)
    raw.update(sessions=True, autogroup=True)
    assert fit_host(raw, profile)[0].groups  # each in a session of its own, under autogroup
    raw.update(autogroup=False)
    assert not fit_host(raw, profile)[0].groups
    assert speeds["update"] == pytest.approx(20 * 4000 / 1e-4)


def test_the_optimizers_steps_timed_alone_are_the_hosts_update_for_the_calibrated_model():
    profile = get_profile("gloo")
    raw = _raw_from(HostModel(cores=2.0, shared_by="cluster", waits_by="gloo"), 4, profile)
    assert fit_host(raw, profile)[0].update_seconds is None  # calibrations from before the probe
    host, _ = fit_host(dict(raw, updates={"lion": 2e-3, "vote-1bit": 1.5e-3}), profile)
    assert host.update_of("lion", raw["update_elements"]) == 2e-3
    assert host.update_of("vote-1bit", raw["update_elements"]) == 1.5e-3
    assert host.update_of("vote-1bit", raw["update_elements"] + 1) is None


def test_the_ranks_start_skew_is_the_spread_of_when_they_left_each_all_reduce():
    """start_skew: the root mean square over steps of the ranks' sample sd of their exits; paced_lateness: the
    latest rank's end of compute after the ranks' mean, each rank starting where it left the previous all-reduce;
    the fit carries the skew and holds the lateness out against HostModel.drift of one step."""
    import math
    import statistics

    from lioncub.apps.train.hostcal import held_out, paced_lateness, start_skew

    offsets = [[0.0, 0.002, 0.004, 0.010], [0.001, 0.001, 0.001, 0.001], [0.003, 0.0, 0.006, 0.003]]  # per step
    paced = [dict(exits=[1.0 + k + offsets[k][r] for k in range(3)], compute=[0.1, 0.1 + 0.01 * r, 0.1])
             for r in range(4)]
    want = math.sqrt(statistics.fmean(statistics.variance(o) for o in offsets))
    assert start_skew(paced) == pytest.approx(want, rel=1e-9)
    ends = [[1.0 + offsets[0][r] + 0.1 + 0.01 * r for r in range(4)], [2.0 + offsets[1][r] + 0.1 for r in range(4)]]
    assert paced_lateness(paced) == pytest.approx(statistics.fmean(max(e) - statistics.fmean(e) for e in ends))
    assert start_skew([paced[0]]) == 0.0 and paced_lateness([paced[0]]) is None  # one rank: no spread

    profile = get_profile("gloo")
    raw = dict(_raw_from(HostModel(cores=2.0, shared_by="cluster", waits_by="gloo", wake=1e-3), 4, profile),
               paced=paced)
    host, _ = fit_host(raw, profile)
    assert host.start_skew == pytest.approx(want, rel=1e-9)
    for probes, size in (("idle", SIZES[0]), ("busy", SIZES[0]), ("busy", SIZES[-1])):  # the other held-out probes
        raw[probes][str(size)] = 0.01
    late = held_out(raw, profile, host)["latest rank's end of compute, paced"]
    assert late == pytest.approx(paced_lateness(paced) / host.drift(1.0, 0.1, 4) - 1, rel=1e-9)
    assert fit_host(dict(raw, paced=None), profile)[0].start_skew == 0.0  # calibrations from before the probe


def test_error_band_always_holds_zero():
    assert error_band({"a": 0.1, "b": 0.2}) == [0.0, 0.2]
    assert error_band({"a": -0.3, "b": 0.05}) == [-0.3, 0.05]


def _result(step, dense, band=None):
    return SimpleNamespace(step_seconds=step, baseline_step_seconds=dense, step_interval=band, compute_seconds=0.09,
                           codec_seconds=0.02, exposed_communication_seconds=0.03,
                           contention={"compute": 0.1})


def test_a_run_names_the_component_that_differs_most_and_the_remedy():
    records = [dict(step_s=0.30, compute_s=0.11, codec_s=0.08, exposed_s=0.1)] * 10
    summary = dict(mean_step_seconds=0.30, compute_seconds=0.11, codec_seconds=0.08, records=records)
    c = compare(summary, _result(0.2, 0.25, (0.18, 0.22)), compressed=True)
    assert c["differs_most"] == "exposed communication"  # 70 ms off, against codec 60 ms and compute 10 ms
    assert c["inside"] is False and c["step_error"] == pytest.approx(0.5)
    assert "slower than the forecast dense step" in c["remedy"] and "autotune" in c["remedy"]
    text = format_comparison(c)
    assert "outside" in text and "differs most" in text
    # a compressed run faster than the dense forecast, inside its interval: no remedy
    c = compare(dict(summary, mean_step_seconds=0.2), _result(0.2, 0.25, (0.18, 0.22)), compressed=True)
    assert c["inside"] and c["remedy"] is None
    # a dense run is never told to change method
    assert compare(summary, _result(0.2, 0.25), compressed=False)["remedy"] is None
    # the ranks compare their first steps the same way, from a JSON-able forecast
    early = json.loads(json.dumps(forecast_of(_result(0.2, 0.25, (0.18, 0.22)))))
    c = compare_components(so_far(records[:8]), early, compressed=True)
    assert c["differs_most"] == "exposed communication" and c["remedy"]
    assert "first 8 steps" in format_comparison(c, "first 8 steps")


def test_host_command_refuses_a_machine_of_one_rank(capsys, tmp_path):
    from lioncub.cli import main

    assert main(["host", "--ranks", "1", "--output", str(tmp_path / "h.json")]) == 2
    err = capsys.readouterr().err
    assert "--ranks must be at least 2" in err and err.count("\n") == 1


def test_no_loopback_speed_is_taken_from_probes_that_do_not_show_one():
    profile = get_profile("gloo")
    raw = _raw_from(HostModel(cores=2.0, shared_by="cluster", call_cpu=2e-4, byte_cpu=5e-10), 4, profile)
    raw["idle"][str(SIZES[-1])] = raw["idle"][str(full_size(4))]  # noise: 2 MiB as fast as 256 B
    host, _ = fit_host(raw, profile)
    # no speed from wall times that show none; the CPU per byte is the probes' CPU time, which the noise spared
    assert host.intra_bandwidth is None and host.byte_cpu == pytest.approx(5e-10)


def test_step_variation_is_each_ranks_own():
    """step_cv: the median over ranks of each rank's own steps' sd / mean, beyond what the ranks' k-th steps shared;
    a rank that is steadily slower adds no variation (it is not noise between steps), nor does a step that is slow
    on every rank at once (it delays no rank against the others)."""
    import statistics

    from lioncub.apps.train.hostcal import step_cv

    own = [[0.0, 0.02, -0.02, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.03, -0.03, 0.0]]
    level = [0.10, 0.20, 0.10, 0.30]
    ranks = [[lv + e for e in r] for lv, r in zip(level, own)]
    shared = [statistics.fmean(r[k] for r in own) for k in range(4)]
    mean = statistics.fmean(level)
    cvs = sorted(statistics.stdev(e - s for e, s in zip(r, shared)) / mean for r in own)
    assert step_cv([t for r in ranks for t in r], 4) == pytest.approx((cvs[1] + cvs[2]) / 2)
    spiked = [[t + (0.4 if k == 1 else 0.0) for k, t in enumerate(r)] for r in ranks]  # every rank's 2nd step
    assert step_cv([t for r in spiked for t in r], 4) == pytest.approx(
        (cvs[1] + cvs[2]) / 2 * mean / (mean + 0.1))  # the same spread over a longer mean step
    assert step_cv([0.1] * 4, 4) == 0.0  # one step per rank: nothing to measure


def test_compute_is_timed_long_enough_for_a_small_models_steps():
    """compute_count: at least compute_steps, and enough steps to fill compute_seconds, at most MAX_COMPUTE_STEPS:
    a 25 ms step is a few scheduler slices long, 8 of them a fifth of a second."""
    from lioncub.apps.train.hostcal import SPEC
    from lioncub.apps.train.hostprobe import MAX_COMPUTE_STEPS, compute_count

    assert compute_count(0.025, SPEC) == 80 and 80 * 0.025 >= SPEC["compute_seconds"]
    assert compute_count(0.150, SPEC) == 14  # ceil(2 / 0.15)
    assert compute_count(0.5, SPEC) == SPEC["compute_steps"] == 8
    assert compute_count(1e-7, SPEC) == MAX_COMPUTE_STEPS
    assert compute_count(0.01, dict(compute_steps=8)) == 8  # without compute_seconds: the count alone


def test_the_computes_halves_are_each_ranks_first_and_second_half_in_time():
    """The held-out "second half against first" compares every rank's later steps with its earlier ones, not the
    later ranks with the earlier (the figures come rank after rank)."""
    from lioncub.apps.train.hostcal import halves

    ranks = [[0.1, 0.1, 0.2, 0.2], [0.3, 0.3, 0.6, 0.6]]  # each rank twice as slow in its second half
    first, second = halves([t for r in ranks for t in r], 2)
    assert sorted(first) == [0.1, 0.1, 0.3, 0.3] and sorted(second) == [0.2, 0.2, 0.6, 0.6]
    first, second = halves([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 2)  # three steps each: the middle one in neither
    assert (first, second) == ([0.1, 0.4], [0.3, 0.6])


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_fit_splits_a_calls_cpu_into_the_call_and_its_messages(ranks):
    profile = get_profile("gloo")
    truth = HostModel(cores=2.0, shared_by="cluster", background=0.5, call_cpu=3e-4, message_cpu=7e-5,
                      byte_cpu=5e-10, waits_by="gloo")
    host, _ = fit_host(_raw_from(truth, ranks, profile), profile)
    assert (host.call_cpu, host.message_cpu) == (pytest.approx(3e-4), pytest.approx(7e-5))
    assert host.call_peers is None  # a call's group is in its messages


def test_a_calibration_without_the_full_probe_scales_the_controls_cpu_per_peer():
    # raw figures from before the full probe (stored runs): the control's CPU per call, per peer of its R - 1
    profile = get_profile("gloo")
    truth = HostModel(cores=2.0, shared_by="cluster", background=0.5, call_cpu=2e-4, byte_cpu=5e-10)
    for ranks in (2, 4, 8):
        raw = _raw_from(truth, ranks, profile)
        del raw["idle_cpu"][str(full_size(ranks))]
        host, _ = fit_host(raw, profile)
        assert host.call_peers == ranks - 1 and host.message_cpu is None
        assert host.call_work(ranks, 0) == pytest.approx(host.call_cpu)


def test_a_calls_cpu_is_the_cpu_time_measured_where_the_probes_report_it():
    # the probes' CPU time per call (every thread of a rank) is taken as it is, whatever the wall time: an idle
    # call that waits on loopback for most of its 5 ms uses 0.9 ms of CPU, a call of every segment 1.8 ms (4 ranks)
    profile = get_profile("gloo")
    truth = HostModel(cores=2.0, shared_by="cluster", background=0.5, call_cpu=2e-4, byte_cpu=5e-10,
                      waits_by="gloo")
    raw = _raw_from(truth, 4, profile)
    small, full, big = str(wire.CONTROL.nbytes), str(full_size(4)), str(SIZES[-1])
    def moved(nbytes):
        return 2.0 * wire.bus_factor("allreduce", 4) * nbytes

    raw["idle_cpu"] = {small: 0.9e-3 + 3e-10 * moved(24), full: 1.8e-3 + 3e-10 * moved(full_size(4)),
                       big: 1.8e-3 + 3e-10 * moved(SIZES[-1])}
    host, _ = fit_host(raw, profile)
    # 9 messages and 24: 0.06 ms a message, 0.36 ms a call
    assert host.message_cpu == pytest.approx(0.06e-3) and host.call_cpu == pytest.approx(0.36e-3)
    assert host.byte_cpu == pytest.approx(3e-10)
    # an idle call no dearer than its messages: no CPU per byte; a full call cheaper than the control: one cost per
    # message of both, none per call (the next test)
    raw["idle_cpu"][big] = 1.5e-3
    assert fit_host(raw, profile)[0].byte_cpu == 0.0
    raw["idle_cpu"][full] = 0.8e-3
    host, _ = fit_host(raw, profile)
    assert host.call_cpu == 0.0 and 0.8e-3 / 24 < host.message_cpu < 0.9e-3 / 9


def test_codec_speeds_put_the_apply_as_step_runs_it_and_give_its_share():
    from lioncub.apps.train.hostcal import codec_speeds

    n, P, R = 1000, 8000, 4
    per = methods.get("l1-pbit").codec_bytes_per_element(R, 0, "float32")
    # encode 1 ms per bucket, the apply 4 ms on the whole model (0.5 ms per bucket's worth), update 2 ms
    alone = {"l1-pbit": 9e-3, "encode:l1-pbit": 1e-3, "apply:l1-pbit": 4e-3, "update": 2e-3, "vote-1bit": 2e-3}
    speeds, shares = codec_speeds(alone, R, n, P)
    assert speeds["l1-pbit"] == pytest.approx(per * n / 1.5e-3)
    assert shares == {"l1-pbit": pytest.approx(0.5e-3 / 1.5e-3)}
    # a method timed only whole keeps its whole time and no share; the update is 20 bytes per parameter
    assert speeds["vote-1bit"] == pytest.approx(methods.get("vote-1bit").codec_bytes_per_element(R, 0, "float32")
                                                * n / 2e-3)
    assert speeds["update"] == pytest.approx(20 * P / 2e-3)
    assert codec_speeds({"vote-1bit": 2e-3, "update": 2e-3}, R, n, P)[1] is None


def test_a_fit_whose_full_call_measured_no_dearer_prices_every_message_alike():
    # among 2 ranks the control message (6 messages) and the full call (8) differ by 2 messages: noise can make the
    # full one measure cheaper, and the split would call messages free; one cost per message of both instead
    from lioncub.simulator.step.contention import moved
    from lioncub.simulator.step.hosts import gloo_messages

    from lioncub.apps.train.hostcal import call_costs

    profile = get_profile("gloo")
    truth = HostModel(cores=2.0, shared_by="cluster", background=0.5, call_cpu=1e-4, message_cpu=5e-5,
                      byte_cpu=5e-10, waits_by="gloo")
    raw = _raw_from(truth, 2, profile)
    control, full = str(wire.CONTROL.nbytes), str(full_size(2))
    raw["idle_cpu"][full] = raw["idle_cpu"][control] * 0.95
    got = call_costs(raw, profile)
    byte = got["byte_cpu"]
    nc = gloo_messages("allreduce", wire.CONTROL.nbytes, 2, wire.DTYPE_BYTES[wire.CONTROL.dtype])
    nf = gloo_messages("allreduce", full_size(2), 2)
    assert (nc, nf) == (6, 8)
    cpu = [raw["idle_cpu"][k] - byte * moved(profile, "allreduce", wire.bus_factor("allreduce", 2) * int(k))
           for k in (control, full)]
    assert got["call_cpu"] == 0.0
    assert got["message_cpu"] == pytest.approx(sum(cpu) / (nc + nf)) and got["message_cpu"] > 0
