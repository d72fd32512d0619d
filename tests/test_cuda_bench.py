"""`python -m geotrain.node.bench.gpu` runs to the end where there is no GPU, says so, and
measures the CPU path (on a CUDA box it measures the device's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.slow
def test_the_gpu_bench_runs_on_the_cpu_and_says_there_is_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the bench measures it (minutes), not the CPU path")
    out = subprocess.run(
        [sys.executable, "-m", "geotrain.node.bench.gpu", "--millions", "0.25", "--size", "1m",
         "--steps", "4", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "no CUDA device" in r["device"]
    assert [s["precision"] for s in r["steps"]] == ["fp32", "fp32"]  # auto is fp32 on a CPU
    assert all(s["step_s"] > 0 for s in r["steps"])
    assert r["exchange"]["averaged"] and r["exchange"]["gbps"] > 0
    assert r["exchange"]["staging"] == [None, None]  # the model is in host memory
    assert r["overhead"]["ratio"] > 0 and r["overhead"]["exchanges"] >= 1
    assert r["checks"] == {"models averaged": True}
