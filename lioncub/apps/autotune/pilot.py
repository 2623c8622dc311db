"""Pilot: short real trainings of the top candidates (the only part that imports torch, lazily)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from lioncub.simulator import Cluster
from lioncub.simulator.units import format_time

from .models import BUILTIN
from .risk_rule import _sync_steps
from .space import Candidate


def _local_runner(cfg, ranks: int, cluster: Cluster | None = None) -> dict:
    from lioncub.apps.train.loop import train_local

    return train_local(cfg, ranks, progress=False)


def _lab_runner(cfg, ranks: int, cluster: Cluster | None = None) -> dict:
    """Train on the emulated Ethernet lab at the cluster's link rate (root; at most ~2.5 Gbit/s here)."""
    from lioncub.apps.lab import missing_privileges
    from lioncub.apps.train.lab import train_on_lab

    missing = missing_privileges()
    if missing:
        raise ValueError(f"--pilot-on lab needs {missing}")
    return train_on_lab(cfg, ranks, cluster.bandwidth if cluster is not None else "1Gbit", progress=False)


# name -> fn(TrainConfig, ranks, cluster) -> train summary (final_loss, records with per-step "loss").
PILOT_RUNNERS: dict[str, Callable] = {"local": _local_runner, "lab": _lab_runner}


def pilot_candidates(ranked: list[Candidate], top: int, steps: int) -> list[Candidate]:
    """The best allreduce configuration, then the `top` fastest ones that train differently within a
    `steps`-step pilot: distinct method, levels, momentum-sync steps and layout (the hierarchical layout
    votes with node means; the bucket size does not change the arithmetic; every:K with K > steps trains
    like none there)."""
    out, seen = [], set()
    ar = next((c for c in ranked if c.dense), None)
    for c in ranked:
        key = (c.method, c.levels, tuple(_sync_steps(c.momentum_sync, steps)), _arithmetic(c.layout))
        if c.dense or key in seen:
            continue
        seen.add(key)
        out.append(c)
        if len(out) == top:
            break
    return ([ar] if ar else []) + out


def _arithmetic(layout: str) -> str:
    """The layout a pilot trains a candidate in: the sharded layout's arithmetic is the hierarchical one's (bit for
    bit, research/notebook/BENCHMARKS.md), without FSDP, which a pilot does not need."""
    return "hierarchical" if layout == "sharded" else layout


def pilot_node_size(ranks: int, gpus_per_node: int) -> int:
    """Nodes for a hierarchical pilot on `ranks` ranks: the cluster's node size where the pilot holds at
    least two such nodes, else the largest divisor of `ranks` below it that gives two (1: the pilot cannot
    form nodes, and trains flat)."""
    for g in range(min(gpus_per_node, ranks // 2), 0, -1):
        if ranks % g == 0:
            return g
    return 1


TARGET_AT = 2 / 3


def smoothed(losses: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def run_pilots(cands: list[Candidate], *, steps: int, ranks: int, model: str, batch_size: int | None = None,
               block_size: int | None = None, lr: float | None = None, seed: int = 0,
               target_loss: float | None = None, runner: str = "local", cluster: Cluster | None = None,
               log: Callable[[str], None] | None = None) -> dict:
    """Train each candidate for `steps` steps on `ranks` ranks (same data, seed and model for all) and rank
    them by predicted time to the target loss: (steps until the smoothed training loss of rank 0 first
    reaches the target) x (the candidate's predicted step time on the target cluster). The target is
    `target_loss`, else the allreduce pilot's smoothed training loss at TARGET_AT of the pilot (so a method
    that needs up to 1 / TARGET_AT times the baseline's steps still reaches it within the pilot).
    Candidates that never reach it rank after those that do, by their final smoothed loss. The smoothing is
    a trailing mean over max(1, steps // 10) steps; every pilot sees the same data, seed and model."""
    from lioncub.apps.train.loop import TrainConfig

    if runner not in PILOT_RUNNERS:
        raise ValueError(f"unknown pilot runner {runner!r}; choose one of: {', '.join(PILOT_RUNNERS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--pilot needs a positive number of steps, got {steps!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"--pilot-ranks must be a positive integer, got {ranks!r}")
    if model not in BUILTIN:
        raise ValueError(f"pilots train a built-in model ({', '.join(BUILTIN)}), not {model!r}")
    window = max(1, steps // 10)
    runs = []
    for c in cands:
        kw = dict(model=model, method=c.method, levels=c.levels,
                  momentum_sync="none" if c.dense else c.momentum_sync, steps=steps,
                  bucket_mb=c.bucket_mb, seed=seed, warmup=min(10, steps // 10))
        if batch_size:
            kw["batch_size"] = batch_size
        if block_size and model != "mlp":
            kw["block_size"] = block_size
        if lr is not None:
            kw["lr"] = lr
        if _arithmetic(c.layout) == "hierarchical" and not c.dense:
            kw.update(hierarchical=True, node_size=pilot_node_size(ranks, cluster.gpus_per_node if cluster else 1))
        cfg = TrainConfig(**kw)
        if log:
            log(f"  pilot {c.label()}: {steps} steps of {model} on {ranks} {runner} rank(s)")
        t0 = time.perf_counter()
        s = PILOT_RUNNERS[runner](cfg, ranks, cluster)
        curve = smoothed([r["loss"] for r in s["records"]], window)
        runs.append(dict(candidate=c, config=kw, final_loss=s["final_loss"], train_loss=curve[-1], curve=curve,
                         wall_seconds=time.perf_counter() - t0, measured_step_seconds=s.get("step_seconds")))
    base = next((r for r in runs if r["candidate"].dense), None)
    if target_loss is None:
        if base is None:
            raise ValueError("give --target-loss (no allreduce pilot to take the target from)")
        at = max(1, math.ceil(TARGET_AT * steps))
        target, basis = base["curve"][at - 1], f"the allreduce pilot's smoothed training loss at step {at}"
    else:
        target, basis = float(target_loss), "--target-loss"
    for r in runs:
        hit = next((i + 1 for i, x in enumerate(r["curve"]) if x <= target), None)
        r["steps_to_target"] = hit
        r["time_to_target"] = None if hit is None else _seconds_to_step(r["candidate"], hit)
    runs.sort(key=lambda r: (r["time_to_target"] is None,
                             r["time_to_target"] if r["time_to_target"] is not None else r["train_loss"]))
    return dict(steps=steps, ranks=ranks, model=model, runner=runner, target_loss=target, target_basis=basis,
                window=window, runs=runs)


def _seconds_to_step(c: Candidate, n: int) -> float:
    """Predicted time of a pilot's first n steps: the adaptive guard runs its dense start in the pilot too
    (a recommended dense warm-up is not part of a pilot)."""
    start = min(n, c.dense_steps) if c.momentum_sync.startswith("adaptive") else 0
    return start * c.dense_step_seconds + (n - start) * c.step_seconds


def pilot_verdict(rec: Candidate, verdict: str, pilot: dict) -> tuple[Candidate, str]:
    """The recommendation after a pilot (`recommend`'s pick and verdict, and `run_pilots`' result): the
    candidate that reached the target loss first in predicted time overrules the simulator's pick; when it
    is that pick, the verdict says the pilot agrees; when no candidate reached the target, the pick stands."""
    first = pilot["runs"][0]
    if first["time_to_target"] is None:
        return rec, verdict
    if first["candidate"] is not rec:
        return first["candidate"], (
            f"the pilot overrides the simulator's pick ({rec.label()}): {first['candidate'].label()} reaches the "
            f"target loss first in predicted time ({format_time(first['time_to_target'])} = "
            f"{first['steps_to_target']} steps x {format_time(first['candidate'].step_seconds)}).")
    return rec, verdict + " The pilot agrees: it reaches the target loss first in predicted time."


def pilot_to_dict(p: dict) -> dict:
    out = {k: v for k, v in p.items() if k != "runs"}
    out["runs"] = [{"method": r["candidate"].method, "levels": r["candidate"].levels,
                    "momentum_sync": r["candidate"].momentum_sync, "bucket_mb": r["candidate"].bucket_mb,
                    "predicted_step_seconds": r["candidate"].step_seconds, "final_eval_loss": r["final_loss"],
                    "final_train_loss": r["train_loss"], "steps_to_target": r["steps_to_target"],
                    "predicted_time_to_target_seconds": r["time_to_target"],
                    "measured_step_seconds": r["measured_step_seconds"], "wall_seconds": r["wall_seconds"],
                    "train_config": r["config"]}
                   for r in p["runs"]]
    return out
