"""One rank of a group of probes (probes.py): `python -m lioncub.apps.lab.worker JOB_JSON`, started by the launcher."""

from __future__ import annotations

import json
import sys


def main(job: dict) -> None:
    from lioncub.comm.distributed import gloo_rank

    from .launch import report
    from .probes import run_probe

    with gloo_rank(job["pg_timeout"]):
        report([run_probe(p) for p in job["probes"]])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
