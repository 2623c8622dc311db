"""Pre-registered calls of the risk rule, checked at every level (issue 30).

`register(plan)` takes a plan (sets of regimes not yet run: a model, its steps, the regimes as N<ranks>-b<batch>-
x<lr / tuned lr>, the configurations, the seeds and how many must finish, the training set-up, where it runs) and
adds the committed rule's call (low, medium or high) for every (regime, configuration), and for each regime the
rule's prescription for plain vote-1bit (a dense warm-up of `dense_warmup_for(level, steps)` steps where it is
not low). It refuses a regime that was already run (on a committed map of that model, or in the fit), a plan in
which a level gets no call, and an existing output file: a pre-registration is written once, committed, and
only then are its regimes run. Every call is run, whatever its level.

`report(prereg, maps)` reads the merged maps of the runs and gives, per set and in all, per level: the calls, how
many have their registered seeds, how many of those are within 2% of the allreduce baseline (the mean over the
registered seeds of each seed's final-loss ratio, <= 1.02), the share, and the seeds' standard errors (median and
largest); the base rate (the share within 2% over every complete call, whatever its level); and the
prescriptions, measured. Seeds beyond the registered ones are not counted. The fit must be the one the calls were
made with (its digest is in the file). And whether the levels say anything (`verdict`): low's share with its
one-sided 95% lower bound (Clopper-Pearson), against the >= 90% the rule promises, and a one-sided Fisher exact test
that low calls hold more often than medium and high ones; where it fails, the report says that these calls do not
show the levels to carry information.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import statistics

from lioncub import methods
from lioncub.apps.autotune import risk_rule
from lioncub.apps.train.configs import WARMUP, split_run
from lioncub.apps.tuned_lr import DEFAULT_LR

from .fit import parse_regime

LEVELS = ("low", "medium", "high")
WITHIN = 1.02  # a call holds if the mean ratio to the baseline is at most this
PROMISE = 0.90  # the share of low calls within 2% the rule is to reach
ALPHA = 0.05  # one-sided level of the verdict's bound and test
SET_KEYS = ("name", "model", "steps", "regimes", "configs", "seeds", "min_seeds", "setup", "where")


def fit_digest(fit: dict | None = None) -> str:
    """sha256 of the fit (its coefficients, construction and check), as canonical JSON."""
    return hashlib.sha256(json.dumps(fit or risk_rule.FIT, sort_keys=True).encode()).hexdigest()


def _tuned(model: str, tuned: dict | None) -> float:
    return (tuned or {}).get(model) or DEFAULT_LR[model]


def _regime_lr(x: float, tuned_lr: float) -> float:
    return round(tuned_lr * x, 10)  # as convergence_map.regimes writes it


def seen_regimes(maps: list[dict]) -> set[tuple[str, str]]:
    """(model, regime id) of every cell of the given merged maps, at each model's default lr."""
    out = set()
    for m in maps:
        for c in m["cells"]:
            out.add((m["model"], f"N{c['ranks']}-b{c['batch_size']}-x{round(c['lr'] / DEFAULT_LR[m['model']], 3):g}"))
    return out


def _check_set(s: dict) -> None:
    missing = [k for k in SET_KEYS if k not in s]
    if missing:
        raise ValueError(f"plan set {s.get('name', '?')!r} lacks {', '.join(missing)}")
    if s["model"] not in DEFAULT_LR:
        raise ValueError(f"plan set {s['name']!r}: unknown model {s['model']!r}")
    if not (isinstance(s["steps"], int) and s["steps"] >= 1 and 1 <= s["min_seeds"] <= len(s["seeds"])):
        raise ValueError(f"plan set {s['name']!r}: steps >= 1 and 1 <= min_seeds <= len(seeds)")
    for config in s["configs"]:
        method, _, warmup = split_run(config)
        if warmup or methods.get(method).dense:
            raise ValueError(f"plan set {s['name']!r}: {config!r} is not a call (the baseline and the dense "
                             "warm-up run anyway)")


def register(plan: dict, seen: set[tuple[str, str]] = frozenset(), today: str | None = None) -> dict:
    """The pre-registration of `plan`: its sets with the rule's calls and prescriptions (see the module)."""
    sets = plan.get("sets") or []
    if not sets or not plan.get("protocol"):
        raise ValueError("a plan has a protocol (text) and sets of regimes")
    calls, prescriptions = [], []
    for s in sets:
        _check_set(s)
        tuned = DEFAULT_LR[s["model"]]
        for reg in s["regimes"]:
            model, n, b, x = parse_regime(reg)
            if model:
                raise ValueError(f"plan set {s['name']!r}: give regimes without a model ({reg!r}); the set's model "
                                 "is its own")
            fitted = s["model"] == risk_rule.FIT["model"] and reg in (risk_rule.FIT["construction"]
                                                                       + risk_rule.FIT["held_out"])
            if fitted or (s["model"], reg) in seen:
                raise ValueError(f"{s['model']}:{reg} has been run already (on a committed map or in the fit): "
                                 "not fresh")
            for config in s["configs"]:
                method, sync, _ = split_run(config)
                r = risk_rule.risk(method, n, None, sync, s["steps"], batch_size=b, lr=x * tuned, tuned_lr=tuned)
                calls.append(dict(set=s["name"], model=s["model"], regime=reg, config=config, level=r["level"],
                                  score=r["score"]))
            r = risk_rule.risk("vote-1bit", n, None, "none", s["steps"], batch_size=b, lr=x * tuned, tuned_lr=tuned)
            k = risk_rule.dense_warmup_for(r["level"], s["steps"])
            if k:
                prescriptions.append(dict(set=s["name"], model=s["model"], regime=reg, level=r["level"],
                                          config=f"vote-1bit{WARMUP}{k}"))
    missing = [lv for lv in LEVELS if not any(c["level"] == lv for c in calls)]
    if missing and not plan.get("allow_missing_levels"):
        raise ValueError(f"no {' or '.join(missing)} call in the plan: add a regime where the rule says so, so that "
                         "every level is put to the test")
    return dict(plan, written=today or datetime.date.today().isoformat(), fit_digest=fit_digest(),
                fit_procedure=risk_rule.FIT.get("procedure"), calls=calls, prescriptions=prescriptions,
                counts={lv: sum(c["level"] == lv for c in calls) for lv in LEVELS})


def write(prereg: dict, path: str) -> None:
    """Write a pre-registration once: an existing file is never replaced."""
    if os.path.exists(path):
        raise ValueError(f"{path} exists: a pre-registration is written once (give another file)")
    with open(path, "x") as f:
        json.dump(prereg, f, indent=1)
        f.write("\n")


def run_configs(prereg: dict, set_name: str) -> list[str]:
    """Every configuration the set runs, in order: the baseline, the calls', the prescriptions'."""
    s = next((s for s in prereg["sets"] if s["name"] == set_name), None)
    if s is None:
        raise ValueError(f"no set {set_name!r} (sets: {', '.join(x['name'] for x in prereg['sets'])})")
    extra = sorted({p["config"] for p in prereg["prescriptions"] if p["set"] == set_name})
    return ["allreduce", *s["configs"], *extra]


# --- the report --------------------------------------------------------------------------------------------------


def _measured(m: dict, config: str, ranks: int, batch: int, lr: float, seeds: list[int]) -> dict:
    """The cell's per-seed ratios to the baseline over the registered seeds that finished."""
    ratios = {r["seed"]: r["ratio"] for r in m["runs"]
              if r["config"] == config and r["ranks"] == ranks and r["batch_size"] == batch
              and math.isclose(r["lr"], lr, rel_tol=1e-9) and "ratio" in r and r["seed"] in seeds}
    vals = [ratios[s] for s in sorted(ratios)]
    return dict(seeds=sorted(ratios), mean=statistics.fmean(vals) if vals else None,
                se=statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else None)


def _set_map(s: dict, maps: dict) -> dict | None:
    m = maps.get(s["model"])
    if m is None:
        return None
    want = dict(steps=s["steps"], **{k: v for k, v in s["setup"].items() if k in ("data", "block_size", "amp",
                                                                                  "eval_batches")})
    got = {k: m.get(k) for k in want}
    if got != want:
        raise ValueError(f"the {s['model']} map ran {got}, set {s['name']!r} registered {want}")
    return m


def _summary(rows: list[dict]) -> dict:
    done = [r for r in rows if r["complete"]]
    ses = [r["se"] for r in done if r["se"] is not None]
    hits = sum(r["within_2pct"] for r in done)
    return dict(calls=len(rows), complete=len(done), within_2pct=hits, share=hits / len(done) if done else None,
                se_median=statistics.median(ses) if ses else None, se_max=max(ses) if ses else None)


def lower_bound(hits: int, n: int, alpha: float = ALPHA) -> float | None:
    """One-sided (1 - alpha) Clopper-Pearson lower bound of a share seen as `hits` of `n` (None for n = 0): the p at
    which at least `hits` successes have probability alpha."""
    if n <= 0:
        return None
    if hits <= 0:
        return 0.0
    lo, hi = 0.0, hits / n
    for _ in range(60):
        p = (lo + hi) / 2
        tail = sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(hits, n + 1))
        lo, hi = (p, hi) if tail < alpha else (lo, p)
    return (lo + hi) / 2


def fisher_greater(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float | None:
    """One-sided p of Fisher's exact test that group a holds more often than group b: the chance, given the
    margins, that a gets at least `a_hits` of all the hits (None when a group is empty)."""
    if a_n <= 0 or b_n <= 0:
        return None
    hits, total = a_hits + b_hits, a_n + b_n
    return sum(math.comb(a_n, k) * math.comb(b_n, hits - k)
               for k in range(a_hits, min(a_n, hits) + 1)) / math.comb(total, hits)


def verdict(entry: dict) -> dict:
    """What a set's (or all sets') complete calls show: low's share and its lower bound against PROMISE, medium
    and high together, and Fisher's p that low holds more often than they do."""
    low, levels = entry["levels"]["low"], entry["levels"]
    n_other = levels["medium"]["complete"] + levels["high"]["complete"]
    h_other = levels["medium"]["within_2pct"] + levels["high"]["within_2pct"]
    bound = lower_bound(low["within_2pct"], low["complete"])
    p = fisher_greater(low["within_2pct"], low["complete"], h_other, n_other)
    return dict(low_share=low["share"], low_lower_bound=bound, low_shown=bound is not None and bound >= PROMISE,
                other_calls=n_other, other_within_2pct=h_other, levels_p=p, levels_shown=p is not None and p <= ALPHA)


def report(prereg: dict, maps: dict[str, dict], tuned: dict | None = None) -> dict:
    """Per set and in all, per level: calls, complete, within 2%, share, seeds' standard errors; the base rate;
    the prescriptions. maps: model -> merged map; tuned: model -> the lr its regimes' x multiplies (default its
    default lr)."""
    if prereg["fit_digest"] != fit_digest():
        raise ValueError("the committed fit is not the one these calls were made with (fit digest differs): the "
                         "check must use the registered fit")
    sets = {s["name"]: s for s in prereg["sets"]}
    rows = []
    for kind, items in (("call", prereg["calls"]), ("prescription", prereg["prescriptions"])):
        for c in items:
            s = sets[c["set"]]
            m = _set_map(s, maps)
            _, n, b, x = parse_regime(c["regime"])
            got = _measured(m, c["config"], n, b, _regime_lr(x, _tuned(s["model"], tuned)), s["seeds"]) if m else \
                dict(seeds=[], mean=None, se=None)
            complete = len(got["seeds"]) >= s["min_seeds"]
            rows.append(dict(c, kind=kind, seeds=got["seeds"], measured=None if got["mean"] is None else
                             round(got["mean"] - 1, 5), se=None if got["se"] is None else round(got["se"], 5),
                             complete=complete, within_2pct=complete and got["mean"] <= WITHIN))
    calls = [r for r in rows if r["kind"] == "call"]
    out = dict(fit_digest=prereg["fit_digest"], within=WITHIN, cells=rows, sets={}, prescriptions=[
        r for r in rows if r["kind"] == "prescription"])
    for name in [*sets, None]:
        mine = [r for r in calls if name is None or r["set"] == name]
        entry = dict(levels={lv: _summary([r for r in mine if r["level"] == lv]) for lv in LEVELS},
                     base_rate=_summary(mine))
        entry["verdict"] = verdict(entry)
        if name is None:
            out["all"] = entry
        else:
            out["sets"][name] = entry
    return out


def verdict_line(name: str, entry: dict) -> str:
    v, low = entry["verdict"], entry["levels"]["low"]

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    said = (f"{name}: low {low['within_2pct']} of {low['complete']} within 2% ({pct(v['low_share'])}; one-sided "
            f"{100 * (1 - ALPHA):.0f}% lower bound {pct(v['low_lower_bound'])}: "
            + ("shows" if v["low_shown"] else "does not show") + f" >= {pct(PROMISE)}); medium and high "
            f"{v['other_within_2pct']} of {v['other_calls']}")
    if v["levels_p"] is None:
        return said + ": no complete medium or high call, so nothing compares the levels."
    return said + (f"; low holds more often than medium and high: one-sided Fisher exact p = {v['levels_p']:.2f}, "
                   + ("shown." if v["levels_shown"] else "not shown by these calls: so far the levels carry no "
                                                          "information."))


def format_report(rep: dict) -> str:
    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}%"

    def se(v):
        return "-" if v is None else f"{100 * v:.1f}"

    lines = ["| set | level | calls | complete | within 2% | share | seeds' SE, median / max (points) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, entry in [*rep["sets"].items(), ("all", rep["all"])]:
        for lv, x in [*entry["levels"].items(), ("base rate (every level)", entry["base_rate"])]:
            lines.append(f"| {name} | {lv} | {x['calls']} | {x['complete']} | {x['within_2pct']} | {pct(x['share'])} "
                         f"| {se(x['se_median'])} / {se(x['se_max'])} |")
    lines += ["", *(verdict_line(name, entry) for name, entry in [*rep["sets"].items(), ("all", rep["all"])]
                    if entry["base_rate"]["complete"])]
    lines += ["", "| set | regime | configuration | kind | level | seeds | measured vs allreduce | SE | within 2% |",
              "|---|---|---|---|---|---:|---:|---:|---|"]
    for r in rep["cells"]:
        meas = "-" if r["measured"] is None else f"{100 * r['measured']:+.1f}%"
        ok = ("yes" if r["within_2pct"] else "**no**") if r["complete"] else "incomplete"
        lines.append(f"| {r['set']} | {r['regime']} | {r['config']} | {r['kind']} | {r['level']} | {len(r['seeds'])} "
                     f"| {meas} | {se(r['se'])} | {ok} |")
    return "\n".join(lines)
