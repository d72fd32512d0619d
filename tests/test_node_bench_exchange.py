"""bench.exchange runs end to end on a tiny model: the exchange figures and the state-sync mode
(whose joiner must end with the server's model), as its --json prints them."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "geotrain.node.bench.exchange", "--json", *args],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_state_sync_mode_fetches_the_whole_model():
    r = bench("--state-sync", "--millions", "0.25")
    assert r["fetched"] and r["equal"]
    assert r["bytes"] >= r["model_mb"] * 1e6  # the whole model came over the wire
    assert r["peak_mb"] >= r["rss_before_mb"] > 0


def test_the_state_sync_mode_with_three_donors_takes_their_median():
    r = bench("--state-sync", "--donors", "3", "--millions", "0.25")
    assert r["fetched"] and r["equal"] and r["donors"] == 3  # the middle server's model
    assert r["bytes"] >= 3 * r["model_mb"] * 1e6  # every chunk from each of the three


def test_the_exchange_mode_times_each_exchange_against_raw_pynng():
    r = bench("--millions", "0.25", "--repeats", "2")
    assert len(r["exchange_s"]) == len(r["raw_pynng_s"]) == 2
    assert r["bytes_per_exchange"] >= 2 * 4 * 500**2  # the model both ways
    assert r["ratio"] > 0
