"""`python -m research lab validate` (research/calibration_validation.py): guarded as the lab's commands are, and
its files checked before the 8 minutes of measuring start."""

import subprocess
import sys
import time

import pytest

from lioncub.apps.lab import missing_privileges, netns
from research.cli import main

WHY = missing_privileges()


def test_without_privileges_validate_fails_at_once(monkeypatch, capsys):
    def refuse():  # as the lab's check says it without root (tests/apps/test_lab_launch.py runs it for real)
        raise netns.LabPermissionError("the lab needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")

    monkeypatch.setattr(netns, "require_privileges", refuse)
    assert main(["lab", "validate", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "needs root" in err and "CAP_NET_ADMIN" in err


@pytest.mark.root
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_validate_checks_the_files_it_will_write_before_it_starts():
    for flag in ("--output", "--json", "--save-profile"):
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "research", "lab", "validate", flag, "/nonexistent/dir/v.out"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and time.monotonic() - start < 30, (flag, out.stderr)
        assert out.stderr == (f"python -m research: error: {flag} /nonexistent/dir/v.out: no such directory "
                              "/nonexistent/dir\n")
