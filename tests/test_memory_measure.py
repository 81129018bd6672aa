"""``benchmarks._memory.run_measured``: the peak RSS of a command, not of the process that
started it (on Linux a child exec'd straight from a large process reports that process's
peak; the CLI memory tests ran in pytest workers that had held several GiB)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks._memory import run_measured

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux peak-RSS accounting")

_ALLOC = "import sys; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'1' * len(b[::4096])"


def test_a_direct_child_reports_its_parents_peak_and_run_measured_does_not():
    buf = bytearray(1536 * 2**20)
    buf[::4096] = b"1" * len(buf[::4096])  # touched: resident
    del buf
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    direct = os.wait4(proc.pid, 0)[2].ru_maxrss / 2**20
    assert direct >= 1.4  # the kernel fact the helper exists for
    measured = run_measured([sys.executable, "-c", "pass"])
    assert measured.returncode == 0
    assert measured.peak_gib < 0.2, measured


def test_run_measured_sees_the_commands_own_peak_output_and_exit_code():
    measured = run_measured([sys.executable, "-c", _ALLOC + "; print('done'); sys.exit(3)", "512"])
    assert measured.returncode == 3 and measured.stdout.strip() == "done"
    assert 0.5 <= measured.peak_gib < 0.7, measured
    assert measured.seconds > 0


def test_run_measured_kills_the_command_on_timeout():
    with pytest.raises(subprocess.TimeoutExpired):
        run_measured([sys.executable, "-c", "import time; time.sleep(60)"], timeout=2)
