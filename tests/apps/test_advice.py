"""`lioncub advise`: autotune's recommendation over a grid of link speeds and compute times (README's table)."""

import subprocess
import sys

import pytest

from lioncub.apps import advice
from lioncub.cli import build_parser


def _args(*extra):
    return build_parser("advise").parse_args(["advise", *extra])


def test_one_row_per_cell_and_the_recommendation():
    args = _args("--markdown", "--bandwidth", "1Gbit,100Gbit", "--compute-seconds", "0.05")
    out = advice.render(args)
    caption, table = out.split("\n\n")
    assert caption.startswith("Forecast by `lioncub advise --markdown`: 124M parameters on 16 ranks")
    lines = table.splitlines()
    assert lines[0].startswith("| link | compute per step | method |") and len(lines) == 2 + 2
    assert lines[2].startswith("| 1 Gbit/s | 50 ms | `vote-1bit` |")  # compression pays on a slow link


def test_the_plain_table_and_units():
    out = advice.render(_args("--bandwidth", "10Gbit", "--compute-seconds", "1"))
    assert out.splitlines()[2].startswith("link") and "10 Gbit/s  1 s" in out
    assert advice.parse_count("124M") == 124_000_000 and advice.parse_count("1.3B") == 1_300_000_000


@pytest.mark.parametrize("flag, value", [("--compute-seconds", "0"), ("--compute-seconds", "fast"),
                                         ("--params", "0")])
def test_bad_input_is_a_clear_error(flag, value):
    with pytest.raises(ValueError, match=flag):
        advice.render(_args(flag, value, "--bandwidth", "1Gbit"))


def test_imports_no_torch():
    code = ("import sys; from lioncub.cli import main; "
            "main(['advise', '--bandwidth', '1Gbit', '--compute-seconds', '0.05']); "
            "assert 'torch' not in sys.modules, 'lioncub advise imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
