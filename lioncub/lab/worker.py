"""One rank of `lab bench`: `python -m lioncub.lab.worker JOB_JSON`, started by the launcher."""

from __future__ import annotations

import json
import sys
from datetime import timedelta


def main(job: dict) -> None:
    import torch
    import torch.distributed as dist

    from lioncub.distributed import finish

    from .bench import run_probe
    from .launch import report

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=job["pg_timeout"]))
    try:
        results = [run_probe(p) for p in job["probes"]]
        report(results)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
