"""Training on the emulated Ethernet lab: each rank runs `python -m lioncub.apps.train.lab CONFIG_JSON` inside its
host's network namespace (the lab sets the torchrun environment), and reports its summary back.

Link bytes. Local rank 0 of each host reads its host link's counters (`lioncub.apps.lab.link_counters`) right after
the last untimed step and right after the last step, so the window holds exactly the steps the step times and
`bytes_per_step` average (all but the first two; all but the first in runs of 4 steps or fewer): start-up,
the parameter broadcast, the first steps and the final evaluation are outside it. Each host reads on its own
clock, without a barrier: a read may miss the tail of a step still queued at the shaper, and the other end of
the window misses the same, so the counts per step are those of the timed steps. The summary's
`link_bytes_per_step` is the mean over hosts of the bytes each host's link carried per step, both
directions (tx + rx), in Ethernet frames as the shapers account them (14-byte header + IP packet per frame:
TCP/IP/Ethernet framing included, preamble/FCS/gap not); `link_tx_bytes_per_step` the mean sent up each
link; `link_hosts` each host's per-step counts (frames and the veth's own counters too, see
`lioncub.apps.lab.netns.link_counters`). Traffic between the ranks of one host stays on the host and is not counted.
`predicted_nic_bytes_per_step` is the simulator's count of the same thing outwards, as TCP payload: the
measured `link_tx_bytes_per_step` adds the frames' headers (1514 bytes per 1448), ACKs and control messages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys


def train_on_lab(cfg, ranks: int, bandwidth="1Gbit", ranks_per_host: int = 1, progress: bool = True,
                 lab=None, timeout: float | None = None, compute_seconds: float | None = None, profile=None) -> dict:
    """Rank 0's summary of training `cfg` on `ranks` lab ranks; builds (and tears down) a lab unless an
    open `lab` is given. The prediction uses `compute_seconds` (e.g. from train.hostcal), or else the compute
    time the run measured, and `profile` (e.g. train.hostcal's; default: the bundled lab calibration); the
    summary's `forecast` compares the two (train/forecast.py)."""
    from lioncub.apps.lab import Lab

    if lab is None:
        with Lab(ranks=ranks, ranks_per_host=ranks_per_host, bandwidth=bandwidth) as new_lab:
            return train_on_lab(cfg, ranks, bandwidth, ranks_per_host, progress, new_lab, timeout, compute_seconds,
                                profile)
    early = _early_forecast(cfg, ranks, lab.rate_bps, ranks_per_host, compute_seconds, profile)
    argv = [sys.executable, "-m", "lioncub.apps.train.lab", json.dumps(dataclasses.asdict(cfg)), str(int(progress)),
            json.dumps(early)]
    results = lab.run(argv, ranks=ranks, timeout=timeout, stream_rank0=progress)
    link = link_per_step([r.result.get("link") for r in results if r.result])
    summary = results[0].result
    summary.pop("link", None)
    summary.update(link)
    summary["lab"] = {k: v for k, v in lab.describe().items() if k != "hosts"}
    p = prediction(cfg, summary, ranks, lab.rate_bps, ranks_per_host, compute_seconds, profile)
    summary["predicted_step_seconds"] = p and p.step_seconds
    summary["predicted_step_interval"] = p and p.step_interval
    summary["predicted_nic_bytes_per_step"] = p and p.nic_bytes_per_node
    if p is not None:
        from lioncub.apps.train.forecast import compare

        summary["forecast"] = compare(summary, p, cfg.configuration.compressed)
    return summary


def _early_forecast(cfg, ranks, rate, ranks_per_host, compute_seconds, profile) -> dict | None:
    """The forecast rank 0 compares its first steps with (forecast.forecast_of), where the compute time is known
    before the run; None otherwise."""
    from lioncub.apps.train.forecast import forecast_of
    from lioncub.apps.train.loop import build
    from lioncub.apps.train.models import count_params

    if compute_seconds is None:
        return None
    p = prediction(cfg, {"params": count_params(build(cfg)[0])}, ranks, rate, ranks_per_host, compute_seconds,
                   profile)
    return None if p is None else forecast_of(p)


def link_per_step(windows: list[dict | None]) -> dict:
    """The summary's link figures from the hosts' counter windows (see the module's docstring); {} if none."""
    windows = sorted((w for w in windows if w), key=lambda w: w["host"])
    if not windows:
        return {}
    hosts = [dict(host=w["host"], **{k: (w["end"][k] - w["start"][k]) / w["steps"] for k in w["end"]})
             for w in windows]
    return dict(link_bytes_per_step=statistics.fmean(h["tx_bytes"] + h["rx_bytes"] for h in hosts),
                link_tx_bytes_per_step=statistics.fmean(h["tx_bytes"] for h in hosts),
                link_window_steps=windows[0]["steps"], link_hosts=hosts)


def prediction(cfg, summary: dict, ranks: int, bandwidth, ranks_per_host: int = 1, compute_seconds=None,
               profile=None):
    """The calibrated simulator's StepResult for this run; None where the simulator cannot model it."""
    from lioncub.apps.train.predict import predict_step

    compute = summary["compute_seconds"] if compute_seconds is None else compute_seconds
    try:
        return predict_step(cfg, summary["params"], compute, ranks=ranks, bandwidth=bandwidth,
                            ranks_per_host=ranks_per_host, profile=profile)
    except NotImplementedError:
        return None


def predicted(cfg, summary: dict, ranks: int, bandwidth, ranks_per_host: int = 1,
              compute_seconds=None) -> float | None:
    """The calibrated simulator's step time for this run; None where the simulator cannot model it."""
    p = prediction(cfg, summary, ranks, bandwidth, ranks_per_host, compute_seconds)
    return None if p is None else p.step_seconds


def _rank_main() -> None:
    from lioncub.apps.lab import link_counters, report
    from lioncub.apps.train.loop import TrainConfig, train
    from lioncub.comm.distributed import finish, init_distributed

    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    progress = len(sys.argv) > 2 and sys.argv[2] == "1"
    early = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    rank, _ = init_distributed(backend="gloo", timeout=300)
    first = 2 if cfg.steps > 4 else 1  # the last untimed step (train.loop.summarize times records[2:])
    reads, seen = {}, []

    def on_step(record):
        if os.environ.get("LOCAL_RANK") == "0" and record["step"] in (first, cfg.steps):
            reads[record["step"]] = link_counters()
        seen.append(record)
        if early and rank == 0 and record["step"] == min(EARLY_STEPS, cfg.steps):
            _report_early(seen, early, cfg.configuration.compressed)

    summary = train(cfg, progress=progress and rank == 0, on_step=on_step)
    if rank:
        summary.pop("records")
    if cfg.steps > first and reads.get(first) and reads.get(cfg.steps):
        summary["link"] = dict(host=int(os.environ["GROUP_RANK"]), steps=cfg.steps - first, start=reads[first],
                               end=reads[cfg.steps])
    report(summary)

    finish()
    # The result is on disk: skip the interpreter's teardown (the rank's time is the lab's).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


EARLY_STEPS = 8  # rank 0 compares its first steps with the forecast after this many


def _report_early(records, forecast, compressed) -> None:
    from lioncub.apps.train.forecast import compare_components, format_comparison, so_far

    c = compare_components(so_far(records), forecast, compressed)
    print(format_comparison(c, f"first {len(records)} steps"), file=sys.stderr, flush=True)


if __name__ == "__main__":
    _rank_main()
