"""opt.stats.versus: a training loop's own steps (opt.timing = True) beside the simulator's forecast."""

import json
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
from lioncub.simulator import Cluster, simulate_step

from lioncub import LionCub
from lioncub.optim.stats import WINDOW

PAUSE = 0.01  # the loop's "forward and backward": every step is at least this long


def _loop(steps: int, timing: bool = True):
    model = torch.nn.Linear(16, 8)
    opt = LionCub(model.parameters(), lr=1e-3)
    opt.timing = timing
    for _ in range(steps):
        time.sleep(PAUSE)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_versus_compares_the_loops_own_steps_with_the_forecast():
    opt = _loop(8)
    forecast = simulate_step(Cluster.for_ranks(4, bandwidth=1e9), "vote-1bit", 1000, compute_seconds=PAUSE)
    c = opt.stats.versus(forecast)
    rows = {r["component"]: r for r in c["rows"]}
    timed = opt.stats.recent[2:]
    assert len(opt.stats.recent) == 7  # every step but the first has a period
    assert rows["step"]["measured"] == pytest.approx(statistics.fmean(r[0] for r in timed))
    assert rows["step"]["measured"] >= PAUSE  # the loop paused that long between two steps
    assert rows["step"]["forecast"] == forecast.step_seconds
    assert rows["codec"]["forecast"] == forecast.codec_seconds
    assert rows["exposed communication"]["measured"] == 0.0  # one rank: nothing on the wire
    assert c["step_error"] == pytest.approx(rows["step"]["measured"] / forecast.step_seconds - 1)
    assert c["differs_most"] in ("codec", "exposed communication")
    text = str(c)
    assert "forecast vs measured" in text and f"{c['differs_most']} differs most" in text
    json.dumps(opt.stats.as_dict())  # the window stays out of the statistics' dict


def test_versus_names_the_remedy_when_compressed_is_slower_than_the_forecast_dense_step():
    opt = _loop(5)
    fast = SimpleNamespace(method="vote-1bit", step_seconds=1e-4, codec_seconds=1e-5,
                           exposed_communication_seconds=1e-5, compute_seconds=5e-5, contention=None,
                           step_interval=(8e-5, 1.2e-4), baseline_step_seconds=2e-4)
    c = opt.stats.versus(fast)
    assert c["remedy"] and "autotune" in c["remedy"] and c["inside"] is False
    dense = SimpleNamespace(**{**vars(fast), "method": "allreduce"})
    assert opt.stats.versus(dense)["remedy"] is None  # the dense method is the baseline itself


def test_versus_needs_timing_and_keeps_a_window():
    with pytest.raises(ValueError, match="timing = True"):
        _loop(3, timing=False).stats.versus(None)
    opt = LionCub([torch.nn.Parameter(torch.zeros(3))])
    opt.timing = True
    for _ in range(WINDOW + 5):
        opt.step()
    assert len(opt.stats.recent) == WINDOW
