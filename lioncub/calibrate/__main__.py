"""One rank of a lab calibration: `python -m lioncub.calibrate JOB_JSON`, started by the lab launcher."""

from __future__ import annotations

import json
import sys
from datetime import timedelta


def main(job: dict) -> None:
    import torch
    import torch.distributed as dist

    from lioncub.distributed import finish
    from lioncub.lab.launch import report

    from .ranks import run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=job.get("pg_timeout", 900)))
    try:
        out = run(job)
        if dist.get_rank() == 0:
            report(out)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
