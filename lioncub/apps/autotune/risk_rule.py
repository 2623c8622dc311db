"""Convergence risk: the heuristic rule (RISK_RULE) that scores a configuration low, medium or high."""

from __future__ import annotations

import math

from lioncub import methods
from lioncub.optim import schedules

RISK_LEVELS = (("low", 0.20), ("medium", 0.45), ("high", math.inf))  # score < bound
SCORE_PER_EXCESS = 10.0  # score = 10 x the predicted loss excess over the baseline (0.2 = 2%, 0.45 = 4.5%)
DENSE_WARMUP = {"low": 0, "medium": 200, "high": 500}  # steps of allreduce first, by risk level
ALIASES = {"vote-allgather": "vote-1bit"}  # the same update as vote-1bit (an all-gather of the same votes)
UNMEASURED_FLOOR = 0.20  # a method the map does not hold (avg-pbit) scores at least medium

# The fitted map (lioncub/apps/autotune/risk_fit.py, plain data written by the research tools' `risk fit MAP`,
# research/risk/fit.py: autotune reads the rule, the fitting and checking are research's)
from .risk_fit import FIT  # noqa: E402

MEASURED_AT = max(FIT["worlds"])  # the largest world size the rule was fitted on; beyond it the N slope is extrapolated
CHECKED_UP_TO = max(FIT.get("map_worlds", FIT["worlds"]))  # the largest world size on the map (held-out check)


def _coef_text(c: list[float]) -> str:
    return (f"{100 * c[0]:+5.1f}% | lr {100 * c[1]:+4.1f}% batch {100 * c[2]:+4.1f}% N {100 * c[3]:+4.1f}% | "
            f"lr {100 * c[4]:+4.1f}% batch {100 * c[5]:+4.1f}%")


def _entries_text() -> str:
    rows = [f"  {key:<22} {_coef_text(e['coef'])}" + (f" (pooled with {e['pooled_with']})" if "pooled_with" in e
                                                       else "") for key, e in sorted(FIT["entries"].items())]
    rows.append(f"  {'spread (every method)':<22} {_coef_text(FIT['noise'])}")
    return "\n".join(rows)


def _n_slope_text() -> str:
    fitted = any(e["coef"][3] for e in FIT["entries"].values())
    return "fitted" if fitted else "none fitted, the mean is taken as flat in N"


RISK_RULE = f"""\
Convergence risk, from the measured convergence map ({FIT['source']}: {FIT['model']}, {FIT['steps']} steps,
final eval loss over allreduce's in the same regime and seed, {len(FIT['seeds'])} seeds). Score = 0 for
allreduce; for a compressed method, score = {SCORE_PER_EXCESS:g} x the predicted excess loss (upper bound):
  excess = mean + {FIT['z']:g} x spread, each  c0 + (c_lr x_lr+ + c_batch x_b+ + c_N x_N)
                                                 + (c'_lr x_lr- + c'_batch x_b-)
  with x_lr = log2(lr / tuned lr), x_b = log2({FIT['batch0']} / batch per rank), x_N = log2(N / {FIT['world0']}),
  x+ = max(0, x) (harsher than the base regime) and x- = min(0, x) (gentler), no gentler than the map's gentlest
  (x_lr >= {FIT['gentlest'][0]:g}, x_b >= {FIT['gentlest'][1]:g}): the two sides have their own slopes, as a harsher
  regime also destabilizes the baseline while a gentler one only narrows every method's gap;
where the tuned lr is the one the allreduce baseline trains best at (a built-in model's default, e.g.
{FIT['lr0']:g} for {FIT['model']}; for another model autotune's --tuned-lr, else its --lr taken as tuned): a sign
update moves every weight by lr, so what matters is lr against the model's own stable lr, not its value.
The mean is fitted per (method, sync) by least squares on the map's construction regimes, slopes >= 0 (a harsher
regime is never predicted better); the spread, the standard error of a cell's mean over the seeds (mostly the
baseline's own instability, shared by the methods), once over every method's cells; {FIT['z']:g} is the
{FIT['quantile']:g} quantile of the construction cells' residuals over their spread (a one-sided prediction bound
for a new regime's measured mean, "low" being a {FIT['quantile']:g} promise). A guard whose cells never synced
on the map (adaptive, in 200-step runs) is its method with a dense start there, so it is pooled with its method's
none entry: the rule credits no guard the map has not seen act. Entries (c0 | slopes harsher | slopes gentler):
{_entries_text()}
Sync schedules: none, adaptive and every:10 are on the map; another periodic schedule interpolates between
the method's none and every:10 entries by the share u of each rank's momentum not yet averaged (u <= u(every:10):
the every:10 entry); a method without a sync entry uses its none entry. vote-allgather is vote-1bit's update;
a method not on the map (avg-pbit) scores at least {UNMEASURED_FLOOR} (medium). L1 levels other than 127 // N
are not on the map. Without --lr / --batch the tuned lr and the map's base batch ({FIT['batch0']}) are assumed.
The fit sees N <= {MEASURED_AT} (an N slope needs three world sizes: {_n_slope_text()}); beyond N = {CHECKED_UP_TO}
(off the map) a compressed method scores at least {UNMEASURED_FLOOR} (medium): an extrapolation is not "low".
Levels: low < {RISK_LEVELS[0][1]} (predicted within 2%), medium < {RISK_LEVELS[1][1]}, high otherwise.
Held out of the fit: {', '.join(FIT['held_out']) or 'none on the map yet'}{'; ' + FIT['check'] if FIT['check'] else ''}
(the pre-registered checks, larger models included, are in research/notebook/BENCHMARKS.md).
Dense warm-up (LionCub(dense_warmup=K), `lioncub train --dense-warmup K`): the config recommends
K = {DENSE_WARMUP['medium']} steps at medium risk and {DENSE_WARMUP['high']} at high (none at low), at most a
tenth of the planned run (as PowerSGD's start_powerSGD_iter, 1-bit Adam's freeze_step); not on the map.
The adaptive guard starts dense itself (12 steps for betas 0.9, 0.99), so at low risk it needs none; a
longer warm-up covers its start. Autotune ranks by the mean step over the planned run, each dense step priced
as an allreduce step, and the guard's syncs at worst (its whole byte credit spent)."""


def dense_warmup_for(level: str, steps: int) -> int:
    """The dense warm-up (steps) the config recommends at risk `level` for a run of `steps` steps."""
    return min(DENSE_WARMUP[level], steps // 10)


def level_of(score: float) -> str:
    for name, bound in RISK_LEVELS:
        if score < bound:
            return name
    return RISK_LEVELS[-1][0]  # pragma: no cover


def parse_max_risk(text) -> float:
    """--max-risk as a score bound: low, medium, high (everything) or a number."""
    if text is None:
        return math.inf
    s = str(text).strip().lower()
    names = [n for n, _ in RISK_LEVELS]
    if s in names:  # a level's scores are those below its bound
        i = names.index(s)
        return math.inf if s == "high" else RISK_LEVELS[i][1] - 1e-9
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"--max-risk must be low, medium, high or a score (e.g. 0.3), got {text!r}") from None
    if not v >= 0:
        raise ValueError(f"--max-risk must be >= 0, got {text!r}")
    return v + 1e-12  # a score equal to the bound passes


_SYNC_STEPS: dict = {}


def _sync_steps(spec: str, steps: int) -> list[int]:
    """The steps in 1..steps after which `spec` averages the momenta (as LionCub's schedule decides)."""
    key = (spec, steps)
    if key not in _SYNC_STEPS:  # (the adaptive guard: none; its syncs are decided in the run)
        _SYNC_STEPS[key] = schedules.resolve(schedules.parse(spec)).sync_steps(steps)
    return _SYNC_STEPS[key]


def unsynced_share(spec: str, steps: int, beta2: float = 0.99) -> float:
    """Mean over steps 2..steps of the share of a rank's momentum that is its own (not averaged): the
    weight of the gradients since the last sync in m, (1 - b2^(t-1-s)) / (1 - b2^(t-1))."""
    if steps < 2:
        return 0.0
    syncs = set(_sync_steps(spec, steps))
    last, total = 0, 0.0
    for t in range(2, steps + 1):
        if (t - 1) in syncs:
            last = t - 1
        total += (1 - beta2 ** (t - 1 - last)) / (1 - beta2 ** (t - 1))
    return total / (steps - 1)


def _entry(method: str, sync: str) -> dict | None:
    return FIT["entries"].get(f"{ALIASES.get(method, method)}|{sync}")


def features(ranks: int, batch_size: float, lr: float, lr0: float, batch0: float, world0: int,
             gentlest=(-math.inf, -math.inf)) -> list[float]:
    """The rule's features: [1, x_lr+, x_b+, x_N+, x_lr-, x_b-] (the gentle side floored at the map's gentlest)."""
    x_lr, x_b, x_n = math.log2(lr / lr0), math.log2(batch0 / batch_size), math.log2(ranks / world0)
    return [1.0, max(0.0, x_lr), max(0.0, x_b), max(0.0, x_n),
            max(gentlest[0], min(0.0, x_lr)), max(gentlest[1], min(0.0, x_b))]


def dot(c: list[float], x: list[float]) -> float:
    """The coefficients `c` applied to the features `x`."""
    return sum(a * b for a, b in zip(c, x))


def _excess(e: dict, ranks: int, batch_size: int | None, lr: float | None, tuned_lr: float | None) -> float:
    tuned = tuned_lr or FIT["lr0"]
    x = features(ranks, batch_size or FIT["batch0"], lr or tuned, tuned, FIT["batch0"], FIT["world0"],
                 FIT["gentlest"])
    return dot(e["coef"], x) + FIT["z"] * max(0.0, dot(FIT["noise"], x))


def predicted_excess(method: str, ranks: int, momentum_sync: str, steps: int, batch_size: int | None = None,
                     lr: float | None = None, beta2: float = 0.99, _share: dict | None = None,
                     tuned_lr: float | None = None) -> tuple[float, float, bool]:
    """(predicted loss excess over the baseline as a fraction, unsynced share u, whether the map holds it)."""
    sync = _sync_class(momentum_sync)
    none = _entry(method, "none")
    if none is None:
        return 0.0, 1.0, False
    regime = (ranks, batch_size, lr, tuned_lr)
    if sync == "adaptive":
        e = _entry(method, "adaptive") or none
        return _excess(e, *regime), float("nan"), True
    key = (momentum_sync, steps, beta2)
    if _share is not None and key in _share:
        u = _share[key]
    else:
        u = unsynced_share(momentum_sync, steps, beta2)
        if _share is not None:
            _share[key] = u
    plain = _excess(none, *regime)
    every = _entry(method, f"every:{FIT['sync_k']}")
    if every is None or sync == "none":
        return plain, u, True
    u_k = unsynced_share(f"every:{FIT['sync_k']}", steps, beta2)
    synced = _excess(every, *regime)
    if u <= u_k:
        return synced, u, True
    w = (u - u_k) / max(1e-12, 1 - u_k)
    return w * plain + (1 - w) * synced, u, True


def _sync_class(spec: str) -> str:
    text = str(spec).strip().lower()
    if text.startswith("adaptive"):
        return "adaptive"
    return "none" if schedules.parse(text) is None else "periodic"


def risk(method: str, ranks: int, levels: int | None, momentum_sync: str, steps: int,
         beta2: float = 0.99, _share: dict | None = None, batch_size: int | None = None,
         lr: float | None = None, tuned_lr: float | None = None) -> dict:
    """{score, level, excess, unsynced_share, measured} of a configuration under RISK_RULE. lr is read against
    tuned_lr, the lr the model's allreduce baseline trains best at (None: the fitted model's default)."""
    meth = methods.get(method)
    if meth.dense or ranks == 1:
        return {"score": 0.0, "level": "low", "excess": 0.0, "unsynced_share": 0.0, "measured": True}
    for name, v in (("lr", lr), ("the tuned lr", tuned_lr)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    excess, u, measured = predicted_excess(meth.name, ranks, momentum_sync, steps, batch_size, lr, beta2, _share,
                                           tuned_lr)
    score = max(0.0, SCORE_PER_EXCESS * excess)
    if measured and ranks > max(FIT.get("map_worlds", FIT["worlds"])):  # off the map: an extrapolation is not low
        score, measured = max(score, UNMEASURED_FLOOR), False
        excess = max(excess, score / SCORE_PER_EXCESS)
    elif not measured:
        proxy, u, _ = predicted_excess("vote-pbit", ranks, momentum_sync, steps, batch_size, lr, beta2, _share,
                                       tuned_lr)
        score = max(UNMEASURED_FLOOR, SCORE_PER_EXCESS * proxy)
        excess = score / SCORE_PER_EXCESS
    return {"score": round(score, 4), "level": level_of(score), "excess": round(excess, 4),
            "unsynced_share": None if u != u else round(u, 4), "measured": measured}
