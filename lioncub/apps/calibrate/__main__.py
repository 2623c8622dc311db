"""One rank of a lab calibration: `python -m lioncub.apps.calibrate JOB_JSON`, started by the lab launcher."""

from __future__ import annotations

import json
import sys


def main(job: dict) -> None:
    import torch.distributed as dist

    from lioncub.apps.lab.launch import report
    from lioncub.comm.distributed import gloo_rank

    from .ranks import run

    with gloo_rank(job.get("pg_timeout", 900)):
        out = run(job)
        if dist.get_rank() == 0:
            report(out)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
