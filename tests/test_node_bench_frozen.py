"""bench.frozen runs end to end: a frozen base stays out of the exchanges, a trained one not."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_frozen_run_sends_the_head_only_and_keeps_the_base(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "geotrain.node.bench.frozen", "--base-millions", "17",
         "--steps", "8", "--json"],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    # the nodes' checkpoints (0.4 GB each at the default 10^8) are gone with the run
    assert not any(p.name.startswith("bench_frozen.") for p in tmp_path.iterdir())
    frozen, trained = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert frozen["frozen"] and not trained["frozen"]
    assert frozen["base_unchanged"] and not trained["base_unchanged"]
    assert min(frozen["exchanges_ok"]) > 0 and min(trained["exchanges_ok"]) > 0
    # (what state sync moved at b's join is counted apart: not an exchange's bytes)
    assert all(sum(r["exchange_out_mb"]) < sum(r["bytes_out_mb"]) for r in (frozen, trained))
    per = [sum(r["exchange_out_mb"]) / sum(r["exchanges_ok"]) for r in (frozen, trained)]
    # the head is 1.05M of the trained run's 17.8M parameters
    assert per[0] < 4.2 * 2 and per[1] > 5 * per[0], per
