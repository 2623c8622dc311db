"""`python -m research bench pool`: several `bench train` JSONs pooled row by row (research/pooling.py)."""

import json

import pytest

from research.cli import main
from research.pooling import load, pool


def _row(method, step, speedup, predicted=None, sync="none", hier=False, hook=False):
    return dict(method=method, momentum_sync=sync, hierarchical=hier, ddp_hook=hook, mean_step_seconds=step,
                speedup=speedup, predicted_step_seconds=predicted)


def _run(tmp_path, name, compute, rows, bandwidth="100Mbit", model="char-small"):
    path = tmp_path / name
    path.write_text(json.dumps(dict(model=model, results=[dict(
        bandwidth=bandwidth, ranks=4, ranks_per_host=1, compute_seconds=compute, baseline="ddp+lion@none",
        rows=rows)])))
    return str(path)


@pytest.fixture
def three_runs(tmp_path):
    """Three runs of one command: vote-1bit 8x, 6x and 7x over ddp+lion at compute 0.10, 0.15 and 0.12 s; the
    third forecast vote-1bit 20% slow."""
    return [
        _run(tmp_path, "a.json", 0.10, [_row("ddp+lion", 1.6, 1.0, 1.6), _row("vote-1bit", 0.2, 8.0, 0.19)]),
        _run(tmp_path, "b.json", 0.15, [_row("ddp+lion", 1.8, 1.0, 1.8), _row("vote-1bit", 0.3, 6.0, 0.3)]),
        _run(tmp_path, "c.json", 0.12, [_row("ddp+lion", 1.75, 1.0, 1.75), _row("vote-1bit", 0.25, 7.0, 0.3)]),
    ]


def test_each_configuration_is_the_median_and_range_of_its_runs(three_runs):
    groups = {g["config"]: g for g in pool(load(three_runs))}
    vote = groups["vote-1bit@none"]
    assert vote["runs"] == 3
    assert vote["speedup"] == dict(median=7.0, low=6.0, high=8.0)
    assert vote["step"] == dict(median=0.25, low=0.2, high=0.3)
    assert vote["compute"] == dict(median=0.12, low=0.10, high=0.15)
    assert vote["error"]["median"] == pytest.approx(0.0) and vote["error"]["high"] == pytest.approx(0.2)
    assert vote["error"]["low"] == pytest.approx(0.19 / 0.2 - 1)
    assert (vote["within_10pct"], vote["forecasts"]) == (2, 3)
    assert sorted(vote["points"]) == [(0.10, 8.0), (0.12, 7.0), (0.15, 6.0)]
    assert groups["ddp+lion@none"]["speedup"] == dict(median=1.0, low=1.0, high=1.0)


def test_rows_are_kept_apart_by_link_rate_layout_and_model(tmp_path):
    runs = [_run(tmp_path, "a.json", 0.1, [_row("vote-1bit", 0.2, 8.0), _row("vote-1bit", 0.3, 5.0, hier=True),
                                           _row("vote-1bit", 0.21, 7.5, hook=True)]),
            _run(tmp_path, "b.json", 0.1, [_row("vote-1bit", 0.15, 1.5)], bandwidth="1Gbit"),
            _run(tmp_path, "c.json", 0.1, [_row("vote-1bit", 0.4, 4.0)], model="char-tiny")]
    groups = pool(load(runs))
    keys = [(g["model"], g["bandwidth"], g["config"], g["runs"]) for g in groups]
    assert keys == [("char-small", "100Mbit", "vote-1bit@none", 1), ("char-small", "100Mbit", "vote-1bit@none+hier", 1),
                    ("char-small", "100Mbit", "vote-1bit@none in DDP", 1), ("char-small", "1Gbit", "vote-1bit@none", 1),
                    ("char-tiny", "100Mbit", "vote-1bit@none", 1)]


def test_the_plot_pairs_each_run_s_own_compute_and_speedup(tmp_path):
    # one run without a calibrated compute, one without a speedup: only the third run has both
    no_compute = _run(tmp_path, "a.json", None, [_row("vote-1bit", 0.2, 8.0)])
    no_speedup = _run(tmp_path, "b.json", 0.15, [_row("vote-1bit", 0.3, None)])
    both = _run(tmp_path, "c.json", 0.12, [_row("vote-1bit", 0.25, 7.0)])
    (g,) = pool(load([no_compute, no_speedup, both]))
    assert g["points"] == [(0.12, 7.0)]
    assert g["speedup"] == dict(median=7.5, low=7.0, high=8.0) and g["compute"] == dict(median=0.135, low=0.12,
                                                                                        high=0.15)


def test_a_failed_row_is_left_out_and_a_run_without_forecasts_has_none(tmp_path):
    runs = [_run(tmp_path, "a.json", 0.1, [_row("vote-1bit", 0.2, 8.0)]),
            _run(tmp_path, "b.json", 0.1, [_row("vote-1bit", None, None)])]
    (g,) = pool(load(runs))
    assert g["runs"] == 1 and g["error"] is None and g["forecasts"] == 0


def test_the_command_prints_the_table_and_draws_the_speedup_against_compute(three_runs, tmp_path, capsys):
    png = tmp_path / "pool.png"
    assert main(["bench", "pool", *three_runs, "--plot", str(png), "--configs", "vote-1bit"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "vote-1bit@none" in x)
    assert "| 3 | 7.00 (6.00-8.00)x | 250 (200-300) | 120 (100-150) |" in line
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "pool", *three_runs, "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert [g["speedup"]["median"] for g in groups] == [1.0, 7.0]


@pytest.mark.parametrize("content, says", [(None, "No such file"), ("{", "not valid JSON"),
                                           ('{"runs": []}', "not a `lioncub bench train --json` result")])
def test_bad_files_get_one_line(tmp_path, capsys, content, says):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "pool", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and str(path) in err


def test_a_plot_of_configurations_no_run_has_is_refused(three_runs, tmp_path, capsys):
    assert main(["bench", "pool", *three_runs, "--plot", str(tmp_path / "p.png"), "--configs", "l1-pbit"]) == 2
    assert "nothing to plot" in capsys.readouterr().err
