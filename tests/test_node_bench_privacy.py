"""bench.privacy runs end to end and finds geotrain's epsilon equal to opacus' own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("opacus")


def test_the_accountant_bench_prints_equal_figures():
    out = subprocess.run(
        [sys.executable, "-m", "geotrain.node.bench.privacy", "--epsilon", "8", "--queries",
         "2", "--json"],
        capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["equal"] and result["steps_allowed"] > 5
    assert result["opacus_query_ms"] > 0 and result["geotrain_query_ms"] > 0
