"""`lioncub demo` (`make demo`): the main job on an embedded default.

Trains the small character transformer on Python's own documentation with 4 Gloo ranks on this machine,
once per method, and prints loss, step time and bytes per step relative to the `allreduce` baseline.
"""

from __future__ import annotations

DEFAULT_METHODS = ("allreduce", "vote-1bit", "l1-pbit")


def register(sub) -> None:
    p = sub.add_parser("demo", help="train the default scenario with each method and compare (make demo)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--model", default="char-tiny")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import sys

    from lioncub.train.loop import TrainConfig, train_local

    print(f"lioncub demo: {args.model} on Python's docs, {args.ranks} Gloo ranks on this machine, "
          f"{args.steps} steps per method")
    results = []
    for method in args.methods:
        cfg = TrainConfig(model=args.model, method=method, steps=args.steps)
        s = train_local(cfg, args.ranks, progress=sys.stderr.isatty())
        s.pop("records", None)
        results.append(s)
        print(f"  {method:14s} loss {s['final_loss']:.4f}  step {1e3 * s['step_seconds']:6.1f} ms  "
              f"{s['bytes_per_step'] / 1e3:9.1f} kB/step")
    base = next((r for r in results if r["method"] == "allreduce"), results[0])
    print()
    print(table(results, base))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def table(results, base) -> str:
    head = (f"{'method':14s} {'eval loss':>9s} {'vs base':>8s} {'step ms':>8s} {'vs base':>8s} "
            f"{'kB/step':>9s} {'vs base':>8s}")
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r['method']:14s} {r['final_loss']:9.4f} {r['final_loss'] / base['final_loss']:8.3f} "
            f"{1e3 * r['step_seconds']:8.1f} {r['step_seconds'] / base['step_seconds']:8.2f} "
            f"{r['bytes_per_step'] / 1e3:9.1f} {r['bytes_per_step'] / max(1, base['bytes_per_step']):8.3f}")
    return "\n".join(rows)
