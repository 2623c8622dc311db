"""`lioncub lab {up,down,list,clean,bench,run}`. Imports stay light: torch loads only in the ranks.

The calibrated simulator's validation on the lab (`python -m research lab validate`) lives with the research
tools and uses `guard` from here.
"""

from __future__ import annotations

import argparse
import json
import sys

NO_NETEM = (
    "This kernel has no netem qdisc, so the lab cannot add delay: --latency must be 0 (links keep the "
    "namespaces' native delay, tens of microseconds). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)."
)


def register(sub) -> None:
    """Register `lioncub lab`."""
    p = sub.add_parser(
        "lab",
        help="emulated Ethernet cluster on this machine (network namespaces + tbf)",
        description="An emulated Ethernet cluster: N hosts, each a network namespace with a veth link "
        "to a switch namespace, shaped with tc tbf in both directions; real torch.distributed ranks "
        "run over Gloo/TCP through it. " + NO_NETEM,
    )
    lsub = p.add_subparsers(dest="lab_command", metavar="{up,down,list,clean,bench,run}")
    for add in (_add_up, _add_down, _add_list, _add_clean, _add_bench, _add_run):
        add(lsub)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _add_up(lsub) -> None:
    up = lsub.add_parser("up", help="build a lab that stays up until `lab down`", description=NO_NETEM)
    _topology(up, attach=False)
    up.add_argument("--json", action="store_true", help="print the lab as JSON")
    up.set_defaults(func=_up)


def _add_down(lsub) -> None:
    down = lsub.add_parser("down", help="tear down labs made by `lab up`")
    down.add_argument("run_ids", nargs="*", metavar="RUN_ID")
    down.add_argument("--all", action="store_true", help="every lab made by `lab up`")
    down.set_defaults(func=_down)


def _add_list(lsub) -> None:
    ls = lsub.add_parser("list", help="list lioncub labs on this machine")
    ls.set_defaults(func=_list)


def _add_clean(lsub) -> None:
    clean = lsub.add_parser(
        "clean",
        help="remove what crashed runs left (namespaces named lioncub-*)",
        description="Remove the namespaces, links, processes and state of lioncub labs whose owner "
        "process is gone. Live runs and `lab up` labs are kept unless --all.",
    )
    clean.add_argument("--all", action="store_true", help="also remove live runs and `lab up` labs")
    clean.set_defaults(func=_clean)


def _add_bench(lsub) -> None:
    from .probes import DTYPES, OPS

    bench = lsub.add_parser(
        "bench",
        help="time a real collective in the lab",
        description="Time a collective over Gloo in the lab: warm-up, --repeat timed calls (each the "
        "slowest rank's time), median. SIZE is each rank's whole buffer in bytes (all-reduce input, "
        "all-gather output, all-to-all send buffer, reduce-scatter input), as in `lioncub simulate "
        "collective`; for the lioncub composite ops it is the fp32 bucket synchronized. " + NO_NETEM,
    )
    bench.add_argument("--op", required=True, choices=OPS)
    bench.add_argument("--ranks", type=int, required=True)
    bench.add_argument("--size", required=True, help="bytes, e.g. 4MiB")
    _topology(bench, ranks=False)
    bench.add_argument("--repeat", type=int, default=5)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--dtype", default="float32", choices=DTYPES, help="plain ops only")
    bench.add_argument("--levels", type=int, default=None, help="l1-pbit levels (default 127//N)")
    bench.add_argument("--json", action="store_true", help="print the measurement as one JSON object")
    bench.set_defaults(func=_bench)


def _add_run(lsub) -> None:
    run = lsub.add_parser(
        "run",
        help="run a command once per rank in the lab (torchrun-style environment)",
        description="Run COMMAND once per rank, each inside its host's namespace, with RANK, "
        "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT (host 0) and GLOO_SOCKET_IFNAME set. Rank 0's "
        "output goes to the terminal. The first rank to fail stops the run. " + NO_NETEM,
    )
    run.add_argument("--ranks", type=int, default=None, help="default: hosts x ranks-per-host")
    _topology(run, ranks=False)
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run is killed")
    run.add_argument("--json", action="store_true", help="print each rank's reported result as JSON")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    run.set_defaults(func=_run)


def _topology(p, ranks: bool = True, attach: bool = True) -> None:
    if ranks:
        p.add_argument("--ranks", type=int, default=None, help="hosts = ranks / ranks-per-host")
    p.add_argument("--hosts", type=int, default=None, help="default: ranks / ranks-per-host")
    p.add_argument("--ranks-per-host", type=int, default=None, help="emulate nodes x GPUs (default 1)")
    p.add_argument(
        "--bandwidth", default=None, help="per-link rate, both directions, e.g. 100Mbit (default 1Gbit)"
    )
    p.add_argument("--latency", default="0", help="must be 0: this kernel has no netem, so no delay")
    p.add_argument(
        "--burst", default=None,
        help="tbf bucket as line time (default 4ms, one timer tick: the least that holds the rate on a "
        "busy machine; smaller makes short transfers more faithful on a quiet one)",
    )
    p.add_argument(
        "--congestion-control", default=None, metavar="NAME",
        help="the hosts' TCP congestion control (default cubic, Linux's default; 'system' keeps this machine's)",
    )
    if attach:
        p.add_argument(
            "--lab", default=None, metavar="RUN_ID",
            help="use a lab made by `lab up` (its rate unless --bandwidth is given)",
        )


def guard(fn):
    """Fail at once without privileges; report lab failures as one clear line, exit status 1."""

    def wrapped(args):
        from .netns import LabError, require_privileges

        try:
            if getattr(args, "latency", None) is not None:
                from .lab import check_latency

                check_latency(args.latency)
            require_privileges()
            return fn(args)
        except LabError as exc:
            print(f"lioncub lab: error: {exc}", file=sys.stderr)
            return 1
        except NotImplementedError as exc:
            print(f"lioncub lab: error: {exc}", file=sys.stderr)
            return 2

    return wrapped


def _hosts(args, ranks: int | None) -> tuple[int, int]:
    from .lab import ranks_per_host_for

    if ranks is None:
        return (args.hosts or 2), (args.ranks_per_host or 1)
    rph = ranks_per_host_for(ranks, args.hosts, args.ranks_per_host)
    return ranks // rph, rph


@guard
def _up(args) -> int:
    from lioncub.simulator.units import parse_rate, parse_time

    from . import netns
    from .lab import Lab

    hosts, rph = _hosts(args, args.ranks)
    burst_s = netns.TICK_S if args.burst is None else parse_time(args.burst)
    net = netns.create(hosts, parse_rate(args.bandwidth or "1Gbit"), persistent=True, burst_s=burst_s,
                       congestion=args.congestion_control or netns.CONGESTION)
    info = Lab(attach=net.run_id, ranks_per_host=rph).up().describe()
    if args.json:
        print(json.dumps(info))
    else:
        print(f"lab {net.run_id} up: {hosts} hosts at {info['bandwidth']}; "
              f"`lioncub lab down {net.run_id}` removes it")
    return 0


@guard
def _down(args) -> int:
    from . import netns

    found = netns.runs()
    if args.all:
        targets = [rid for rid, info in found.items() if info["network"] and info["network"].persistent]
    elif args.run_ids:
        targets = args.run_ids
    else:
        raise ValueError("name the labs to tear down (see `lioncub lab list`) or pass --all")
    for rid in targets:
        if rid not in found:
            raise ValueError(f"no lab {rid!r} (see `lioncub lab list`)")
        netns.remove_run(rid, found[rid]["namespaces"])
        print(f"lab {rid} down")
    return 0


@guard
def _list(args) -> int:
    from . import netns

    for rid, info in sorted(netns.runs().items()):
        net = info["network"]
        kind = "persistent" if net and net.persistent else ("live" if info["live"] else "stale")
        detail = f"{len(net.hosts)} hosts at {net.rate_bps / 1e6:g} Mbit/s" if net else "no state file"
        print(f"{rid}  {kind:10s} {detail}  ({len(info['namespaces'])} namespaces)")
    return 0


@guard
def _clean(args) -> int:
    from . import netns

    removed = netns.clean(everything=args.all)
    print(f"removed {len(removed)} lab(s)" + (f": {', '.join(removed)}" if removed else ""))
    left = netns.leftovers()
    if not args.all and left["namespaces"]:
        print(f"kept live labs: {len(left['namespaces'])} namespaces (use --all to remove them too)")
    return 0


@guard
def _bench(args) -> int:
    from .lab import Lab, ranks_per_host_for
    from .probes import bench_many, normalize

    rph = ranks_per_host_for(args.ranks, args.hosts, args.ranks_per_host)
    probe = normalize(dict(op=args.op, size=args.size, repeat=args.repeat, warmup=args.warmup,
                           dtype=args.dtype, levels=args.levels, ranks=args.ranks))
    lab = Lab(ranks=args.ranks, ranks_per_host=rph, bandwidth=args.bandwidth or "1Gbit", attach=args.lab,
              burst=args.burst, congestion=args.congestion_control)
    with lab:
        probe["bandwidth"] = args.bandwidth or lab.rate_bps
        res = bench_many(lab, [probe])[0]
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['op']} {res['bytes']} B on {res['ranks']} ranks ({res['hosts']} hosts) at "
              f"{res['bandwidth']}: {res['seconds'] * 1e3:.2f} ms median of {len(res['times'])}")
    return 0


@guard
def _run(args) -> int:
    from .lab import Lab

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("give the command to run after --, e.g. `lioncub lab run --ranks 4 -- train.py`")
    hosts, rph = _hosts(args, args.ranks)
    with Lab(hosts=hosts, ranks_per_host=rph, bandwidth=args.bandwidth or "1Gbit", attach=args.lab,
              burst=args.burst, congestion=args.congestion_control) as lab:
        if args.lab and args.bandwidth:
            lab.set_bandwidth(args.bandwidth)
        results = lab.run(cmd, ranks=args.ranks, timeout=args.timeout, stream_rank0=True)
    if args.json:
        print(json.dumps([r.result for r in results]))
    return 0
