"""`python -m research risk`: fit the convergence-risk rule to a map, check it on held-out regimes, pre-register
calls."""

from __future__ import annotations

import json
import os

from lioncub.apps.autotune import risk_fit, risk_rule
from lioncub.apps.tuned_lr import DEFAULT_LR
from lioncub.files import check_writable, read_json

from . import fit as fitting

MERGE = "python -m research bench convergence-map --merge"  # what makes a merged map


def register(sub) -> None:
    p = sub.add_parser("risk", help="fit autotune's convergence-risk rule to a map, check it, pre-register calls",
                       description="fit: refit the rule to MAP (rewrites lioncub/apps/autotune/risk_fit.py) and check "
                                   "it on MAP's held-out regimes; check: the committed fit on MAP's held-out regimes "
                                   "(all of them for another model); calls: the committed fit's calls for regimes "
                                   "not yet run (a pre-registration)")
    p.add_argument("action", choices=["fit", "check", "calls", "preregister", "report"])
    p.add_argument("map", nargs="?", help="fit, check: a merged convergence map JSON (python -m research bench "
                                          "convergence-map --merge); preregister: the plan (JSON: protocol and "
                                          "sets of regimes); report: the pre-registration")
    p.add_argument("maps", nargs="*", help="report: the merged maps of the pre-registered runs (one per model)")
    p.add_argument("--seen", nargs="*", default=[], metavar="MAP",
                   help="preregister: committed merged maps; a regime on one of them is not fresh")
    p.add_argument("--output", metavar="JSON", help="preregister: the pre-registration (never replaced); report: "
                                                    "the report")
    p.add_argument("--tuned", action="append", default=[], metavar="MODEL=LR",
                   help="report: the lr a model's regimes were run against (its measured best; default its default lr)")
    p.add_argument("--check-output", metavar="JSON", help="write the check (fit, check) or the calls (calls) here")
    p.add_argument("--regimes", default=",".join(fitting.FRESH),
                   help="calls: comma-separated [model:]N<ranks>-b<batch>-x<lr / tuned lr> (default: FRESH)")
    p.add_argument("--configs", default="vote-1bit,vote-pbit,l1-pbit,vote-1bit@adaptive", help="calls: method[@sync]")
    p.add_argument("--steps", type=int, default=200, help="calls: the run's steps (the map's: 200)")
    p.add_argument("--tuned-lr", dest="tuned_lr", type=float,
                   help="check: the lr MAP's model trains best at (default: its default lr)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.check_output:
        check_writable(args.check_output, "--check-output")
    if args.action == "calls":
        return _calls(args)
    if args.action in ("preregister", "report"):
        return _preregistered(args)
    if not args.map:
        raise ValueError(f"risk {args.action} needs MAP, a convergence map JSON")
    if not os.path.isfile(args.map):
        raise ValueError(f"risk {args.action}: no file {args.map}")
    try:
        with open(args.map) as f:
            map_res = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.map} is not JSON ({e})") from None
    if not isinstance(map_res, dict) or not map_res.get("cells") or "model" not in map_res:
        raise ValueError(f"{args.map} is not a merged convergence map ({MERGE})")
    fitted = fitting.fit(map_res) if args.action == "fit" else risk_rule.FIT
    result = fitting.check(map_res, fitted, tuned_lr=args.tuned_lr)
    rate = result["hit_rate"]
    text = "" if not result["held_out_cells"] else (
        f"{result['low_within_2pct']} of {result['low']} low-risk cells within 2% of the baseline"
        + (f" ({100 * rate:.0f}%)" if rate is not None else "")
        + f"; {result['within_2pct']} of the {result['held_out_cells']} held-out cells were within 2%, "
        + f"{result['low_within_2pct']} of them called low")
    fitted = dict(fitted, check=text)
    if args.action == "fit":
        _write_fit(fitted, risk_fit.__file__)
    if args.check_output:
        with open(args.check_output, "w") as f:
            json.dump(dict(fit=fitted, **result), f, indent=1)
    print(text or f"no regime of {args.map} is held out of the fit")
    for r in result["cells"]:
        print(f"  {r['regime']:<14} {r['config']:<20} {r['level']:<6} score {r['score']:.2f}  measured "
              f"{100 * r['measured']:+.1f}%")
    return 0


def _calls(args) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    rows = []
    for reg in args.regimes.split(","):
        model, n, b, x = fitting.parse_regime(reg)
        tuned = DEFAULT_LR[model or risk_rule.FIT["model"]]
        for config in args.configs.split(","):
            method, _, sync = config.partition("@")
            r = risk_rule.risk(method, n, None, sync or "none", args.steps, batch_size=b, lr=x * tuned,
                               tuned_lr=tuned)
            rows.append(dict(regime=reg.strip(), config=config, level=r["level"], score=r["score"]))
            print(f"  {reg.strip():<14} {config:<20} {r['level']:<6} score {r['score']:.3f}")
    if args.check_output:
        with open(args.check_output, "w") as f:
            json.dump(dict(fit=risk_rule.FIT, steps=args.steps, calls=rows), f, indent=1)
    return 0


def _preregistered(args) -> int:
    from . import preregister

    if not args.map:
        raise ValueError(f"risk {args.action} needs {'PLAN' if args.action == 'preregister' else 'PREREG'} (JSON)")
    if args.output:
        check_writable(args.output, "--output")
    if args.action == "preregister":
        seen = preregister.seen_regimes([read_json(m, "--seen map") for m in args.seen])
        prereg = preregister.register(read_json(args.map, "plan"), seen)
        prereg["seen_maps"] = list(args.seen)
        if args.output:
            preregister.write(prereg, args.output)
        for c in prereg["calls"]:
            print(f"  {c['set']:<6} {c['model']}:{c['regime']:<12} {c['config']:<20} {c['level']:<6} score "
                  f"{c['score']:.3f}")
        print("calls per level: " + ", ".join(f"{k} {v}" for k, v in prereg["counts"].items()))
        return 0
    tuned = {}
    for item in args.tuned:
        model, _, lr = item.partition("=")
        try:
            tuned[model] = float(lr)
        except ValueError:
            raise ValueError(f"--tuned takes MODEL=LR, got {item!r}") from None
    maps = {}
    for path in args.maps:
        m = read_json(path, "map")
        if not isinstance(m, dict) or "model" not in m or "runs" not in m:
            raise ValueError(f"{path} is not a merged convergence map ({MERGE})")
        maps[m["model"]] = m
    rep = preregister.report(read_json(args.map, "pre-registration"), maps, tuned)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rep, f, indent=1)
    print(preregister.format_report(rep))
    return 0


def _write_fit(fitted: dict, path: str) -> None:
    import pprint

    with open(path, "w") as f:
        f.write('"""The convergence map fitted for the risk rule (written by `python -m research risk '
                'fit`; do not edit)."""\n\n')
        f.write("FIT = " + pprint.pformat(fitted, width=116, sort_dicts=True) + "\n")
