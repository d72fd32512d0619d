"""bench.codecs runs end to end (two nodes, a few steps) and reads codec lists with commas."""

from __future__ import annotations

import json
import subprocess
import sys

from geotrain.node.bench.codecs import split_codecs


def test_a_codec_list_keeps_each_codecs_own_commas():
    assert split_codecs("none, randk:0.1,unscaled,int8,topk:0.1+int8,int8:block=64,stochastic") == [
        "none", "randk:0.1,unscaled", "int8", "topk:0.1+int8", "int8:block=64,stochastic"]


def test_two_nodes_train_with_a_fixed_codec_and_both_are_reported():
    out = subprocess.run(
        [sys.executable, "-m", "geotrain.node.bench.codecs", "--json", "--algorithms", "adpsgd",
         "--codecs", "topk:0.1", "--steps", "20", "--step-ms", "10"],
        capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["algorithm"], r["codec"]) == ("adpsgd", "topk:0.1")
    assert all(0 <= a <= 1 for a in r["accuracy"]) and len(r["accuracy"]) == 2
    assert min(r["exchanges_ok"]) > 0  # they did exchange
