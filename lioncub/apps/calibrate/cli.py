"""`lioncub calibrate`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lioncub.files import check_writable, read_json

from . import _in_torchrun, calibrate_lab, run_torchrun
from .fit import fit


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit the simulator's backend profile to measurements (lab or torchrun)",
        description="Time point-to-point and collective probes (4 KiB to tens of MiB) and the optimizer's "
        "codec kernels, then fit the simulator's backend profile: framing efficiency, per-call and "
        "per-message overheads, per-op-family efficiency, burst credit, Gloo's rendezvous serialization, "
        "reduction and codec speeds. Writes a JSON profile for `lioncub simulate ... --calibration FILE`. "
        "Run it on the lab (--lab, needs root) or under torchrun on a real cluster (same command without "
        "--lab; give the NIC rate with --bandwidth).",
    )
    p.add_argument("--lab", action="store_true", help="measure on an emulated lab cluster (needs root)")
    p.add_argument("--ranks", type=int, default=4, help="lab ranks (default 4)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="lab ranks per host (default 1)")
    p.add_argument("--bandwidth", default=None,
                   help="per-link line rate, e.g. 500Mbit (lab default 500Mbit; required under torchrun)")
    p.add_argument("--latency", default="0",
                   help="one-way latency the profile will be simulated with; overheads are fitted net of it "
                   "(the lab adds none: 0)")
    p.add_argument("--burst", default=None, help="lab tbf bucket as line time (default: the lab's 4ms)")
    p.add_argument("--output", "-o", default="calibration.json", help="calibration file to write")
    p.add_argument("--base", default="gloo", choices=["gloo", "nccl"], help="built-in profile to refine")
    p.add_argument("--name", default=None, help="profile name in the file (default BASE-calibrated)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller probes (about half a minute)")
    p.add_argument("--rounds", type=int, default=None, help="passes over the probes, alternating order "
                   "(default 2; 1 with --quick)")
    p.add_argument("--no-codec", action="store_true", help="skip timing the optimizer's codec kernels")
    p.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"],
                   help="torchrun: process-group backend (default nccl with CUDA, else gloo)")
    p.add_argument("--save-measurements", default=None, metavar="FILE", help="also write the raw measurements")
    p.add_argument("--from-measurements", default=None, metavar="FILE",
                   help="fit measurements saved by --save-measurements instead of measuring")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary (fitted values, residuals)")
    p.set_defaults(func=_main)


def _load_raw(path) -> dict:
    raw = read_json(path, "measurements file")
    if isinstance(raw, list):
        raw = {"measurements": raw}
    if not isinstance(raw, dict) or not isinstance(raw.get("measurements"), list):
        raise ValueError(f"{path}: expected an object with a 'measurements' list (from --save-measurements)")
    return raw


def _main(args) -> int:
    from lioncub.simulator.units import parse_time

    t0 = time.perf_counter()
    latency = parse_time(args.latency)
    if latency < 0:
        raise ValueError(f"--latency must be >= 0, got {args.latency!r}")
    progress = not args.no_progress and not args.json and sys.stderr.isatty()
    check_writable(args.output, "--output")
    if args.save_measurements:
        check_writable(args.save_measurements, "--save-measurements")
    if args.from_measurements:
        raw = _load_raw(args.from_measurements)
    elif args.lab:
        if latency:
            from lioncub.apps.lab import check_latency

            check_latency(args.latency)
        if args.base != "gloo":
            raise ValueError("the lab runs Gloo: --base nccl applies to torchrun calibrations of NCCL clusters")
        from lioncub.apps.lab.netns import LabError, require_privileges

        try:
            require_privileges()
            raw = calibrate_lab(args.ranks, args.bandwidth or "500Mbit", args.ranks_per_host, args.burst,
                                args.quick, args.rounds, not args.no_codec, progress)
        except LabError as exc:
            print(f"lioncub calibrate: error: {exc}", file=sys.stderr)
            return 1
    else:
        if not _in_torchrun():
            raise ValueError("nothing to measure: pass --lab (emulated cluster, needs root), run under torchrun "
                             "on a real cluster, or fit saved measurements with --from-measurements FILE")
        if not args.bandwidth:
            raise ValueError("under torchrun give the NIC line rate with --bandwidth (e.g. 25Gbit)")
        raw = run_torchrun(args.bandwidth, args.quick, args.rounds, not args.no_codec, args.dist_backend, progress)
        if raw is None:  # not rank 0
            return 0
    if args.save_measurements:
        Path(args.save_measurements).write_text(json.dumps(raw, indent=1) + "\n")
    base = args.base
    if raw.get("setting", {}).get("backend") == "nccl" and args.base == "gloo" and not args.from_measurements:
        base = "nccl"
    profile, rep = fit(raw["measurements"], raw.get("host_kernels"), base=base, latency=latency, name=args.name)
    profile.save(args.output)
    summary = {"seconds": time.perf_counter() - t0, "output": str(args.output), "setting": raw.get("setting"),
               "profile": profile.to_dict(), "host_kernels": raw.get("host_kernels"), **rep}
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_summary(summary)
    return 0


def _print_summary(s: dict) -> None:
    from lioncub.simulator.units import format_rate, format_size, format_time

    st = s.get("setting") or {}
    where = st.get("where", "saved measurements")
    head = f"calibrated {s['profile']['name']} from {len(s['residuals'])} probes ({where}"
    if st.get("ranks"):
        head += f", {st['ranks']} ranks at {format_rate(st['bandwidth_bps'])}"
    print(head + f") -> {s['output']}")
    f = s["fitted"]
    print(f"  wire_efficiency   {f['wire_efficiency']:.4f}")
    print(f"  call_overhead     {format_time(f['call_overhead'])}")
    print(f"  message_overhead  {format_time(f['message_overhead'])}")
    print(f"  link_burst        {format_time(f['link_burst'])} of line time")
    print("  efficiency        " + ", ".join(f"{k} {v:.3f}" for k, v in f["efficiency"].items()))
    print(f"  rendezvous        {'yes' if f['rendezvous'] else 'no'}, stagger {f['rendezvous_stagger']:.3f}")
    if f["reduce_bandwidth"]:
        print(f"  reduce_bandwidth  {format_size(f['reduce_bandwidth'])}/s")
    if f["codec_bandwidth"]:
        print("  codec_bandwidth   " + ", ".join(f"{k} {format_size(v)}/s" for k, v in f["codec_bandwidth"].items()))
    print(f"  fit: median |error| {100 * s['median_abs_rel_error']:.1f}%, worst {100 * s['max_abs_rel_error']:.1f}%")
    for r in s["residuals"]:
        print(f"    {r['op']:<15} {format_size(r['size']):>10}  measured {format_time(r['measured']):>9} "
              f"({r['statistic']})  predicted {format_time(r['predicted']):>9}  {100 * r['rel_error']:+6.1f}%")
