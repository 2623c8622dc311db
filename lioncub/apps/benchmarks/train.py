"""`lioncub bench train` and `lioncub bench convergence`: the end-to-end figures.

* train: the baseline users run today (ddp+lion: torch DDP and plain Lion) and every LionCub method train the
  same model for the same steps on the emulated Ethernet lab (root) at each link rate: step time and
  speedup over ddp+lion, loss against its loss, bytes per step against fp32, the calibrated simulator's
  prediction (from the compute time measured once, without communication) and its error, and how close
  each step is to its overlap limit max(compute, codec + bytes on the wire / link rate).
* convergence: every method for a few hundred steps on local Gloo ranks: loss curves (PNG) and a table.
"""

from __future__ import annotations

import json
import sys

from lioncub import methods
from lioncub.apps.demo import SCENARIO
from lioncub.apps.train.configs import DDP_LION, STREAM, split_local, split_stream
from lioncub.apps.train.configs import parse as configuration
from lioncub.files import check_writable

CONFIGS = [(DDP_LION.name, "none", False)] + [(m, "none", False) for m in methods.NAMES] + [
    ("vote-1bit", "every:10", False), ("l1-pbit", "every:10", False)]
HIER = "+hier"  # the configuration suffix of LionCub's hierarchical layout
CONFIG_SYNTAX = (f"comma-separated method[+local:H[:outer][+stream:F[:D]]][@sync][{HIER}], e.g. allreduce,"
                 f"vote-1bit@every:10,vote-1bit{HIER},vote-1bit+local:25+stream:5: {HIER} runs LionCub's hierarchical "
                 "layout (nodes of --ranks-per-host ranks: reduce-scatter of the gradients and all-gather of the codes "
                 "inside a node, the vote across nodes); +local:H H local steps, +stream:F[:D] their outer steps "
                 "streamed in F fragments, each overlapping D inner steps (default 1)")


def _configs(spec: str | None, local_steps: int | None = None, outer: str | None = None) -> list:
    """(method, momentum sync, hierarchical) for each item of a `method[+local:H[:outer][+stream:F[:D]]][@sync][+hier]`
    list; `method` is a configuration (lioncub.apps.train.configs: a LionCub method or ddp+lion), checked here,
    with its local steps (+local:H, or `local_steps` for every LionCub method without its own) and streamed outer
    steps (+stream:F[:D]) kept in the text."""
    out = []
    for item in spec.split(",") if spec else [f"{m}@{s}" for m, s, _ in CONFIGS]:
        hier = item.endswith(HIER)
        method, _, sync = item.removesuffix(HIER).partition("@")
        name, H, own_outer = split_local(method)
        run = configuration(name)
        if H is None and local_steps and not run.plain_lion:
            H, own_outer = local_steps, outer
        local = "" if H is None else f"+local:{H}" + (f":{own_outer}" if own_outer else "")
        _, F, D = split_stream(method)
        local += "" if F is None else f"{STREAM}{F}" + ("" if D is None else f":{D}")
        out.append((run.name + local, sync or "none", hier))
    return out


def _configuration(method: str):
    """The configuration of a row's method text (its local steps left off)."""
    return configuration(split_local(method)[0])


def row_label(method, sync, hier) -> str:
    return f"{method}@{sync}{HIER if hier else ''}"


def scenario(model: str) -> dict:
    """The demo's scenario (batch, block, lr) with the `model` a bench runs: what its JSON records."""
    return {**SCENARIO, "model": model}


def _cfg(method, sync, steps, model, ddp_hook=False, hierarchical=False):
    """The configuration of a row. A hierarchical row leaves node_size to the lab's LOCAL_WORLD_SIZE (its ranks
    per host)."""
    from lioncub.apps.train.loop import TrainConfig

    name, local_steps, outer = split_local(method)
    _, fragments, outer_delay = split_stream(method)
    return TrainConfig(**scenario(model), method=name, momentum_sync=sync, steps=steps,
                       ddp_hook=ddp_hook, hierarchical=hierarchical, local_steps=local_steps, outer=outer,
                       fragments=fragments, outer_delay=outer_delay)


def _runs(configs, ddp_hook, local_steps=None, outer=None):
    """(method, sync, hierarchical, in DDP?) for each row: with ddp_hook, each LionCub configuration once alone
    and once attached to torch DDP, one after the other."""
    out = []
    for method, sync, hier in _configs(configs, local_steps, outer):
        out.append((method, sync, hier, False))
        if ddp_hook and not _configuration(method).plain_lion:
            out.append((method, sync, hier, True))
    return out


def _wire_seconds(s: dict, rate: float, wire_eff: float, ranks_per_host: int) -> float:
    """Least time on the wire for a step: one rank per host, its bytes at the link's payload rate; several,
    the busiest direction of the busiest host link as measured (frames, so at the raw rate)."""
    if ranks_per_host == 1 or not s.get("link_hosts"):
        return s["bytes_per_step"] * 8 / (rate * wire_eff)
    return max(max(h["tx_bytes"], h["rx_bytes"]) for h in s["link_hosts"]) * 8 / rate


def bench_train(bandwidths, ranks=4, steps=100, configs=None, model="char-small", ddp_hook=False,
                ranks_per_host=1, local_steps=None, outer=None) -> dict:
    """1. check the rows and measure the compute once (without communication); 2. at each link rate, train
    every row on one lab; 3. compare each row with the reference row of its rate."""
    from lioncub.apps.calibrate import default_lab_profile
    from lioncub.apps.lab import Lab
    from lioncub.apps.lab.lab import ranks_per_host_for
    from lioncub.apps.train.hostcal import calibrate_host
    from lioncub.simulator.units import parse_rate

    runs = _runs(configs, ddp_hook, local_steps, outer)
    ranks_per_host_for(ranks, ranks_per_host=ranks_per_host)  # a bad layout fails before anything runs
    if ranks_per_host == 1 and any(hier for _, _, hier, _ in runs):
        raise ValueError(f"{HIER} needs nodes of several ranks: give --ranks-per-host (e.g. 2)")
    wire_eff = default_lab_profile().wire_efficiency
    # the host in the run's shape (every rank on this machine's cores): compute, codec, collectives under load
    profile, host = calibrate_host(_cfg(methods.BASELINE, "none", steps, model), ranks)
    compute = host["compute_seconds"]
    print(f"  host: forecast interval {host['forecast_error']}, held out {host['held_out']}", file=sys.stderr)
    results, failed = [], []
    for bw in bandwidths:
        rate = parse_rate(bw)
        with Lab(ranks=ranks, ranks_per_host=ranks_per_host, bandwidth=rate) as lab:
            rows = _train_rows(lab, runs, bw, rate, wire_eff, (compute, profile), failed, ranks=ranks,
                               ranks_per_host=ranks_per_host, steps=steps, model=model)
            congestion = lab.describe()["congestion_control"]
        base = _reference(rows)
        if base is None:
            continue
        _compare(rows, base)
        results.append(dict(bandwidth=bw, ranks=ranks, ranks_per_host=ranks_per_host, steps=steps, rows=rows,
                            congestion_control=congestion,
                            baseline=row_label(base["method"], base["momentum_sync"], base["hierarchical"]),
                            compute_seconds=compute, host=host["host"], forecast_error=host["forecast_error"],
                            held_out=host["held_out"], codec_bandwidth=host["codec_bandwidth"], host_raw=host["raw"],
                            baseline_comm_fraction=max(0.0, 1 - compute / base["mean_step_seconds"])))
    return dict(model=model, scenario=scenario(model), results=results, failed=failed)


def reforecast(res: dict, result: dict, row: dict, profile=None, refit: bool = False):
    """The forecast of one row of a `bench train` JSON (`res`; `result`: one of its results) made again from what
    the JSON stores: the calibrated compute, host model, codec speeds (JSON before 2026-11-27 16:00 has none: the
    profile's are used) and interval over `profile` (default: the bundled lab's). The StepResult; with the same
    simulator and a JSON with codec speeds, its step is the row's predicted_step_seconds. `refit`: the host model,
    codec speeds and interval fitted again from the calibration's raw probes (JSON from 2026-11-28 05:00 on), as
    the present calibration fits them."""
    from lioncub.apps.calibrate import default_lab_profile
    from lioncub.apps.train.hostcal import fitted, with_host
    from lioncub.apps.train.predict import predict_step
    from lioncub.simulator.units import parse_rate

    base = profile or default_lab_profile()
    if refit:
        if "host_raw" not in result:
            raise ValueError("this JSON holds no raw host probes to fit again (bench train before 2026-11-28 05:00)")
        prof = fitted(result["host_raw"], base)[0]
    else:
        prof = with_host(base, result["host"], result.get("codec_bandwidth", {}), result["forecast_error"])
    cfg = _cfg(row["method"], row["momentum_sync"], result["steps"], res["model"], row["ddp_hook"],
               row["hierarchical"])
    return predict_step(cfg, row["params"], result["compute_seconds"], ranks=result["ranks"],
                        bandwidth=parse_rate(result["bandwidth"]), ranks_per_host=result["ranks_per_host"],
                        profile=prof)


def _train_rows(lab, runs, bw, rate, wire_eff, measured, failed, *, ranks, ranks_per_host, steps, model) -> list:
    """Each run's row at one link rate; a run the lab fails is recorded in `failed` and costs only its row.
    `measured`: (compute seconds, the profile with the host calibration) the predictions use."""
    from lioncub.apps.lab import LabError
    from lioncub.apps.train.lab import train_on_lab

    (compute, profile), rows = measured, []
    for method, sync, hier, hooked in runs:
        try:
            s = train_on_lab(_cfg(method, sync, steps, model, hooked, hier), ranks, rate,
                             ranks_per_host=ranks_per_host, progress=sys.stderr.isatty(), lab=lab,
                             compute_seconds=compute, profile=profile)
        except LabError as exc:
            print(f"  {bw} {row_label(method, sync, hier)}: FAILED: {exc}", file=sys.stderr, flush=True)
            failed.append(dict(bandwidth=bw, method=method, momentum_sync=sync, hierarchical=hier,
                               error=str(exc)[:2000]))
            continue
        s.pop("records", None)
        # the overlap limit: no overheads, every byte at the link's payload rate, all of it hidden behind the
        # run's own compute if it fits (not the calibration's: the load may have changed since)
        limit = max(s["compute_seconds"], s["codec_seconds"] + _wire_seconds(s, rate, wire_eff, ranks_per_host))
        rows.append(dict(method=method, momentum_sync=sync, hierarchical=hier, ddp_hook=hooked, **{
            k: s[k] for k in ("final_loss", "step_seconds", "mean_step_seconds", "compute_seconds",
                              "codec_seconds", "comm_seconds", "bytes_per_step", "predicted_step_seconds",
                              "predicted_step_interval",
                              "params")}, node_bytes_per_step=s.get("node_bytes_per_step", 0),
            **{k: s.get(k) for k in ("link_bytes_per_step", "link_tx_bytes_per_step", "link_hosts",
                                     "predicted_nic_bytes_per_step", "mean_exposed_seconds", "mean_compute_seconds",
                                     "mean_optimizer_seconds", "start_wait_seconds", "local_steps", "fragments",
                                     "outer_delay")},
            limit_seconds=limit))
        print(f"  {bw} {row_label(method, sync, hier)}{' in DDP' if hooked else ''}: "
              f"{1e3 * s['mean_step_seconds']:.1f} ms, loss {s['final_loss']:.4f}", file=sys.stderr, flush=True)
    return rows


def _reference(rows: list) -> dict | None:
    """The row the others are compared with: what users run today (plain Lion in its wrapper: ddp+lion), else
    LionCub's dense method (allreduce), else the first row (e.g. vote-1bit alone against itself in DDP with
    --ddp-hook)."""
    def rank(item):
        i, row = item
        run = _configuration(row["method"])
        local = split_local(row["method"])[1] is not None
        return (0 if run.plain_lion else 1 if run.dense and not local else 2, i)

    return min(enumerate(rows), key=rank)[1] if rows else None


def _compare(rows: list, base: dict) -> None:
    """Each row against the reference row, in place."""
    for r in rows:  # time per step averaged over the run: periodic momentum syncs included
        r["speedup"] = base["mean_step_seconds"] / r["mean_step_seconds"]
        r["loss_vs_baseline"] = r["final_loss"] / base["final_loss"] - 1
        # bytes beyond the rank's own node (the hierarchical layout's node collectives ride NVLink/PCIe)
        r["bytes_vs_fp32"] = _beyond_node(r) / _beyond_node(base)
        r["link_vs_baseline"] = (r["link_bytes_per_step"] / base["link_bytes_per_step"]
                                 if r["link_bytes_per_step"] and base["link_bytes_per_step"] else None)
        r["prediction_error"] = (r["predicted_step_seconds"] / r["mean_step_seconds"] - 1
                                 if r["predicted_step_seconds"] else None)
        r["of_limit"] = r["limit_seconds"] / r["mean_step_seconds"]


def _beyond_node(row: dict) -> float:
    """Bytes a rank sent per step to other nodes' ranks (or, in the flat layout, to any rank)."""
    return row["bytes_per_step"] - (row.get("node_bytes_per_step") or 0)


def _or_na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _band(iv) -> str:
    return f" ({1e3 * iv[0]:.1f}-{1e3 * iv[1]:.1f})" if iv else ""


def format_train(res: dict) -> str:
    """The table. kB/step: what rank 0's optimizer sent per step (its own count) to ranks of other nodes (all
    of it in the flat layout; the hierarchical layout's node collectives excluded); link kB/step: what each
    host's link carried per step, both directions, in Ethernet frames (mean over hosts, measured on the link;
    traffic inside a host is not on it); vs base: that against the baseline row's."""
    lines = []
    for r in res["results"]:
        rph = r.get("ranks_per_host", 1)
        lines += [f"\n{res['model']}, {r['ranks']} lab ranks"
                  f"{f' ({rph} per host)' if rph > 1 else ''} at {r['bandwidth']}, {r['steps']} steps, compute "
                  f"{1e3 * r.get('compute_seconds', 0):.0f} ms (speedups over {r.get('baseline', 'allreduce')}; it "
                  f"spends {r['baseline_comm_fraction']:.0%} of its step beyond the compute)",
                  "| method | sync | mean step ms | speedup | eval loss | vs baseline | kB/step | vs fp32 "
                  "| link kB/step | vs base | predicted ms | error | of limit |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in r["rows"]:
            link, pred = x.get("link_bytes_per_step"), x["predicted_step_seconds"]
            lines.append(
                f"| {x['method']}{HIER if x.get('hierarchical') else ''}{' (in DDP)' if x.get('ddp_hook') else ''} | "
                f"{x['momentum_sync']} | {1e3 * x['mean_step_seconds']:.1f} | {x['speedup']:.2f}x | "
                f"{x['final_loss']:.4f} | {100 * x['loss_vs_baseline']:+.1f}% | {_beyond_node(x) / 1e3:.1f} | "
                f"{100 * x['bytes_vs_fp32']:.1f}% | {_or_na(link and link / 1e3, '.1f')} | "
                f"{_or_na(x.get('link_vs_baseline') and 100 * x['link_vs_baseline'], '.1f')}"
                f"{'%' if x.get('link_vs_baseline') else ''} | {_or_na(pred and 1e3 * pred, '.1f')}"
                f"{_band(x.get('predicted_step_interval'))} | "
                f"{_or_na(x['prediction_error'] and 100 * x['prediction_error'], '+.1f')}"
                f"{'%' if x['prediction_error'] is not None else ''} | {100 * x['of_limit']:.0f}% |")
    for f in res.get("failed", []):
        lines.append(f"\nFAILED at {f['bandwidth']}: {f['method']}{HIER if f.get('hierarchical') else ''} "
                     f"(sync {f['momentum_sync']}): {f['error'][:300]}")
    return "\n".join(lines)


def bench_convergence(ranks=4, steps=300, configs=None, model="char-small", plot=None, local_steps=None,
                      outer=None) -> dict:
    from lioncub.apps.train.loop import train_local

    runs = []
    chosen = _configs(configs or ",".join(f"{m}@{s}" for m, s, _ in CONFIGS[1:]), local_steps, outer)
    if local_steps and not configs:  # allreduce stands for ddp+lion here: keep it as it is, as the baseline
        chosen.insert(0, (methods.BASELINE, "none", False))
    if any(hier for _, _, hier in chosen):
        raise ValueError(f"{HIER} runs on the lab's hosts: use `lioncub bench train --ranks-per-host G`")
    for method, sync, _ in chosen:
        s = train_local(_cfg(method, sync, steps, model), ranks, progress=sys.stderr.isatty())
        runs.append(dict(method=method, momentum_sync=sync, final_loss=s["final_loss"], train_loss=s["train_loss"],
                         curve=[r["loss"] for r in s["records"]]))
        print(f"  {method}@{sync}: eval loss {s['final_loss']:.4f}", file=sys.stderr, flush=True)
    base = next((r for r in runs if _configuration(r["method"]).dense and split_local(r["method"])[1] is None),
                runs[0])  # LionCub's allreduce, else the first row
    for r in runs:
        r["vs_baseline"] = r["final_loss"] / base["final_loss"] - 1
    res = dict(model=model, ranks=ranks, steps=steps, scenario=scenario(model), runs=runs)
    if plot:
        _plot(res, plot)
    return res


def _plot(res, path) -> None:
    from lioncub.apps.autotune import smoothed
    from lioncub.optional import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in res["runs"]:
        label = r["method"] + ("" if r["momentum_sync"] == "none" else f" ({r['momentum_sync']})")
        base = r is res["runs"][0]  # the baseline's curve: bold and black
        ax.plot(range(1, len(r["curve"]) + 1), smoothed(r["curve"], 15), label=f"{label}: {r['final_loss']:.3f}",
                lw=2.5 if base else 1.2, color="black" if base else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0, smoothed over 15 steps)")
    ax.set_title(f"{res['model']}, {res['ranks']} ranks: every method against the allreduce baseline "
                 "(legend: final eval loss)", fontsize=9)
    ax.legend(fontsize=8)
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def format_convergence(res: dict) -> str:
    lines = [f"\n{res['model']}, {res['ranks']} local ranks, {res['steps']} steps, lr {res['scenario']['lr']}",
             "| method | momentum sync | eval loss | vs baseline | train loss (last 10) |", "|---|---|---:|---:|---:|"]
    for r in res["runs"]:
        lines.append(f"| {r['method']} | {r['momentum_sync']} | {r['final_loss']:.4f} | "
                     f"{100 * r['vs_baseline']:+.1f}% | {r['train_loss']:.4f} |")
    return "\n".join(lines)


def run_train(args) -> int:
    from lioncub.apps.lab import missing_privileges

    missing = missing_privileges()
    if missing:
        raise SystemExit(f"lioncub bench train runs on the lab, which needs {missing}")
    res = bench_train(args.bandwidth.split(","), args.ranks, args.steps, args.configs, args.model, args.ddp_hook,
                      args.ranks_per_host, getattr(args, "local_steps", None), getattr(args, "outer", None))
    print(json.dumps(res, indent=2) if args.json else format_train(res))
    return 0


def run_convergence(args) -> int:
    if args.plot:
        check_writable(args.plot, "--plot")
    res = bench_convergence(args.ranks, args.steps, args.configs, args.model, args.plot,
                            getattr(args, "local_steps", None), getattr(args, "outer", None))
    print(json.dumps(res, indent=2) if args.json else format_convergence(res))
    return 0
