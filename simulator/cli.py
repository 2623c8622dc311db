"""`lioncub simulate {collective,step,sweep}`. Imports no torch (and nothing heavy until a command runs).

    lioncub simulate collective --op allreduce --algorithm ring --backend nccl --ranks 16 --size 256MiB \\
        --bandwidth 10Gbit --latency 1ms [--gpus-per-node 8] [--calibration gloo.json] [--exact] [--json]
    lioncub simulate step --method vote-1bit --momentum-sync 100 --params 1.3B --compute-seconds 0.3 \\
        --ranks 64 --gpus-per-node 8 --bandwidth 10Gbit --latency 50us [--json]
    lioncub simulate sweep --method vote-1bit,l1-pbit --ranks 8,32,128 --bandwidth 1Gbit,10Gbit,100Gbit \\
        --params 1.3B --compute-seconds 0.3 [--plot speedup.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lioncub import methods

_OPS_HELP = ("allreduce, allgather, reducescatter, alltoall, broadcast, reduce, or a lioncub composite: "
             + ", ".join([*methods.COMPRESSED, "momentum-sync"]))


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="predict collective and training-step times (no GPU needed)",
                              description="A SimPy model of an Ethernet cluster. See docs/simulator.md.")
    sub = p.add_subparsers(dest="simulate", metavar="WHAT")

    c = sub.add_parser("collective", help="one collective (or lioncub composite) on a cluster",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("--op", required=True, help=_OPS_HELP)
    c.add_argument("--algorithm", default="auto",
                   help="algorithm name, 'auto' (fastest the backend offers), or for composites "
                        "'alltoall=pairwise,allgather=ring'")
    c.add_argument("--size", required=True,
                   help="bytes of each rank's whole buffer (allreduce input, all-to-all send buffer, "
                        "all-gather output); for composites the fp32 bucket, e.g. 256MiB")
    c.add_argument("--ranks", type=int, required=True, help="number of ranks (GPUs)")
    c.add_argument("--levels", type=int, default=None, help="l1-pbit levels (default: lioncub's)")
    c.add_argument("--timeline", action="store_true", help="include every rank's timeline in --json")
    c.add_argument("--hierarchical", action="store_true",
                   help="a composite in LionCub's hierarchical layout (nodes of --gpus-per-node ranks)")
    _common(c)
    c.set_defaults(func=_collective)

    s = sub.add_parser("step", help="one training step: compute, codec, communication, speedup",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--method", default="vote-1bit", choices=methods.NAMES)
    s.add_argument("--ranks", type=int, required=True, help="number of ranks (GPUs)")
    _step_args(s)
    s.add_argument("--momentum-sync", type=int, default=0, metavar="K",
                   help="average momentum every K steps (0: never)")
    s.add_argument("--local-steps", type=int, default=None, metavar="H",
                   help="LionCub(local_steps=H): the method's exchange of the pseudo-gradients every H steps")
    s.add_argument("--fragments", type=int, default=None, metavar="F",
                   help="with --local-steps: the outer exchanges streamed in F fragments (LionCub(fragments=F))")
    s.add_argument("--outer-delay", type=int, default=None, metavar="D",
                   help="with --fragments: inner steps each streamed exchange overlaps (default 1 when 1 < F < H)")
    _common(s)
    s.set_defaults(func=_step)

    w = sub.add_parser("sweep", help="speedup table (and plot) over bandwidths, rank counts, methods",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("--method", default="vote-1bit", help="comma-separated methods: " + ", ".join(methods.NAMES))
    w.add_argument("--ranks", required=True, help="comma-separated rank counts, e.g. 8,32,128")
    _step_args(w)
    w.add_argument("--momentum-sync", default="0", metavar="K[,K...]",
                   help="comma-separated momentum-sync intervals (0: never)")
    w.add_argument("--plot", default=None, metavar="PNG", help="write speedup vs bandwidth to this file")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(w, many=True)
    w.set_defaults(func=_sweep)

    p.set_defaults(func=lambda args: p.print_help() or 2)


def _common(p, many: bool = False) -> None:
    g = p.add_argument_group("cluster")
    lst = " (comma-separated list)" if many else ""
    g.add_argument("--bandwidth", default="10Gbit", help="NIC line rate per node, bits/s: 10Gbit, 100Mbit" + lst)
    g.add_argument("--latency", default="20us", help="one-way host-to-host latency: 20us, 1ms" + lst)
    g.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node")
    g.add_argument("--intra-bandwidth", default="800Gbit", help="each GPU's port inside a node")
    g.add_argument("--intra-latency", default="2us", help="latency inside a node")
    g.add_argument("--topology", default="switch", choices=["switch", "leaf-spine"])
    g.add_argument("--nodes-per-leaf", type=int, default=None, help="leaf-spine: nodes under each leaf")
    g.add_argument("--oversubscription", type=float, default=1.0, help="leaf-spine: 2 means 2:1")
    b = p.add_argument_group("backend")
    b.add_argument("--backend", default="nccl", help="nccl, gloo or ideal")
    b.add_argument("--calibration", default=None, metavar="FILE",
                   help="JSON profile fields laid over --backend (from a calibration run)")
    p.add_argument("--exact", action="store_true",
                   help="simulate every rank and every message, and with auto every candidate (slow at scale; "
                        "for checking the fast path: representative ranks, classes of ranks, fast-forwarded "
                        "steady states, pruned candidates)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _step_args(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--params", required=True, help="number of parameters: 1.3B, 125M, 7e9")
    g.add_argument("--compute-seconds", default=None, help="forward + backward time per step (e.g. 0.3, 300ms)")
    g.add_argument("--flops", default=None, help="achievable FLOP/s per GPU (with --tokens): 4e14, 400T")
    g.add_argument("--tokens", default=None, help="tokens per step per rank (with --flops)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, MiB of fp32 gradients")
    g.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="gradients on the wire: a dense method's allreduce, the hierarchical reduce-scatter")
    g.add_argument("--levels", type=int, default=None, help="l1-pbit levels (default: lioncub's)")
    g.add_argument("--memory-bandwidth", default="2TB/s", help="device memory bandwidth for kernel times")
    g.add_argument("--algorithm", default="auto", help="'auto', an algorithm name, or 'op=alg,...'")
    g.add_argument("--hierarchical", action="store_true",
                   help="LionCub's hierarchical layout: nodes of --gpus-per-node ranks reduce-scatter inside, the "
                        "method's collectives run across nodes on shards, then all-gather inside")
    g.add_argument("--sharded", action="store_true",
                   help="the model sharded by FSDP2 inside nodes of --gpus-per-node ranks (HSDP): all-gathers and a "
                        "reduce-scatter inside the node, the method across nodes on each rank's 1/G shard "
                        "(--method allreduce: FSDP2's own HSDP, its fp32 all-reduce, and plain Lion); "
                        "--bucket-mb is then the size of an FSDP unit")
    g.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="--sharded: the parameters' all-gather dtype (FSDP2's MixedPrecisionPolicy)")
    g.add_argument("--no-overlap", action="store_true",
                   help="the allreduce baseline reduces after backward, as LionCub(method='allreduce') does "
                        "(default: overlapped with backward, as DDP does)")


def _profile(args):
    from .profiles import BackendProfile, get_profile

    if args.calibration:
        return BackendProfile.load(args.calibration, base=args.backend)
    return get_profile(args.backend)


def _cluster(args, ranks: int, bandwidth=None, latency=None):
    from .net.cluster import Cluster

    return Cluster.for_ranks(
        ranks, args.gpus_per_node,
        bandwidth=args.bandwidth if bandwidth is None else bandwidth,
        latency=args.latency if latency is None else latency,
        intra_bandwidth=args.intra_bandwidth, intra_latency=args.intra_latency,
        topology=args.topology, nodes_per_leaf=args.nodes_per_leaf, oversubscription=args.oversubscription,
    )


def _dump(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _collective(args) -> int:
    from .collectives.simulate import simulate_collective
    from .units import format_rate, format_size, format_time

    cluster = _cluster(args, args.ranks)
    profile = _profile(args)
    t0 = time.perf_counter()
    r = simulate_collective(cluster, args.op, args.algorithm, args.size, profile, timeline=args.timeline,
                            levels=args.levels, exact=args.exact, hierarchical=args.hierarchical)
    wall = time.perf_counter() - t0
    if args.json:
        _dump({**r.to_dict(), "cluster": cluster.to_dict(), "profile": profile.to_dict(), "exact": args.exact,
               "wall_seconds": wall})
        return 0
    print(f"{r.op} / {r.algorithm} on {profile.name}: {cluster.describe()}")
    line = f"  {format_size(r.size_bytes)} -> {format_time(r.seconds)}"
    if r.seconds > 0 and r.busbw is not None:
        line += f"   algbw {format_rate(8 * r.algbw)}, busbw {format_rate(8 * r.busbw)}"
    print(line)
    print(f"  sent per rank {format_size(r.bytes_sent_per_rank)}, received {format_size(r.bytes_received_per_rank)}")
    for part in r.parts:
        print(f"  part {part['op']} / {part['algorithm']}: {format_size(part['size_bytes'])} "
              f"{part['dtype']} -> {format_time(part['seconds'])}")
    if r.candidates:
        print("  auto: " + ", ".join(f"{a} {format_time(t)}" for a, t in sorted(r.candidates.items(),
                                                                                 key=lambda kv: kv[1])))
    for part in [r.to_dict(), *r.parts]:
        for a, why in (part.get("pruned") or {}).items():
            print(f"  auto: {a} not simulated: {why['reason']}")
    return 0


def _step_kwargs(args) -> dict:
    if args.compute_seconds is None and (args.flops is None or args.tokens is None):
        raise ValueError("give --compute-seconds, or --flops and --tokens")
    return dict(params=args.params, bucket_mb=args.bucket_mb, compute_seconds=args.compute_seconds,
                flops_per_second=args.flops, tokens_per_step=args.tokens, algorithm=args.algorithm,
                grad_dtype=args.grad_dtype, levels=args.levels, memory_bandwidth=args.memory_bandwidth,
                overlap=not args.no_overlap, hierarchical=args.hierarchical, sharded=args.sharded,
                param_dtype=args.param_dtype)


def _step(args) -> int:
    from .step.model import simulate_step
    from .units import format_size, format_speedup, format_time

    cluster = _cluster(args, args.ranks)
    profile = _profile(args)
    r = simulate_step(cluster, args.method, momentum_sync=args.momentum_sync or None, backend=profile,
                      exact=args.exact, local_steps=args.local_steps, fragments=args.fragments,
                      outer_delay=args.outer_delay, **_step_kwargs(args))
    if args.json:
        _dump({**r.to_dict(), "cluster": cluster.to_dict()})
        return 0
    print(f"{r.method} on {profile.name}: {cluster.describe()}, {r.params:.4g} params, {r.buckets} buckets"
          + (f", momentum sync every {r.momentum_sync}" if r.momentum_sync else "")
          + (f", hierarchical (nodes of {r.node_size})" if r.hierarchical else "")
          + (f", sharded (HSDP, nodes of {r.node_size})" if r.sharded else "")
          + (f", local steps: the exchange every {r.local_steps} steps" if r.local_steps else "")
          + (f", streamed in {r.fragments} fragments, each applied {r.outer_delay} steps later" if r.fragments
             else ""))
    for name, v in (("compute", r.compute_seconds), ("codec", r.codec_seconds),
                    ("optimizer", r.optimizer_seconds), ("communication", r.communication_seconds),
                    ("  of which momentum sync", r.momentum_sync_seconds),
                    ("exposed communication", r.exposed_communication_seconds),
                    *((("FSDP's, inside fwd/bwd", r.fsdp_exposed_seconds),) if r.sharded else ())):
        print(f"  {name:<26}{format_time(v):>12}")
    print(f"  {'step':<26}{format_time(r.step_seconds):>12}"
          + (f"  ({format_time(r.step_interval[0])} - {format_time(r.step_interval[1])})" if r.step_interval else ""))
    print(f"  {'HSDP + Lion baseline' if r.sharded else 'fp32 allreduce baseline':<26}"
          f"{format_time(r.baseline_step_seconds):>12}")
    print(f"  memory per rank (p, g, m)  {format_size(r.memory_bytes_per_rank):>12}  "
          f"{r.memory_fraction:.3f} of an unsharded replica's")
    print(f"  speedup {format_speedup(r.speedup, r.speedup_interval)}, sent per rank per step "
          f"{format_size(r.bytes_sent_per_rank)}, "
          f"out of each node's NIC {format_size(r.nic_bytes_per_node)}")
    for c in r.collectives:
        print(f"    {c['count']:>4} x {c['what']} ({c['algorithm']}) {format_size(c['size_bytes'])}: "
              f"{format_time(c['seconds'])}" + (f" every {round(1 / c['per_step'])} steps"
                                                 if c["per_step"] < 1 else ""))
    return 0


def _sweep(args) -> int:
    from .sweep import format_table, plot, sweep
    from .units import parse_list

    ranks = [int(x) for x in parse_list(args.ranks, lambda t: _int(t, "--ranks"))]
    ks = [int(k) or None for k in parse_list(args.momentum_sync, lambda t: _int(t, "--momentum-sync"))]
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    rows = sweep(
        ranks=ranks, bandwidths=args.bandwidth.split(","), latencies=args.latency.split(","),
        methods=methods, momentum_syncs=ks, gpus_per_node=args.gpus_per_node, backend=_profile(args),
        cluster_kwargs=dict(intra_bandwidth=args.intra_bandwidth, intra_latency=args.intra_latency,
                            topology=args.topology, nodes_per_leaf=args.nodes_per_leaf,
                            oversubscription=args.oversubscription),
        progress=False if args.no_progress else None, exact=args.exact, **_step_kwargs(args),
    )
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        out = {"seconds": [r["step_seconds"] for r in rows], "rows": rows}
        if args.plot:
            out["plot"] = args.plot
        _dump(out)
        return 0
    print(format_table(rows))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def _int(text: str, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"{what}: not an integer: {text!r}") from None
    if v < 0:
        raise ValueError(f"{what}: must be >= 0, got {v}")
    return v
