"""The outputs the layout change of issue 49 must keep: parameters, momenta and counters of every case, and the
simulator grid, hashed and compared with the digests recorded before it (tests/golden/digests.json)."""

import json
from pathlib import Path

import golden_cases
import pytest

RECORDED = json.loads((Path(__file__).parent / "digests.json").read_text())


def test_simulator_grid_is_unchanged():
    grid = golden_cases.simulator_grid()
    assert len(grid) == RECORDED["simulator_rows"]
    import hashlib

    assert hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest()[:16] == RECORDED["simulator"]


@pytest.mark.parametrize("case", golden_cases.CASES, ids=[c[0] for c in golden_cases.CASES])
def test_optimizer_outputs_are_unchanged(case):
    name = case[0]
    assert golden_cases.optimizer_digests([case])[name] == RECORDED["optimizer"][name]
