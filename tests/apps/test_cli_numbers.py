"""Counts and sizes out of range are refused by the command's parser in one line, before any rank starts (each of
these crashed with a ZeroDivisionError or ran something else: `bench step --ranks 1`, `train --ranks 0`, `bench
kernels --sizes 0`, `bench convergence --steps 0`, which ran the default 300 steps)."""

import pytest

from lioncub.cli import main
from lioncub.comm.spawn import spawn

REFUSED = [
    (["bench", "step", "--ranks", "1"], "argument --ranks: must be at least 2 (ranks that communicate), got 1"),
    (["bench", "step", "--params=-5"], "argument --params: must be a positive number, got -5"),
    (["bench", "step", "--params", "nan"], "argument --params: must be a positive number, got nan"),
    (["bench", "step", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    (["bench", "step", "--steps", "two"], "argument --steps: not a whole number: 'two'"),
    (["bench", "convergence", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench", "convergence", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["bench", "kernels", "--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
    (["bench", "kernels", "--sizes", "1M,0"], "argument --sizes: sizes are element counts, multiples of 8"),
    (["bench", "kernels", "--sizes", "12"], "multiples of 8 (the packing's bytes): got 12"),
    (["bench", "simulator", "--repeat", "-1"], "argument --repeat: must be at least 1, got -1"),
    (["bench", "simulator", "--scale-step-ranks", "-1"], "must be at least 0, got -1"),  # 0: no such row
    (["bench", "train", "--ranks-per-host", "0"], "argument --ranks-per-host: must be at least 1, got 0"),
    (["train", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["train", "--ranks-per-host", "0"], "argument --ranks-per-host: must be at least 1, got 0"),
    (["demo", "--ranks", "1"], "argument --ranks: must be at least 2 (ranks that communicate), got 1"),
]


@pytest.mark.parametrize("argv,said", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_number_out_of_range_is_refused_by_the_parser(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_a_good_size_list_is_read_in_elements():
    from lioncub.apps.benchmarks.cli import parse_sizes

    assert parse_sizes("64K, 1M,4096") == [64 * 1024, 2**20, 4096]


def test_spawn_refuses_no_ranks_before_starting_any():
    with pytest.raises(ValueError, match="ranks must be at least 1, got 0"):
        spawn(print, 0)
