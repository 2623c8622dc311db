"""Host calibration (issue 27): measure what the step model's contention needs on this machine, in the shape of
the run, and turn it into a profile whose forecasts carry an interval.

    from lioncub.apps.train.hostcal import calibrate_host
    profile, report = calibrate_host(cfg, ranks=4)   # ~35-45 s on 2 cores; cfg: the run's TrainConfig

The probe ranks run as the run's will: by default each in a session of its own, as torchrun (its subprocess
handler starts every rank with a new session) and the lab start them. On Linux with autogroup scheduling
(/proc/sys/kernel/sched_autogroup_enabled) each session is a scheduling group: while the ranks compute, a rank's
communication thread, woken by a message, waits for its own group's turn on the cores, not only for a core. On
this 2-core machine with 4 ranks computing, that made a 24-byte Gloo all-reduce take 48 ms instead of 9 (the
ranks in one session); ranks started together in one session (`lioncub train --ranks N`) are measured with
`sessions=False`. A calibration in sessions under autogroup sets `HostModel.groups` (a woken thread waits only
while its own rank's threads run).

What is measured (hostprobe.py) and what each figure sets (simulator/hosts.py `HostModel`; R ranks, C cores):

* cores: the CPUs this process may run on;
* compute: forward + backward per step with all R ranks computing (the step model's `compute_seconds`), for at
  least 8 steps and 2 s;
* each optimizer's step() alone after a backward of the run's model (rank 0, the others waiting): plain Lion (the
  baseline's) and LionCub with each method, overlapped: `HostModel.update_seconds`, the step model's update;
* codec and Lion update alone (rank 0, the others waiting): the profile's `codec_bandwidth`, each kernel's
  speed on one device; a method's codec is its encode and vote on one bucket plus its apply (with the deferred
  momentum update, timed on the whole model: step() runs it over every bucket, out of the caches), and the
  apply's part of it is `HostModel.apply_share` (the step model runs that part in step(), after the exchange);
  the Lion update is timed on the whole model too;
* `background` (other runnable work on the host): from the CPU time over the wall time of the codec alone
  (min(1, C / (1 + b))); where that is 1, from the codec's slowdown beside every rank's compute against alone,
  share(1) / share(2R) = (2R + b) / C under processor sharing;
* the control message's all-reduce (3 float64: 3 of Gloo's 2 R segments hold data) and a small all-reduce that
  fills every segment (`full_size`) on idle cores: `call_cpu` and `message_cpu`, the ranks' CPU time per call
  (every thread: Python, the process group, Gloo's own) split into a part per call and a part per message of
  Gloo's program (`gloo_messages`: 9 and 24 messages among 4 ranks, 10.5 and 56 among 8), so that a call of any
  group and size costs what its messages say (HostModel.call_work: a bucket's all-reduce fills every segment);
* the largest all-reduce on idle cores: `byte_cpu` (its CPU time per call beyond its call's and its messages', per
  byte moved: sent and received / the profile's allreduce efficiency, contention.moved) and `intra_bandwidth`;
* the control message's all-reduce and the one of every segment with every rank computing: `wake`, the wait for a
  core on each wait of their critical paths (Gloo's, `HostModel.waits`) and for the last member (the contended
  model solved for their total time, hosts.py);
* the compute steps' variation, each rank's own beyond what the ranks' k-th steps shared: `step_cv` (how far ranks
  drift apart without a collective);
* compute steps each ended by an all-reduce, as training steps end: `start_skew`, the spread of the moments the
  ranks left the all-reduce (the machine's one clock): the ranks start each step that far apart.

Held out (predicted by the fitted model, never fitted): the mid-size all-reduces idle and under compute, the
largest under compute, the compute step while the codec runs, how long after the ranks' mean the latest ended a
paced step's compute (`HostModel.drift` of one step), and the compute's second half against its first.
Their residuals (measured / predicted - 1) give the profile's `forecast_error`, the interval on every step and
speedup forecast made with it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics

from lioncub import methods
from lioncub.comm import wire
from lioncub.simulator import Cluster, simulate_collective
from lioncub.simulator.step.contention import HOP_PROBE, Call, loaded_collective, make_call, moved
from lioncub.simulator.step.hosts import HostModel, gloo_messages

from .hostprobe import element_of

SIZES = (64 * 1024, 2 * 2**20)  # the mid (held out) and the largest all-reduce, bytes
def full_size(ranks: int) -> int:
    """Bytes of a small all-reduce that fills every one of Gloo's 2 R segments among R ranks (8 float32 each)."""
    return 64 * ranks

SPEC = dict(compute_steps=8, compute_seconds=2.0, calls=20, codec_window=5.0, codec_seconds=1.0,
            sizes=list(SIZES), update_steps=4)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_host(cfg, ranks: int, elements: int, busy_method: str = "vote-1bit", timeout: float = 120,
                 sessions: bool = True) -> dict:
    """The probes of hostprobe.py on `ranks` local ranks: the slowest rank's figures (compute: every rank's; the
    collectives' CPU per call: the ranks' mean, what they ask of the shared cores together).
    `sessions`: each rank in a session of its own, as torchrun and the lab start them (see the module)."""
    from lioncub.comm.spawn import spawn

    from .hostprobe import probe

    if ranks < 2:
        raise ValueError(f"a host calibration needs at least 2 ranks, got {ranks}")
    spec = dict(SPEC, elements=int(elements), busy_method=busy_method, fit_sizes=[full_size(ranks)],
                methods=[n for n, m in methods.REGISTRY.items() if not m.dense],
                update_configs=["lion", *methods.REGISTRY])
    outs = spawn(probe, ranks, dataclasses.asdict(cfg), spec, timeout=timeout, threads=1, sessions=sessions)

    def slowest(key, sub=None):
        rows = [o[key] if sub is None else o[key][sub] for o in outs]
        return {k: max(r[k] for r in rows) for k in rows[0]}

    def mean(key):  # the CPU the ranks ask of the shared cores together, per rank
        return {k: statistics.fmean(o[key][k] for o in outs) for k in outs[0][key]}

    under = [o["busy"]["compute_under_codec"] for o in outs if o["busy"]["compute_under_codec"]]
    return dict(ranks=ranks, cores=cores(), sessions=sessions, autogroup=autogroup(), elements=int(elements),
                busy_method=busy_method,
                update_elements=outs[0]["alone"]["model_elements"],
                compute=[t for o in outs for t in o["compute"]], alone=outs[0]["alone"]["seconds"],
                updates=outs[0]["updates"],
                paced=[o["paced"] for o in sorted(outs, key=lambda o: o["rank"])],
                alone_share=outs[0]["alone"]["share"],
                idle=slowest("idle"), idle_cpu=mean("idle_cpu"), busy=slowest("busy", "collectives"),
                codec_busy=max(o["busy"]["codec"] for o in outs),
                compute_under_codec=statistics.median(under) if under else None)


def autogroup() -> bool | None:
    """Whether the kernel groups scheduling by session (Linux autogroup); None where it does not say."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def background_from(slowdown: float, cores_: float, ranks: int, alone_share: float = 1.0) -> float:
    """The background jobs b on the host. `alone_share`: the CPU time over the wall time of a job running alone,
    min(1, C / (1 + b)); below 1 it gives b directly. Otherwise (b <= C - 1) processor sharing gives a kernel
    beside R computing ranks (2R jobs) the `slowdown` share(1) / share(2R) = (2R + b) / C against alone."""
    if 0 < alone_share < 1 and cores_ / alone_share - 1 > cores_ - 1:
        return cores_ / alone_share - 1
    return min(max(0.0, slowdown * cores_ - 2 * ranks), max(0.0, cores_ - 1))


def probe_call(profile, ranks: int, nbytes: int, host: HostModel) -> Call:
    """An all-reduce of `nbytes` among `ranks` ranks of one host (of the probe's elements: `element_of`), as the
    step model runs it: its seconds on the host's transport with idle cores, the latencies on its critical path,
    the bytes a member moves."""
    cl = Cluster.for_ranks(ranks, ranks, bandwidth=1e9, latency=0.0)
    if host.intra_bandwidth:
        cl = dataclasses.replace(cl, intra_bandwidth=host.intra_bandwidth)
    if host.intra_latency is not None:
        cl = dataclasses.replace(cl, intra_latency=host.intra_latency)
    r = simulate_collective(cl, "allreduce", "auto", nbytes, profile)
    twin = simulate_collective(dataclasses.replace(cl, intra_latency=cl.intra_latency + HOP_PROBE), "allreduce",
                               "auto", nbytes, profile)
    return make_call("probe", r.algorithm, nbytes, r.seconds, twin.seconds, ranks, "allreduce",
                     wire.bus_factor("allreduce", ranks) * nbytes, profile, element_of(nbytes))


def _solve_wake(host: HostModel, ranks: int, calls: list, measured: float) -> float:
    """The `wake` for which the contended model gives the measured total time of `calls` under compute (bisection;
    0 when processor sharing of their CPU work alone already explains it)."""
    def at(w):
        return sum(loaded_collective(dataclasses.replace(host, wake=w), ranks, c, computing=True) for c in calls)

    lo, hi = 0.0, max(measured, 1e-6)
    if at(lo) >= measured:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def fit_host(raw: dict, profile) -> tuple[HostModel, dict]:
    """The HostModel and the codec speeds alone (kernel -> bytes/s) from measure_host's figures."""
    R, C, n = raw["ranks"], float(raw["cores"]), raw["elements"]
    small, big = str(wire.CONTROL.nbytes), str(SIZES[-1])
    speeds, apply_share = codec_speeds(raw["alone"], R, n, raw["update_elements"])
    b = background_from(raw["codec_busy"] / raw["alone"][raw["busy_method"]], C, R, raw.get("alone_share", 1.0))
    # the loopback's speed from the 2 MiB all-reduce beyond one of as many messages (or the control message's)
    wire_s = raw["idle"][big] - raw["idle"].get(str(full_size(R)), raw["idle"][small])
    # a 2 MiB all-reduce hardly slower than a small one (noise on a loaded machine): no loopback speed to take
    intra = 8.0 * wire.bus_factor("allreduce", R) * SIZES[-1] / wire_s if wire_s > 0.05 * raw["idle"][big] else None
    host = HostModel(cores=C, shared_by="cluster", background=b, **call_costs(raw, profile),
                     intra_bandwidth=intra, step_cv=step_cv(raw["compute"], R),
                     start_skew=start_skew(raw["paced"]) if raw.get("paced") else 0.0,
                     waits_by="gloo", groups=bool(raw.get("sessions") and raw.get("autogroup")),
                     apply_share=apply_share, update_seconds=raw.get("updates") or None,
                     update_params=raw["update_elements"] if raw.get("updates") else 0)
    # under compute a call's time is mostly its waits for the cores, the noisiest of the probes: the control message
    # and the call of every segment (2.25 and 6 waits in a row among 4 ranks) together, where both were measured
    fit = [n for n in (wire.CONTROL.nbytes, full_size(R)) if str(n) in raw["busy"]]
    wake = _solve_wake(host, R, [probe_call(profile, R, n, host) for n in fit], sum(raw["busy"][str(n)] for n in fit))
    return dataclasses.replace(host, wake=wake), speeds


def call_costs(raw: dict, profile) -> dict:
    """A call's CPU time per call, per message of Gloo's program and per byte moved (HostModel's call_cpu,
    message_cpu, byte_cpu; call_peers None): the 2 MiB all-reduce and the small one that fills every segment
    (`full_size`) send as many messages, so the bytes are their difference; the control message's all-reduce and
    the full one differ in their messages (where the full one measured no dearer, which noise does among 2 ranks,
    whose two calls differ by 2 messages of 8, one cost per message of both). From calibrations without the full
    probe: the control message's CPU
    time per call, per peer of its R - 1, and the 2 MiB all-reduce's beyond it per byte."""
    R, cpu = raw["ranks"], raw["idle_cpu"]
    sizes = dict(control=wire.CONTROL.nbytes, full=full_size(R), big=SIZES[-1])
    got = {k: cpu.get(str(v)) for k, v in sizes.items()}
    moved_ = {k: moved(profile, "allreduce", wire.bus_factor("allreduce", R) * v) for k, v in sizes.items()}
    if got["full"] is None:
        return dict(call_cpu=got["control"], message_cpu=None, call_peers=float(R - 1),
                    byte_cpu=max(0.0, got["big"] - got["control"]) / moved_["big"])
    byte = max(0.0, got["big"] - got["full"]) / (moved_["big"] - moved_["full"])
    nc, nf = (gloo_messages("allreduce", sizes[k], R, element_of(sizes[k])) for k in ("control", "full"))
    control, full = (got[k] - byte * moved_[k] for k in ("control", "full"))
    if full <= control:  # noise says messages are free (2 ranks: 6 and 8 messages): one cost per message of both
        return dict(call_cpu=0.0, message_cpu=max(0.0, control + full) / (nc + nf), byte_cpu=byte, call_peers=None)
    per = (full - control) / (nf - nc)
    return dict(call_cpu=max(0.0, control - per * nc), message_cpu=per, byte_cpu=byte, call_peers=None)


def codec_speeds(alone: dict, ranks: int, n: int, model_elements: int) -> tuple[dict, dict | None]:
    """Each method's codec speed (bytes of its codec per second of its local work on one bucket of `n`
    elements), the Lion update's (20 bytes per parameter), and the share of the local work that step() runs
    after an overlapped exchange (`HostModel.apply_share`). Where the apply was timed apart (on the whole model,
    `model_elements`, as step() runs it out of the caches), a bucket's work is its encode and vote plus its
    share of that apply; otherwise the whole bucket's work as timed, and no share."""
    speeds, shares = {}, {}
    for m, t in alone.items():
        if m == "update" or ":" in m:
            continue
        enc, app = alone.get(f"encode:{m}"), alone.get(f"apply:{m}")
        if enc is not None and app is not None:
            app = app * n / model_elements
            t, shares[m] = enc + app, app / (enc + app)
        speeds[m] = methods.get(m).codec_bytes_per_element(ranks, 0, "float32") * n / t
    speeds["update"] = 20.0 * model_elements / alone["update"]
    return speeds, shares or None


def step_cv(compute: list[float], ranks: int) -> float:
    """The median over ranks of the standard deviation of each rank's own compute steps over their mean, once what
    every rank's k-th step shared is taken out (`compute`: every rank's steps, rank after rank, as many each, timed
    at once): a step that is slow on every rank at once (the machine's, not a rank's) delays none of them against
    the others, so it is no drift."""
    per = per_rank(compute, ranks)
    n = len(per[0])
    if n < 2:
        return 0.0
    shared = [statistics.fmean(x[k] for x in per) for k in range(n)]
    mean = statistics.fmean(shared)
    return statistics.median(statistics.stdev(x[k] - shared[k] for k in range(n)) / mean for x in per)


def per_rank(compute: list[float], ranks: int) -> list[list[float]]:
    """Each rank's compute steps (`compute`: every rank's, rank after rank, as many each)."""
    n = len(compute) // ranks
    return [compute[r * n:(r + 1) * n] for r in range(ranks)]


def start_skew(paced: list[dict]) -> float:
    """The ranks' start of step's standard deviation about their mean: the root mean square over the paced steps of
    the sample standard deviation of the moments the ranks left the step's all-reduce (`paced`: every rank's
    hostprobe._paced figures, rank after rank)."""
    steps = list(zip(*(p["exits"] for p in paced)))
    if len(paced) < 2 or not steps:
        return 0.0
    return math.sqrt(statistics.fmean(statistics.variance(e) for e in steps))


def paced_lateness(paced: list[dict]) -> float | None:
    """How long after the ranks' mean the latest of them ended a paced step's compute, the mean over the steps: each
    started where it left the previous step's all-reduce (the first step has no such start)."""
    if len(paced) < 2:
        return None
    ends = [[p["exits"][k - 1] + p["compute"][k] for p in paced] for k in range(1, len(paced[0]["exits"]))]
    return statistics.fmean(max(e) - statistics.fmean(e) for e in ends) if ends else None


def held_out(raw: dict, profile, host: HostModel) -> dict:
    """measured / predicted - 1 for every probe the fit did not use (see the module)."""
    R = raw["ranks"]
    mid, big = SIZES[0], SIZES[-1]
    res = {}
    for name, size, busy in (("allreduce 64 KiB idle", mid, False), ("allreduce 64 KiB under compute", mid, True),
                             ("allreduce 2 MiB under compute", big, True)):
        pred = loaded_collective(host, R, probe_call(profile, R, size, host), computing=busy)
        res[name] = (raw["busy" if busy else "idle"][str(size)]) / pred - 1
    compute = raw["compute"]
    t_r = statistics.median(compute)
    if raw.get("compute_under_codec"):
        slow = host.share(R) / host.share(2 * R)
        res["compute while the codec runs"] = raw["compute_under_codec"] / (t_r * slow) - 1
    late, drift = (paced_lateness(raw["paced"]) if raw.get("paced") else None), host.drift(1.0, t_r, R)
    if late is not None and drift > 0:
        res["latest rank's end of compute, paced"] = late / drift - 1
    first, second = halves(compute, R)
    if len(first) >= 2:
        res["compute, second half against first"] = statistics.median(second) / statistics.median(first) - 1
    return res


def halves(compute: list[float], ranks: int) -> tuple[list[float], list[float]]:
    """Every rank's first and second half of its compute steps in time, pooled (`compute`: every rank's steps,
    rank after rank)."""
    per = per_rank(compute, ranks)
    n = len(per[0])
    return [t for x in per for t in x[:n // 2]], [t for x in per for t in x[n - n // 2:]]


def error_band(residuals: dict) -> list[float]:
    """[low, high] of measured / predicted - 1 over the held-out probes (0 always inside)."""
    vals = list(residuals.values())
    return [round(min(0.0, *vals), 4), round(max(0.0, *vals), 4)]


def with_host(profile, host: dict, speeds: dict, band):
    """`profile` with a host calibration: its host model (a dict), its codec speeds alone over the profile's, its
    forecast interval."""
    return dataclasses.replace(profile, host=host, codec_bandwidth=dict(profile.codec_bandwidth, **speeds),
                               forecast_error=band, name=f"{profile.name}+host")


def calibrate_host(cfg, ranks: int, profile=None, elements: int | None = None, sessions: bool = True):
    """(profile with `host`, its codec speeds alone and `forecast_error`; a report dict) for runs of `cfg` on
    `ranks` ranks of this machine. `profile`: the network's calibration (default: the bundled lab's); `sessions`:
    the run's ranks each in a session of their own (torchrun, the lab; see the module)."""
    from lioncub.apps.calibrate import default_lab_profile

    from .loop import build
    from .models import count_params

    profile = profile or default_lab_profile()
    if elements is None:
        elements = max(1, int(wire.auto_bucket_mb(4 * count_params(build(cfg)[0])) * 2**20) // 4)
    return fitted(measure_host(cfg, ranks, elements, sessions=sessions), profile)


def fitted(raw: dict, profile):
    """calibrate_host's (profile, report) from measure_host's figures `raw` over the network's `profile`."""
    host, speeds = fit_host(raw, profile)
    residuals = held_out(raw, profile, host)
    band = error_band(residuals)
    out = with_host(profile, host.to_dict(), speeds, band)
    return out, dict(compute_seconds=statistics.median(raw["compute"]), host=host.to_dict(), codec_bandwidth=speeds,
                     held_out=residuals, forecast_error=band, raw=raw)


__all__ = ["background_from", "calibrate_host", "call_costs", "error_band", "fit_host", "fitted", "full_size",
           "held_out", "measure_host", "probe_call", "with_host"]
