"""Fitting autotune's convergence-risk rule to a merged convergence map, and checking it on held-out regimes.

The rule itself, what autotune scores a configuration with at run time, is lioncub.apps.autotune.risk_rule: plain
data (its FIT, lioncub/apps/autotune/risk_fit.py, which `python -m research risk fit MAP` rewrites) and the function
reading it. What makes that data and what checks it is here.
"""

from __future__ import annotations

import math

from lioncub.apps.autotune import risk_rule
from lioncub.apps.train.configs import WARMUP
from lioncub.apps.train.configs import parse as configuration
from lioncub.apps.tuned_lr import DEFAULT_LR

# regimes (world, batch per rank, lr / tuned lr) kept out of the fit. Procedure 4 (2026-11-26, fixed before any
# of its regimes ran): the fit sees every regime on the char-tiny map (procedure 3's held-out ones included, as all
# have been seen); held out are eight regimes not yet run (FRESH) and the larger models' regimes named in
# research/notebook/results/risk-rule-preregistered.json, whose calls were recorded there before they ran. Procedure 3's
# calls and check: research/notebook/results/risk-rule-preregistered-procedure3.json, risk-rule-check-procedure3.json.
FRESH = ("N2-b12-x1", "N2-b24-x0.75", "N3-b16-x1", "N3-b32-x1.5", "N4-b24-x1", "N4-b16-x0.75", "N5-b16-x0.5",
         "N6-b32-x0.5")
HELD_OUT = FRESH


def parse_regime(text: str) -> tuple[str | None, int, int, float]:
    """'N6-b16-x0.5' -> (None, ranks 6, batch per rank 16, lr factor 0.5 over the tuned lr); a model may lead
    ('char-small:N4-b8-x1'); the tuned lr is then that model's default."""
    import re

    m = re.fullmatch(r"(?:([\w-]+):)?N(\d+)-b(\d+)-x([0-9.]+)", text.strip())
    if not m or (m[1] and m[1] not in DEFAULT_LR):
        raise ValueError(f"a regime is [model:]N<ranks>-b<batch per rank>-x<lr / tuned lr>, e.g. N4-b16-x1 or "
                         f"char-small:N4-b8-x1 (models: {', '.join(DEFAULT_LR)}); got {text!r}")
    ranks, batch, factor = int(m[2]), int(m[3]), float(m[4])
    if ranks < 2 or batch < 1 or not factor > 0:
        raise ValueError(f"a regime has at least 2 ranks (a vote), a batch of at least 1 and an lr factor above 0; "
                         f"got {text!r}")
    return m[1], ranks, batch, factor


def _regime_id(cell: dict, lr0: float) -> str:
    return f"N{cell['ranks']}-b{cell['batch_size']}-x{round(cell['lr'] / lr0, 3):g}"


def _standard_error(cell: dict) -> float:
    """The standard error of a map cell's mean ratio (maps merged before it was recorded: two seeds, whose
    half-range it equals)."""
    return cell["se"] if "se" in cell else cell["spread"]


def _nnls_slopes(X: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with a free intercept and slopes >= 0: the best over the slopes' active sets."""
    import itertools

    import numpy as np

    X, y = np.asarray(X), np.asarray(y)
    k = X.shape[1] - 1
    best, best_err = [float(np.mean(y))] + [0.0] * k, math.inf
    for mask in itertools.product((0, 1), repeat=k):
        cols = [0] + [i + 1 for i, m in enumerate(mask) if m]
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if any(c < 0 for c in coef[1:]):
            continue
        full = [0.0] * (k + 1)
        for c, v in zip(cols, coef):
            full[c] = float(v)
        err = float(np.sum((X @ np.asarray(full) - y) ** 2))
        if err < best_err - 1e-15:
            best, best_err = full, err
    return best


def _never_synced(cells: list[dict]) -> bool:
    return all(not c.get("momentum_syncs") for c in cells)


QUANTILE = 0.9  # "low" promises a measured mean within 2% in at least 90% of new regimes (the bar)


def fit(map_res: dict, held_out=HELD_OUT, batch0: int = 16, lr0: float | None = None) -> dict:
    """The rule's entries from a merged convergence map (lr0: the model's tuned lr, DEFAULT_LR by default)."""
    cells = map_res["cells"]
    lr0 = lr0 or DEFAULT_LR[map_res["model"]]
    world0 = min(c["ranks"] for c in cells)
    train_cells = [c for c in cells if _regime_id(c, lr0) not in held_out]
    raw = [risk_rule.features(c["ranks"], c["batch_size"], c["lr"], lr0, batch0, world0) for c in train_cells]
    gentlest = [round(min(x[4] for x in raw), 6), round(min(x[5] for x in raw), 6)]
    by_config: dict = {}
    for c in train_cells:  # the configurations the rule reads (variants such as adaptive:T are left out)
        method, _, sync = c["config"].partition("@")
        if not configuration(method).dense and (not sync or sync == "adaptive" or sync.startswith("every:")):
            by_config.setdefault(c["config"], []).append(c)
    pooled = {}
    for config, cs in list(by_config.items()):
        method, _, sync = config.partition("@")
        if sync == "adaptive" and method in by_config and _never_synced(cs):
            pooled[config] = method  # the guard never acted: its cells are the method's, with a dense start
    for config, method in pooled.items():
        by_config[method] = by_config[method] + by_config[config]

    def feature_rows(cs):
        X = [risk_rule.features(c["ranks"], c["batch_size"], c["lr"], lr0, batch0, world0) for c in cs]
        # an N slope only from at least three world sizes: from two, it is the noise of two cells' means, and
        # the rule multiplies it by log2 N / 2 far beyond the map (off the map, the floor applies instead)
        return X if len({c["ranks"] for c in cs}) >= 3 else [x[:3] + [0.0] + x[4:] for x in X]

    entries, fitted_cells = {}, []
    for config, train in sorted(by_config.items()):
        X = feature_rows(train)
        if config in pooled or len(train) < 4 or len({x[1] + x[4] for x in X}) < 2:
            continue  # too little of the map (e.g. measured at one lr only) to fit the slopes
        coef = _nnls_slopes(X, [c["ratio"] - 1 for c in train])
        method, _, sync = config.partition("@")
        entries[f"{method}|{sync or 'none'}"] = dict(coef=[round(v, 5) for v in coef], cells=len(train))
        fitted_cells += [(c, entries[f"{method}|{sync or 'none'}"]) for c in train]
    for method in pooled.values():
        if f"{method}|none" in entries:
            entries[f"{method}|adaptive"] = dict(entries[f"{method}|none"], pooled_with=f"{method}|none")
    # the spread of a cell's mean over seeds is mostly the baseline's own instability (growing with lr and small
    # batches), which every method's cell in a regime shares: one fit over all of them, not one per method
    cs = [c for c, _ in fitted_cells]
    Xn = feature_rows(cs)
    noise = [round(v, 5) for v in _nnls_slopes(Xn, [_standard_error(c) for c in cs])]
    # z: the QUANTILE of the residuals in units of the spread, so that mean + z x spread bounds a new regime's
    # measured mean that often (the residuals hold both the seeds' noise and the lines' misfit)
    z_all = sorted((c["ratio"] - 1 - risk_rule.dot(e["coef"], x)) / max(1e-4, risk_rule.dot(noise, x))
                   for (c, e), x in zip(fitted_cells, Xn))
    z = round(max(1.0, z_all[min(len(z_all) - 1, math.ceil(QUANTILE * len(z_all)) - 1)]), 3) if z_all else 1.0
    return dict(source="research/notebook/results/convergence-map.json", model=map_res["model"], steps=map_res["steps"],
                seeds=sorted({s for c in cells for s in c["seeds"]}), lr0=lr0, batch0=batch0, world0=world0,
                worlds=sorted({c["ranks"] for c in train_cells}), sync_k=10,
                map_worlds=sorted({c["ranks"] for c in cells}), gentlest=gentlest, quantile=QUANTILE, z=z,
                held_out=sorted({_regime_id(c, lr0) for c in cells} & set(held_out)),
                construction=sorted({_regime_id(c, lr0) for c in train_cells}),
                entries=entries, noise=noise, check="")


def check(map_res: dict, fitted: dict, tuned_lr: float | None = None) -> dict:
    """On the held-out regimes: of the (regime, configuration) cells the rule calls low risk, the share
    whose measured mean loss is within 2% of the baseline. Held out: every regime the fit did not see (a map
    of another model than the fit's, whole, its lr read against that model's tuned lr: `tuned_lr`, else its
    default). Cells with a dense warm-up ("+warmup:K") are not the rule's to score: left out."""
    saved, risk_rule.FIT = risk_rule.FIT, fitted  # risk() scores with the module's FIT
    other_model = map_res["model"] != fitted["model"]
    tuned = tuned_lr or DEFAULT_LR.get(map_res["model"], fitted["lr0"])
    try:
        rows = []
        for c in map_res["cells"]:
            if WARMUP in c["config"]:
                continue
            held = other_model or _regime_id(c, tuned) not in fitted["construction"]
            method, _, sync = c["config"].partition("@")
            if not held or configuration(method).dense:
                continue
            if f"{method}|{sync or 'none'}" not in fitted["entries"]:
                continue
            r = risk_rule.risk(method, c["ranks"], None, sync or "none", map_res["steps"], batch_size=c["batch_size"],
                     lr=c["lr"], tuned_lr=tuned)
            regime = (f"{map_res['model']}:" if other_model else "") + _regime_id(c, tuned)
            rows.append(dict(config=c["config"], regime=regime, level=r["level"], seeds=len(c["seeds"]),
                             score=r["score"], measured=round(c["ratio"] - 1, 5), se=round(_standard_error(c), 5),
                             within_2pct=c["ratio"] <= 1.02))
        low = [r for r in rows if r["level"] == "low"]
        hits = sum(r["within_2pct"] for r in low)
        good = sum(r["within_2pct"] for r in rows)
        return dict(cells=rows, low=len(low), low_within_2pct=hits, hit_rate=hits / len(low) if low else None,
                    held_out_cells=len(rows), within_2pct=good, recall=hits / good if good else None)
    finally:
        risk_rule.FIT = saved
