"""The SimPy-style example (examples/simulate_ring_allreduce.py): what it prints is its .out file, and the times it
prints are the closed form its docstring states, T = 2(N-1)/N * S/B + 2(N-1) * L."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "simulate_ring_allreduce.py"
S, B, L = 64 * 2**20, 10e9 / 8, 50e-6  # the example's buffer (bytes), NIC rate (bytes/s) and latency (s)


@pytest.fixture(scope="module")
def printed() -> str:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_it_prints_its_expected_output(printed):
    assert printed == EXAMPLE.with_suffix(".out").read_text()


def test_its_times_are_the_closed_form(printed):
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+) ms\s+([\d.]+) ms\s+([\d.]+) MiB\s+(\d+)$", printed, flags=re.M)
    assert [int(r[0]) for r in rows] == [2, 4, 8, 16]
    for nodes, simulated, closed, sent, messages in rows:
        N = int(nodes)
        T = 2 * (N - 1) / N * S / B + 2 * (N - 1) * L
        assert float(simulated) == pytest.approx(T * 1e3, abs=1e-6)  # printed to the nanosecond
        assert float(closed) == pytest.approx(T * 1e3, abs=1e-6)
        assert float(sent) == 2 * (N - 1) / N * S / 2**20  # 2(N-1)/N * S bytes per rank
        assert int(messages) == N * 2 * (N - 1)  # 2(N-1) messages per rank
