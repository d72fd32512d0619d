"""Every script in examples/ runs as a user runs it: copied into a folder of their own, started
by `geotrain local -n 2`, for a few steps; each peer finishes and says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GEOTRAIN = [sys.executable, "-c", "import sys, geotrain; sys.exit(geotrain._console())"]
DAEMON = ["sh", "-c", f'exec {sys.executable} -m geotrain.node node run --config '
          '"$GEOTRAIN_CONFIG"']  # fmt: skip

RUNS = {
    "char_lm.py": ([], ["--steps", "20", "--accumulate", "2"], "done: step 20"),
    "finetune_head.py": ([], ["--steps", "30"], "done: step 30"),
    "federated_site.py": ([], ["--max-steps", "10"], "done: step 10"),
    "site_torchrun.py": ([], ["--ranks", "2", "--steps", "20"], "done: step 20"),
    "custom_task.py": (["--set", "training.task=custom_task:sine_regression",
                        "--set", "training.max_steps=20"], None, '"node_stopped"'),
}


def test_every_example_is_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_an_example_runs_for_a_few_steps_in_a_local_swarm(tmp_path, name):
    if name == "federated_site.py":
        pytest.importorskip("opacus")
    shutil.copy(EXAMPLES / name, tmp_path / name)
    settings, args, done = RUNS[name]
    command = DAEMON if args is None else [sys.executable, name, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOTRAIN_")}
    proc = subprocess.run([*GEOTRAIN, "local", "-n", "2", *settings, "--", *command],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for i in (0, 1):
        assert any(line.startswith(f"[{i}] ") and done in line for line in out.splitlines()), (
            out[-4000:])
    assert "Traceback" not in out and "MisuseWarning" not in out, out[-4000:]
