"""bench.loop runs end to end with the language model (--model gpt): both rates measured, the
gpt task's 1m decoder stepped on token batches; a bad --batch is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geotrain.node.bench.loop", "--json", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_the_gpt_loop_is_measured_bare_and_wrapped():
    out = bench("--model", "gpt", "--batch", "1", "--steps", "8", "--repeats", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["model"], r["batch"], r["steps"]) == ("gpt", 1, 8)
    assert r["parameters"] == 1_067_776  # the gpt task's 1m size at context 128
    assert len(r["bare_steps_per_s"]) == len(r["wrapped_steps_per_s"]) == 1
    assert min(r["bare_steps_per_s"] + r["wrapped_steps_per_s"]) > 0
    assert r["ratio"] == pytest.approx(r["wrapped_steps_per_s"][0] / r["bare_steps_per_s"][0])
    # the peer switched to bare steps and back (SIGUSR1/2) and was alive until told to leave
    assert r["peer_exit"] == 0


def test_a_batch_below_one_is_refused():
    out = bench("--batch", "0")
    assert out.returncode == 2 and "--batch 0: expected at least 1" in out.stderr
