"""bench.checkpoints runs end to end: two daemon nodes exchange beside periodic checkpoints."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from geotrain.node.bench.checkpoints import run

pytestmark = pytest.mark.slow  # (two real node processes)


def test_the_run_reports_exchanges_checkpoints_and_memory_and_leaves_nothing():
    before = set(Path(tempfile.gettempdir()).glob("bench_checkpoints.*"))
    result = run("adpsgd", "auto", millions=1.0, duration_s=4.0, checkpoint_every=5,
                 exchange_every=2)  # fmt: skip
    assert result["exit_codes"] == [0, 0]
    for node in result["nodes"].values():
        assert node["steps"] >= 5 and node["exchanges_ok"] >= 1, node
        assert node["checkpoint_seconds"] and all(s >= 0 for s in node["checkpoint_seconds"])
        assert 0 < node["peak_rss_mb"] and 0 < node["memory_estimate_mb"]
    # the nodes' folders (1.6 GB of checkpoints a node at the default 10^8) are gone
    assert set(Path(tempfile.gettempdir()).glob("bench_checkpoints.*")) == before
