"""Convergence risk: the heuristic rule (RISK_RULE) that scores a configuration low, medium or high."""

from __future__ import annotations

import math

from lioncub import methods, schedules

RISK_LEVELS = (("low", 0.20), ("medium", 0.45), ("high", math.inf))  # score < bound
MEASURED_AT = 4  # ranks of the local measurements the rule is anchored to

# Per-method weights of the rule below (see `risk`).
_RANK_SLOPE = 0.08  # per doubling of N beyond MEASURED_AT, for majority-vote / sign-averaging aggregation
_SYNC_WEIGHT = {"l1-pbit": 0.50}  # measured for l1-pbit; the vote methods (and any other) weigh _SYNC_DEFAULT
_SYNC_DEFAULT = 0.10
_FLOOR = 0.05  # any compressed method: its update is not the baseline's
DENSE_WARMUP = {"low": 0, "medium": 200, "high": 500}  # steps of allreduce first, by risk level

RISK_RULE = f"""\
Convergence risk (a heuristic: the network model cannot predict accuracy). Score = 0 for allreduce
(plain Lion); for the compressed methods:
  score = {_FLOOR} + aggregation(method, N) + sync_weight(method) x u(schedule)
  aggregation = {_RANK_SLOPE} x log2(N / {MEASURED_AT}) (0 for N <= {MEASURED_AT}) for the majority-vote methods
      (vote-allgather, vote-1bit, vote-pbit) and avg-pbit; the same divided by the levels s for l1-pbit
      (s levels carry each rank's magnitude, so sign(sum q) approaches sign(sum c); s = 1 is a vote).
  u = mean over the planned run of the share of each rank's momentum not yet averaged with the others,
      (1 - b2^(t-1-s)) / (1 - b2^(t-1)) at step t with the last sync at s (b2 = 0.99): 1 without sync,
      about 0.04 for every:8 and 0.37 for every:100 over a 10000-step run (more in short runs, where the
      momenta are young).
  sync_weight = {_SYNC_WEIGHT['l1-pbit']} for l1-pbit, {_SYNC_DEFAULT} for the others.
Levels: low < {RISK_LEVELS[0][1]}, medium < {RISK_LEVELS[1][1]}, high otherwise.
Basis, measured: local runs (4 ranks, char-tiny, lr 2e-3, 200 steps, eval loss; allreduce 2.444):
l1-pbit without sync 2.761 (+13%), l1-pbit every:1 2.374, vote-pbit without sync 2.281, avg-pbit
without sync 2.386; so at N = 4 only l1-pbit without sync is high. Assumed, not measured: the growth
with N (majority votes lose accuracy as N grows, L1 levels recover it; the qualitative finding of the
Lion Cub paper, arXiv:2411.16462, whose slope here is a guess) and the shape between every:1 and no
sync (the momentum-memory model u). Check them for your model with --pilot.
Dense warm-up (LionCub(dense_warmup=K), `lioncub train --dense-warmup K`): the config recommends
K = {DENSE_WARMUP['medium']} steps at medium risk and {DENSE_WARMUP['high']} at high (none at low), at most a
tenth of the planned run, as compressed optimizers are usually started (PowerSGD's start_powerSGD_iter,
1-bit Adam's freeze_step): the first steps, when the momenta are young, run the baseline. A heuristic, not
measured here; the score does not credit it, and the predicted step time is that of the later steps."""


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
    if key not in _SYNC_STEPS:
        sched = schedules.resolve(schedules.parse(spec))
        if isinstance(sched, schedules.Never):
            out = []
        elif isinstance(sched, schedules.EveryK):
            out = list(range(sched.k, steps + 1, sched.k))
        elif isinstance(sched, schedules.FirstSteps):
            out = list(range(sched.k, min(sched.until, steps) + 1, sched.k))
        elif isinstance(sched, schedules.Geometric):  # should_sync walks the intervals from 0 on every call
            out, t, j = [], 0, 0
            while True:
                t += sched._interval(j)
                j += 1
                if t > steps:
                    break
                out.append(t)
        else:  # pragma: no cover  (a schedule object of the user's)
            out = [t for t in range(1, steps + 1) if sched.should_sync(t)]
        _SYNC_STEPS[key] = out
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


def risk(method: str, ranks: int, levels: int | None, momentum_sync: str, steps: int,
         beta2: float = 0.99, _share: dict | None = None) -> dict:
    """{score, level, parts} of a configuration under RISK_RULE."""
    meth = methods.get(method)
    if meth.dense or ranks == 1:
        return {"score": 0.0, "level": "low", "aggregation": 0.0, "sync": 0.0, "unsynced_share": 0.0}
    agg = _RANK_SLOPE * max(0.0, math.log2(ranks / MEASURED_AT))
    if meth.uses_levels:
        agg /= meth.resolve_levels(ranks, levels)
    key = (momentum_sync, steps, beta2)
    if _share is not None and key in _share:
        u = _share[key]
    else:
        u = unsynced_share(momentum_sync, steps, beta2)
        if _share is not None:
            _share[key] = u
    sync = _SYNC_WEIGHT.get(meth.name, _SYNC_DEFAULT) * u
    score = _FLOOR + agg + sync
    return {"score": round(score, 4), "level": level_of(score), "aggregation": round(agg, 4),
            "sync": round(sync, 4), "unsynced_share": round(u, 4)}
