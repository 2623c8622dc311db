"""Fit a simulator backend profile to measured probes, and predict measurements with a profile.

Pure Python (no torch). Every fitted number is a physical parameter of `BackendProfile`, estimated
from the probes that are sensitive to it, with the simulator itself as the model (least squares on
log time ratios, one parameter at a time, two sweeps so the mild couplings settle):

=====================  ================================================================================
parameter              estimated from
=====================  ================================================================================
wire_efficiency        the two largest ping-pong transfers: payload / (time difference * line rate), so
                       fixed costs and the burst credit cancel (framing: 1448/1514 through tc)
call_overhead,         the smallest probes of every kind (min over repetitions: small-message timings
message_overhead       spike under load): linear least squares, the simulator giving each probe's count
                       of calls and of messages on its critical path
link_burst             every probe above the smallest (medians): seconds of line time a port passes at
                       once after idling (tbf's bucket, as much of it as refills between calls);
                       bounded by the shaper's configured bucket when the measurements carry it
efficiency[family]     allreduce, allgather and reduce-scatter probes of 4 MiB and more (medians)
rendezvous_stagger     all-to-all probes of 4 MiB and more, with the all-to-all's own efficiency at 1
                       (its calls that do not serialize run at the line rate); Gloo profiles only
                       (without such probes it keeps the neutral 0.5)
reduce_bandwidth,      host kernels timed on every rank at once (see ranks.py): a float32 sum, and per
codec_bandwidth        method the extra local work of its codec over a plain Lion update
=====================  ================================================================================

Structure that is not fitted (it is read from Gloo's source, not from timings): sends wait for the
receiver's ready notice (`rendezvous`); the all-reduce is a ring cut into segments of at most 1 MiB
(`slice_bytes`), the all-gather a ring of half blocks, the all-to-all posts everything at once; one TCP
socket per peer; the window and host limits keep the base profile's values, which no zero-latency lab
setting below the CPU limit can identify. The ping-pong probes do not fit link_burst: each leg finds its
port idle for a whole leg, so it gets the shaper's full bucket, not what refills between collectives.
"""

from __future__ import annotations

import math
import statistics

from lioncub import methods
from lioncub.simulator import BackendProfile, Cluster, get_profile, simulate_collective, simulate_transfers
from lioncub.simulator.collectives.simulate import COMPOSITES, composite_elements
from lioncub.simulator.step.model import UPDATE_BYTES_PER_PARAM

MiB = 2**20
TINY = 16 * 1024  # probes at or below this size fit the overheads
LARGE = 4 * MiB  # probes at or above this size fit the efficiencies and the stagger (burst credit and
# per-message costs are small there)

# measurement op -> simulator op
SIM_OP = {"allreduce": "allreduce", "allgather": "allgather", "alltoall": "alltoall",
          "reduce_scatter": "reducescatter", **{op: op for op in COMPOSITES}}
FAMILY_OF = {"allreduce": "allreduce", "allgather": "allgather", "reduce_scatter": "reducescatter"}

GLOO_ALGORITHMS = {
    "allreduce": ["ring"],  # gloo::allreduce: ring, segments <= 1 MiB (kMaxSegmentSize), 2 in flight
    "allgather": ["ring"],  # gloo::allgather: ring, each block in two halves
    "reducescatter": ["ring"],
    "alltoall": ["all-at-once"],  # gloo::alltoall: every send and receive posted at once
    "broadcast": ["binomial-tree"],
    "reduce": ["binomial-tree"],
}

MEANINGS = {
    "wire_efficiency": "payload bytes per byte of line rate (framing)",
    "call_overhead": "fixed seconds per collective call on every rank (Python, the process group, set-up)",
    "message_overhead": "seconds of a rank's communication thread per message, one after another",
    "link_burst": "seconds of line time a NIC port passes at once after idling (the shaper's burst credit)",
    "efficiency": "per op family, payload efficiency of the library's implementation beyond framing",
    "rendezvous": "sends wait for the receiver's ready notice (Gloo's handshake; structural, not fitted)",
    "rendezvous_stagger": "fraction of calls whose ranks enter one after another, so that exchanges "
                          "serialize on the handshake",
    "reduce_bandwidth": "bytes per second a rank sums received data at (gamma = 1/value)",
    "codec_bandwidth": "bytes per second of the step model's kernels on these ranks' devices (per method, "
                       "'update' for the Lion update, 'vote' for the majority vote)",
}


class CalibrationError(ValueError):
    """The measurements cannot calibrate a profile (missing probes, nonsense values)."""


# ---- predictions ------------------------------------------------------------------------------------
def cluster_for(m: dict, latency: float = 0.0) -> Cluster:
    return Cluster.for_ranks(int(m["ranks"]), int(m.get("ranks_per_host") or 1),
                             bandwidth=float(m["bandwidth_bps"]), latency=latency)


def vote_bytes(op: str, size: float, ranks: int) -> int:
    """Bytes of packed votes the vote kernel reads in one call of a 1-bit composite."""
    meth = methods.REGISTRY.get(op)
    if meth is None or meth.dense or meth.codec.kind != "signs" or ranks < 2:
        return 0
    return meth.collectives(composite_elements(int(size)), ranks)[0].nbytes  # the first carries all N rows


def predict(profile: BackendProfile, m: dict, latency: float = 0.0) -> float:
    """Seconds the simulator predicts for measurement m (an op, size, ranks and bandwidth_bps).

    Composite ops (`lioncub lab bench --op vote-1bit ...`) time the optimizer's transport: its
    collectives and, for the 1-bit methods, the vote kernel between or after them, which this adds
    from profile.codec_bandwidth["vote"] when the profile has it."""
    op = m["op"]
    cluster = cluster_for(m, latency)
    if op == "p2p":
        return profile.call_overhead + simulate_transfers(cluster, [(0, 1, float(m["size"]))], profile, "p2p")
    if op not in SIM_OP:
        raise CalibrationError(f"cannot predict op {op!r}; known: p2p, {', '.join(SIM_OP)}")
    t = simulate_collective(cluster, SIM_OP[op], "auto", float(m["size"]), profile).seconds
    vb = vote_bytes(op, m["size"], int(m["ranks"]))
    if vb and "vote" in profile.codec_bandwidth:
        t += vb / profile.codec_bandwidth["vote"]
    return t


def target(m: dict) -> float:
    """The statistic a probe is fitted to: min over repetitions for the smallest probes, else median."""
    return float(m["min"] if m["size"] <= TINY else m["seconds"])


# ---- one-dimensional least squares --------------------------------------------------------------------
def _loss(profile: BackendProfile, probes: list[dict], latency: float) -> float:
    return sum(math.log(predict(profile, m, latency) / target(m)) ** 2 for m in probes)


def _minimize(fn, lo: float, hi: float, grid: int = 10, iters: int = 16) -> float:
    """Minimum of fn on [lo, hi]: a grid, then golden-section search around the best grid point."""
    xs = [lo + (hi - lo) * i / grid for i in range(grid + 1)]
    ys = [fn(x) for x in xs]
    k = min(range(len(xs)), key=lambda i: (ys[i], i))
    a, b = xs[max(0, k - 1)], xs[min(grid, k + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = fn(c), fn(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = fn(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = fn(d)
    best = min([(ys[k], xs[k]), (fc, c), (fd, d)])
    return best[1]


# ---- the fit ------------------------------------------------------------------------------------------
def _check(measurements: list[dict]) -> list[dict]:
    if not isinstance(measurements, list) or not measurements:
        raise CalibrationError("no measurements to fit")
    out = []
    for i, m in enumerate(measurements):
        if not isinstance(m, dict):
            raise CalibrationError(f"measurement {i} is not an object")
        missing = [k for k in ("op", "size", "ranks", "bandwidth_bps", "seconds", "min") if k not in m]
        if missing:
            raise CalibrationError(f"measurement {i} ({m.get('op', '?')}) lacks {', '.join(missing)}")
        if m["op"] != "p2p" and m["op"] not in SIM_OP:
            raise CalibrationError(f"measurement {i}: unknown op {m['op']!r}")
        for k in ("size", "ranks", "bandwidth_bps", "seconds", "min"):
            v = m[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CalibrationError(f"measurement {i} ({m['op']}): {k} must be a positive number, got {v!r}")
        if m["ranks"] < 2:
            raise CalibrationError(f"measurement {i} ({m['op']}): needs at least 2 ranks, got {m['ranks']}")
        out.append(m)
    return out


def _burst_bound(ms: list[dict]) -> float:
    """Upper bound for link_burst: the shaper's bucket when the measurements say (lab), else 20 ms."""
    b = [m["tbf_burst_bytes"] * 8 / m["bandwidth_bps"] for m in ms if m.get("tbf_burst_bytes")]
    return max(b) if b else 0.02


def _fit_wire_efficiency(p2p: list[dict], start: float) -> float:
    big = sorted((m for m in p2p if m["size"] >= MiB), key=lambda m: m["size"])
    if len(big) < 2:
        return start
    a, b = big[-2], big[-1]
    dt = b["seconds"] - a["seconds"]
    if dt <= 0:
        return start
    w = (b["size"] - a["size"]) / (dt * b["bandwidth_bps"] / 8)
    return min(1.0, max(0.3, w))


def _fit_overheads(profile: BackendProfile, tiny: list[dict], latency: float) -> BackendProfile:
    """Linear least squares (relative errors) for call and message overhead, both >= 0."""
    if not tiny:
        return profile
    rows, rhs = [], []
    zero = profile.replace(call_overhead=0.0, message_overhead=0.0)
    dc, do = 1e-3, 1e-4
    for m in tiny:
        t0 = predict(zero, m, latency)
        kc = (predict(zero.replace(call_overhead=dc), m, latency) - t0) / dc
        ko = (predict(zero.replace(message_overhead=do), m, latency) - t0) / do
        y = target(m)
        rows.append((kc / y, ko / y))
        rhs.append(1 - t0 / y)

    def solve(use_c: bool, use_o: bool):
        # normal equations of the 2x2 (or 1x1) problem
        a11 = sum(r[0] * r[0] for r in rows)
        a22 = sum(r[1] * r[1] for r in rows)
        a12 = sum(r[0] * r[1] for r in rows)
        b1 = sum(r[0] * y for r, y in zip(rows, rhs))
        b2 = sum(r[1] * y for r, y in zip(rows, rhs))
        if use_c and use_o:
            det = a11 * a22 - a12 * a12
            if det <= 1e-12 * max(a11 * a22, 1e-300):
                return None
            return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if use_c:
            return (b1 / a11 if a11 > 0 else 0.0), 0.0
        return 0.0, (b2 / a22 if a22 > 0 else 0.0)

    best = None
    for use in ((True, True), (True, False), (False, True)):
        sol = solve(*use)
        if sol is None or sol[0] < 0 or sol[1] < 0:
            continue
        err = sum((r[0] * sol[0] + r[1] * sol[1] - y) ** 2 for r, y in zip(rows, rhs))
        if best is None or err < best[0]:
            best = (err, sol)
    c, o = best[1] if best else (0.0, 0.0)
    return profile.replace(call_overhead=float(c), message_overhead=float(o))


def _with_efficiency(profile: BackendProfile, family: str, value: float) -> BackendProfile:
    eff = dict(profile.efficiency)
    eff[family] = value
    return profile.replace(efficiency=eff)


def _set_efficiency(family: str):
    return lambda profile, x: _with_efficiency(profile, family, x)


def _set_burst(profile: BackendProfile, x: float) -> BackendProfile:
    return profile.replace(link_burst=x)


def _set_stagger(profile: BackendProfile, x: float) -> BackendProfile:
    return profile.replace(rendezvous_stagger=x)


def _fit_one(profile: BackendProfile, setter, probes: list[dict], lo: float, hi: float, latency: float):
    """The profile with one parameter (set by setter(profile, x)) at its least-squares value in [lo, hi]."""
    x = _minimize(lambda v: _loss(setter(profile, v), probes, latency), lo, hi)
    return setter(profile, x)


def fit(measurements: list[dict], host_kernels: dict | None = None, base="gloo", latency: float = 0.0,
        name: str | None = None, sweeps: int = 2) -> tuple[BackendProfile, dict]:
    """Fit `base`'s physical parameters to the measurements (and host kernel timings); returns the
    profile and a report: fitted values, and every probe's measured and predicted seconds."""
    ms = _check(measurements)
    start = get_profile(base)
    gloo_like = start.slice_bytes is None and start.channels == 1  # Gloo's TCP pairs
    profile = start.replace(name=name or f"{start.name}-calibrated", efficiency={})
    if gloo_like:
        profile = profile.replace(slice_bytes=float(MiB), algorithms={k: list(v) for k, v in GLOO_ALGORITHMS.items()})

    p2p = [m for m in ms if m["op"] == "p2p"]
    tiny = [m for m in ms if m["size"] <= TINY and m["op"] in ("p2p", *FAMILY_OF, "alltoall")]
    rest = [m for m in ms if m["size"] > TINY and (m["op"] == "p2p" or m["op"] in FAMILY_OF or m["op"] == "alltoall")]
    if not rest:
        raise CalibrationError("no probe above 16 KiB of p2p, allreduce, allgather, alltoall or reduce_scatter "
                               "to fit bandwidth parameters")

    profile = profile.replace(wire_efficiency=_fit_wire_efficiency(p2p, profile.wire_efficiency))
    bound = _burst_bound(ms)
    profile = profile.replace(link_burst=min(bound, 0.5e-3), rendezvous=gloo_like,
                              rendezvous_stagger=0.5 if gloo_like else 0.0)
    collective = [m for m in rest if m["op"] != "p2p"]

    for _ in range(sweeps):
        profile = _fit_overheads(profile, tiny, latency)
        if bound > 0:
            profile = _fit_one(profile, _set_burst, collective, 0.0, bound, latency)
        for op, fam in FAMILY_OF.items():
            big = [m for m in rest if m["op"] == op and m["size"] >= LARGE]
            if big:
                profile = _fit_one(profile, _set_efficiency(fam), big, 0.3, 1.0, latency)
        a2a = [m for m in rest if m["op"] == "alltoall" and m["size"] >= LARGE]
        if a2a and gloo_like:
            profile = _fit_one(profile, _set_stagger, a2a, 0.0, 1.0, latency)
            if profile.rendezvous_stagger > 0.98:  # serializing every call does not explain it: slow transfers too
                profile = _fit_one(profile, _set_efficiency("alltoall"), a2a, 0.3, 1.0, latency)
        elif a2a:
            profile = _fit_one(profile, _set_efficiency("alltoall"), a2a, 0.3, 1.0, latency)

    kernels = host_kernel_figures(host_kernels) if host_kernels else {}
    if kernels:
        profile = profile.replace(reduce_bandwidth=kernels.pop("reduce_bandwidth"), codec_bandwidth=kernels,
                                  codec_on_compute=str(host_kernels.get("device", "cpu")).startswith("cpu"))
    profile = _rounded(profile)
    return profile, report(profile, ms, latency)


def host_kernel_figures(hk: dict) -> dict:
    """reduce_bandwidth and codec_bandwidth entries from host kernel timings (ranks.run_host_kernels)."""
    try:
        n, world, sec = int(hk["elements"]), int(hk["world_size"]), dict(hk["seconds"])
    except (KeyError, TypeError, ValueError):
        raise CalibrationError("host kernel timings lack elements, world_size or seconds") from None
    if n < 1 or world < 1 or any(not (isinstance(v, (int, float)) and v > 0) for v in sec.values()):
        raise CalibrationError(f"host kernel timings must be positive, got {sec}")
    out: dict = {}
    if "sum" in sec:
        out["reduce_bandwidth"] = 4.0 * n / sec["sum"]
    t_update = sec.get("update")
    if t_update:
        out["update"] = UPDATE_BYTES_PER_PARAM * n / t_update
        for meth in methods.REGISTRY.values():
            if meth.dense or meth.name not in sec:
                continue
            extra = max(sec[meth.name] - t_update, 0.05 * sec[meth.name])  # the codec's work beyond the update
            out[meth.name] = meth.codec_bytes_per_element(world) * n / extra
    if "vote" in sec and hk.get("vote_bytes"):
        out["vote"] = float(hk["vote_bytes"]) / sec["vote"]
    return out


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _rounded(p: BackendProfile) -> BackendProfile:
    return p.replace(
        wire_efficiency=_sig(p.wire_efficiency), call_overhead=_sig(p.call_overhead),
        message_overhead=_sig(p.message_overhead), link_burst=_sig(p.link_burst),
        rendezvous_stagger=_sig(p.rendezvous_stagger, 3),
        efficiency={k: _sig(v) for k, v in sorted(p.efficiency.items())},
        reduce_bandwidth=None if p.reduce_bandwidth is None else _sig(p.reduce_bandwidth, 3),
        codec_bandwidth={k: _sig(v, 3) for k, v in sorted(p.codec_bandwidth.items())},
    )


def report(profile: BackendProfile, measurements: list[dict], latency: float = 0.0) -> dict:
    """Fitted values (with their meaning) and the residual of every probe."""
    rows = []
    for m in measurements:
        pred = predict(profile, m, latency)
        meas = target(m)
        rows.append({"op": m["op"], "size": m["size"], "ranks": m["ranks"], "bandwidth_bps": m["bandwidth_bps"],
                     "statistic": "min" if m["size"] <= TINY else "median", "measured": meas,
                     "predicted": pred, "rel_error": pred / meas - 1})
    errs = [abs(r["rel_error"]) for r in rows]
    big = [abs(r["rel_error"]) for r in rows if r["size"] >= 4 * MiB]
    fitted = {k: getattr(profile, k) for k in MEANINGS}
    return {
        "fitted": fitted,
        "meanings": dict(MEANINGS),
        "residuals": rows,
        "median_abs_rel_error": statistics.median(errs),
        "max_abs_rel_error": max(errs),
        "median_abs_rel_error_4MiB_up": statistics.median(big) if big else None,
        "max_abs_rel_error_4MiB_up": max(big) if big else None,
        "latency": latency,
    }
