"""The node's peak-memory figure is its own, whatever launched it."""

from __future__ import annotations

import subprocess
import sys

from geotrain.node._memory import peak_rss_mb

# A parent that holds 1.2 GB (touched), frees it, then starts a child that reports its peak:
# getrusage's ru_maxrss would hand the child the parent's 1.2 GB across fork and exec.
PARENT = """
import subprocess, sys
held = b"\\x01" * 1_200_000_000
del held
child = "from geotrain.node._memory import peak_rss_mb; print(peak_rss_mb())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                     check=True).stdout)
"""


def test_a_process_started_by_a_big_one_reports_its_own_peak():
    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    child_mb = float(out.stdout.strip())
    # the child imports torch and geotrain (about 300 MB), nowhere near its parent's 1.2 GB
    assert 5 < child_mb < 800, child_mb


def test_the_peak_grows_with_what_this_process_holds():
    before = peak_rss_mb()
    held = b"\x01" * 200_000_000
    assert peak_rss_mb() >= before and peak_rss_mb() > 200, (before, peak_rss_mb())
    del held
