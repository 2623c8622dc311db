"""`lioncub demo` (`make demo`): simulate, autotune, then train the default scenario and compare.

The default scenario: the character transformer (`char-small`, 3.2M parameters) trained on Python's own
documentation by 4 ranks whose links run at 100 Mbit/s, small per-rank batches so the baseline is
communication-bound. As root the ranks run on the emulated Ethernet lab (one network namespace per rank,
tbf-shaped veth links); otherwise on local Gloo ranks over loopback, and the demo says so.

1. measure this machine (train/hostcal.py, ~30 s): compute with every rank computing, the codec alone and
   beside compute, a collective's fixed cost idle and under compute, loopback speed; and the held-out
   probes whose residuals give every forecast its interval;
2. simulate every method with the bundled lab calibration of the network and the measured host (the ranks
   sharing this machine's cores), against what users run today: torch DDP + Lion;
3. autotune: the fastest configuration within the default convergence-risk bound;
4. train ddp+lion, LionCub's allreduce and the chosen configuration, and print predicted against measured.
"""

from __future__ import annotations

import dataclasses
import sys

from lioncub import methods
from lioncub.apps.options import at_least

SCENARIO = dict(model="char-small", batch_size=8, block_size=32, lr=1e-3)


def register(sub) -> None:
    p = sub.add_parser("demo", help="simulate, autotune and train the default scenario (make demo)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=at_least(2, " (ranks that communicate)"), default=4)
    p.add_argument("--bandwidth", default="100Mbit", help="link rate of the scenario (default 100Mbit)")
    p.add_argument("--steps", type=at_least(1), default=30, help="training steps per configuration (default 30)")
    p.add_argument("--local", action="store_true", help="train on local Gloo ranks even when root")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.set_defaults(func=run)


def say(text: str = "") -> None:
    print(text, flush=True)


def run(args) -> int:
    """The four steps of the module's docstring, each in its function."""
    import json

    from lioncub.apps.lab import missing_privileges
    from lioncub.apps.train.configs import DDP_LION
    from lioncub.apps.train.loop import TrainConfig, build
    from lioncub.apps.train.models import count_params
    from lioncub.apps.train.predict import tensor_sizes
    from lioncub.simulator import Cluster
    from lioncub.simulator.units import format_rate, parse_rate

    rate = parse_rate(args.bandwidth)
    missing = missing_privileges()
    on_lab = not args.local and not missing
    base_cfg = TrainConfig(**SCENARIO, method=DDP_LION.name, steps=args.steps)
    params = count_params(build(base_cfg)[0])
    say(f"lioncub demo: {base_cfg.model} ({params / 1e6:.2f}M parameters) on Python's docs, {args.ranks} ranks, "
        f"{format_rate(rate)} links, batch {base_cfg.batch_size} x {base_cfg.block_size} tokens per rank")

    say("\n1. measure this machine: compute with every rank computing, codec, collectives idle and under compute")
    profile, host = _measure(base_cfg, args.ranks)
    compute = host["compute_seconds"]
    cluster = Cluster.for_ranks(args.ranks, bandwidth=rate, latency=0.0)
    _simulate(cluster, profile, params, compute, tensor_sizes(base_cfg))
    best = _autotune(cluster, profile, params, compute, args.steps)
    chosen = TrainConfig(**SCENARIO, method=best.method, steps=args.steps, levels=best.levels,
                         momentum_sync=best.momentum_sync, bucket_mb=best.bucket_mb)

    where = "the emulated Ethernet lab" if on_lab else "local Gloo ranks over loopback"
    say(f"\n4. train {args.steps} steps each on {where}")
    if not on_lab:
        say(f"   (not on the lab: {missing or '--local given'}; loopback is not a {format_rate(rate)} link, so "
            "the measured step times show the codec and compute, not the network; run as root for the lab)")
    lioncub_allreduce = dataclasses.replace(base_cfg, method=methods.BASELINE)
    # the chosen configuration, unless it is the baseline method that lioncub_allreduce trains already
    cfgs = [base_cfg, lioncub_allreduce] + ([chosen] if chosen.configuration.compressed else [])
    runs = _train(cfgs, args, rate, on_lab, compute, profile)
    say()
    say(table(runs, on_lab))
    if args.json:
        say(json.dumps(runs, indent=2))
    return 0


def _measure(cfg, ranks: int):
    """Step 1: the host calibration (lioncub.apps.train.hostcal) over the bundled network calibration."""
    from lioncub.apps.train.hostcal import calibrate_host
    from lioncub.simulator.step.hosts import gloo_messages

    profile, rep = calibrate_host(cfg, ranks)
    h, lo_hi = rep["host"], rep["forecast_error"]
    say(f"   compute {1e3 * rep['compute_seconds']:.1f} ms per step with {ranks} ranks on {h['cores']:g} cores "
        f"(background {h['background']:.1f} runnable jobs); codec beside compute "
        f"{rep['raw']['codec_busy'] / rep['raw']['alone'][rep['raw']['busy_method']]:.1f}x slower than alone")
    loopback = (f"{h['intra_bandwidth'] / 1e9:.1f} Gbit/s" if h["intra_bandwidth"]
                else "not measurable (2 MiB as fast as 24 bytes: noise)")
    per_message = (f" + {1e6 * h['message_cpu']:.0f} us per message of Gloo's "
                   f"({gloo_messages('allreduce', 2**20, ranks):g} in a bucket's all-reduce)"
                   if h.get("message_cpu") is not None else " (scaled per peer)")
    say(f"   collective CPU {1e6 * h['call_cpu']:.0f} us per call{per_message} + "
        f"{1e9 * h['byte_cpu']:.2f} ns per byte; wake-up "
        f"wait {1e6 * h['wake']:.0f} us per message wait under compute (ranks in sessions of their own, as "
        f"torchrun starts them); loopback {loopback}")
    say(f"   held-out probes: {', '.join(f'{k} {v:+.0%}' for k, v in rep['held_out'].items())}")
    say(f"   forecasts below carry the interval {lo_hi[0]:+.0%} .. {lo_hi[1]:+.0%}")
    return profile, rep


def _simulate(cluster, profile, params: int, compute: float, tensors: list[int]) -> None:
    """Step 2: every method's simulated step against ddp+lion's (torch DDP's fp32 all-reduce in its buckets);
    LionCub's buckets cut at the model's `tensors` as the optimizer cuts them."""
    from lioncub.apps.train.configs import DDP_LION
    from lioncub.apps.train.predict import DDP_BUCKET_MB
    from lioncub.comm.wire import auto_bucket_mb
    from lioncub.simulator import simulate_step
    from lioncub.simulator.step.model import ratio_interval
    from lioncub.simulator.units import format_ms, format_speedup, format_time

    say("\n2. simulate (bundled lab calibration: Gloo over the lab's shaped TCP links; the ranks share this machine's "
        "cores as measured; every method overlaps backward)")
    base = simulate_step(cluster, methods.BASELINE, params, None, DDP_BUCKET_MB, compute, backend=profile)
    bucket_mb = auto_bucket_mb(4 * params)
    say(f"   {'method':16s} {'step (interval)':>26s} {'exposed':>10s} {'speedup (interval)':>22s} {'sent/step':>10s}")
    rows = {DDP_LION.name: base} | {m: simulate_step(cluster, m, params, None, bucket_mb, compute, backend=profile,
                                                     tensors=tensors) for m in methods.NAMES}
    for name, r in rows.items():
        x = base.step_seconds / r.step_seconds
        band = ratio_interval(x, profile.forecast_error)
        say(f"   {name:16s} {format_ms(r.step_seconds, r.step_interval):>26s} "
            f"{format_time(r.exposed_communication_seconds):>10s} {format_speedup(x, band):>22s} "
            f"{r.bytes_sent_per_rank / 1e6:8.3f} MB")
    say(f"   {DDP_LION.name} spends {r_frac(base):.0%} of its step waiting for communication")


def _autotune(cluster, profile, params: int, compute: float, steps: int):
    """Step 3: autotune's recommendation (a Candidate) for the planned run."""
    from lioncub.apps.autotune import recommend, search
    from lioncub.apps.autotune.space import default_schedules
    from lioncub.comm.wire import auto_bucket_mb

    say("\n3. autotune (methods, buckets, momentum sync; within the default convergence-risk bound)")
    # The planned run is autotune's default (10,000 steps): the demo's short runs sample its steady step, so
    # the search leaves out the adaptive guard, whose dense start would be 40% of a 30-step run.
    planned = max(10_000, steps)
    result = search(cluster, params, compute, backend=profile, steps=planned, max_risk=0.45,
                    bucket_mbs=sorted({auto_bucket_mb(4 * params), 4.0, 25.0}),
                    momentum_syncs=[s for s in default_schedules(planned) if s != "adaptive"])
    best, verdict = recommend(result)
    say(f"   {verdict}")
    if best is not None and profile.forecast_error:
        from lioncub.simulator.step.model import ratio_interval
        from lioncub.simulator.units import format_speedup

        band = ratio_interval(best.speedup, profile.forecast_error)
        say(f"   forecast speedup of its step: {format_speedup(best.speedup, band)}")
    return best


def r_frac(r) -> float:
    return r.exposed_communication_seconds / r.step_seconds


def _train(cfgs, args, rate, on_lab, compute, profile) -> list[dict]:
    from lioncub.apps.train.loop import train_local

    out = []
    if on_lab:
        from lioncub.apps.lab import Lab
        from lioncub.apps.train.lab import train_on_lab

        with Lab(ranks=args.ranks, bandwidth=rate) as lab:
            for cfg in cfgs:
                s = train_on_lab(cfg, args.ranks, rate, progress=sys.stderr.isatty(), lab=lab, compute_seconds=compute,
                                 profile=profile)
                out.append(dict(_row(cfg, s), forecast_error=profile.forecast_error))
                say(f"   {_label(cfg):34s} step {1e3 * s['mean_step_seconds']:8.1f} ms (predicted "
                    f"{1e3 * s['predicted_step_seconds']:.1f})  eval loss {s['final_loss']:.4f}")
    else:
        for cfg in cfgs:
            s = train_local(cfg, args.ranks, progress=sys.stderr.isatty())
            out.append(_row(cfg, s))
            say(f"   {_label(cfg):34s} step {1e3 * s['mean_step_seconds']:8.1f} ms  eval loss {s['final_loss']:.4f}")
    return out


def _label(cfg) -> str:
    extra = [] if cfg.momentum_sync == "none" else [f"sync {cfg.momentum_sync}"]
    if cfg.configuration.uses_levels and cfg.levels:
        extra.append(f"s={cfg.levels}")
    return cfg.method + (f" ({', '.join(extra)})" if extra else "")


def _row(cfg, s) -> dict:
    keys = ("final_loss", "mean_step_seconds", "compute_seconds", "codec_seconds", "comm_seconds", "bytes_per_step",
            "predicted_step_seconds")
    return dict(config=_label(cfg), method=cfg.method, **{k: s.get(k) for k in keys})


def table(runs: list[dict], on_lab: bool) -> str:
    """Measured against predicted, each prediction with its interval; the speedups against the first row."""
    from lioncub.simulator.step.model import interval, ratio_interval
    from lioncub.simulator.units import format_speedup

    base = runs[0]
    head = (f"{'configuration':34s} {'eval loss':>9s} {'step ms':>8s} {'predicted (interval)':>24s} {'error':>6s} "
            f"{'speedup':>8s} {'predicted (interval)':>22s} {'kB/step':>9s}")
    rows = [head, "-" * len(head)]
    for r in runs:
        pred, base_pred, err = r["predicted_step_seconds"], base["predicted_step_seconds"], r.get("forecast_error")
        x = base["mean_step_seconds"] / r["mean_step_seconds"]
        pred_ms, pred_x, e = "-", "-", "-"
        if pred:
            band = interval(pred, err)
            pred_ms = f"{1e3 * pred:.1f}" + (f" ({1e3 * band[0]:.1f}-{1e3 * band[1]:.1f})" if band else "")
            e = f"{pred / r['mean_step_seconds'] - 1:+.0%}"
        if pred and base_pred:
            px = base_pred / pred
            pred_x = format_speedup(px, ratio_interval(px, err) if r is not base else None)
        rows.append(f"{r['config']:34s} {r['final_loss']:9.4f} {1e3 * r['mean_step_seconds']:8.1f} {pred_ms:>24s} "
                    f"{e:>6s} {x:7.2f}x {pred_x:>22s} {r['bytes_per_step'] / 1e3:9.1f}")
    if not on_lab:
        rows.append("(local run: no predictions; the loopback network is not the scenario's link)")
    return "\n".join(rows)
