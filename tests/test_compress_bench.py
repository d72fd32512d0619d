"""The benchmark runs at a tiny size and prints the documented JSON shape (speed is not tested)."""

import json

import torch

from geotrain.compress import bench


def test_bench_json_has_every_codec_and_the_baselines(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (conftest sets 1: the bench's 1 would restore nothing visible)
    try:
        assert bench.main(["--json", "--sizes", "20000", "--repeat", "1", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 2  # the process setting is restored
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    codecs = [row["codec"] for row in result["rows"]]
    assert {"memcpy", "torch.topk", *bench.CODECS} <= set(codecs)
    keys = {"codec", "numel", "encode_gbps", "decode_gbps", "ratio", "rel_error"}
    for row in result["rows"]:
        assert keys <= set(row)
        assert row["numel"] == 20000 and row["encode_gbps"] > 0 and row["ratio"] > 0
    none = next(r for r in result["rows"] if r["codec"] == "none")
    assert none["rel_error"] == 0.0 and 0.99 < none["ratio"] <= 1.0
