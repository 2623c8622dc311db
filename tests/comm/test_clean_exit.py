"""A run ends cleanly whatever its ending: never a signal, never a non-zero status (lioncub.comm.clean_exit).

The failure it guards against is a race at interpreter exit (a Gloo worker thread releasing a collective's
tensor while Python finalises: SIGABRT); a run that loses it aborts, so the bare ending, the tutorials' one,
is repeated."""

import os
import random
import re
import subprocess
import sys

import pytest
from repo import HELPERS

REPEATS = {"bare": 6, "none": 2, "finish": 1}


def run(ending: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(random.randint(20000, 40000)), str(HELPERS / "ending.py"), ending]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("ending", list(REPEATS))
def test_every_ending_is_clean(ending):
    for i in range(REPEATS[ending]):
        out = run(ending)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "terminate called" not in text and "SIGABRT" not in text, (i, text[-3000:])
        # (the ranks share one stdout: their lines may interleave)
        assert sorted(re.findall(rf"rank (\d) ended \({ending}\)", out.stdout)) == ["0", "1", "2", "3"], out.stdout
