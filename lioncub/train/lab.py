"""Training on the emulated Ethernet lab: each rank runs `python -m lioncub.train.lab CONFIG_JSON` inside its
host's network namespace (the lab sets the torchrun environment), and reports its summary back."""

from __future__ import annotations

import dataclasses
import json
import sys


def train_on_lab(cfg, ranks: int, bandwidth="1Gbit", ranks_per_host: int = 1, progress: bool = True,
                 lab=None, timeout: float | None = None, compute_seconds: float | None = None) -> dict:
    """Rank 0's summary of training `cfg` on `ranks` lab ranks; builds (and tears down) a lab unless an
    open `lab` is given. The prediction uses `compute_seconds` (e.g. from train.loop.measure_compute), or
    else the compute time the run measured."""
    from lioncub.lab import Lab

    if lab is None:
        with Lab(ranks=ranks, ranks_per_host=ranks_per_host, bandwidth=bandwidth) as new_lab:
            return train_on_lab(cfg, ranks, bandwidth, ranks_per_host, progress, new_lab, timeout, compute_seconds)
    argv = [sys.executable, "-m", "lioncub.train.lab", json.dumps(dataclasses.asdict(cfg)), str(int(progress))]
    results = lab.run(argv, ranks=ranks, timeout=timeout, stream_rank0=progress)
    summary = results[0].result
    summary["lab"] = {k: v for k, v in lab.describe().items() if k != "hosts"}
    summary["predicted_step_seconds"] = predicted(cfg, summary, ranks, lab.rate_bps, ranks_per_host, compute_seconds)
    return summary


def predicted(cfg, summary: dict, ranks: int, bandwidth, ranks_per_host: int = 1, compute_seconds=None) -> float:
    """The calibrated simulator's step time for this run."""
    from lioncub.train.predict import predict_step

    compute = summary["compute_seconds"] if compute_seconds is None else compute_seconds
    return predict_step(cfg, summary["params"], compute, ranks=ranks, bandwidth=bandwidth,
                        ranks_per_host=ranks_per_host).step_seconds


def _rank_main() -> None:
    from lioncub.distributed import finish, init_distributed
    from lioncub.lab import report
    from lioncub.train.loop import TrainConfig, train

    cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))
    progress = len(sys.argv) > 2 and sys.argv[2] == "1"
    rank, _ = init_distributed(backend="gloo", timeout=300)
    summary = train(cfg, progress=progress and rank == 0)
    if rank:
        summary.pop("records")
    report(summary)
    import os

    finish(grace_s=0)
    # The result is on disk. Skip interpreter teardown altogether, the surest way around the Gloo
    # exit-time race that finish() otherwise waits out (see lioncub.distributed.finish).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank_main()
