"""The testbed says why a run cannot go on: a process that ended with a failure is reported with
its log's last line (once), and a peer that fails before training starts stops the run at once
instead of after the start-up timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.node import ManagedProcess
from geotrain.testbed._peers import Peers, TestbedError
from geotrain.testbed._run import RunOptions, _failed_exits, run_testbed
from geotrain.testbed._scenario import scenario_from_dict


def _proc(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    p = ManagedProcess([sys.executable, "-c", code], tmp_path / f"{name}.log")
    p.start()
    return p


def test_a_failed_process_is_reported_once_with_its_last_line(tmp_path):
    peers = Peers()
    peers.add(_proc(tmp_path, "ok", "pass"))
    peers.add(_proc(tmp_path, "bad", "print('step 1'); raise SystemExit('my task broke')"))
    killed = peers.add(_proc(tmp_path, "killed", "import time; time.sleep(60)"))
    killed.close()  # SIGKILL, as the fault timeline kills
    for p in peers.procs:
        p.wait(30)
    said, told = [], set()
    first = _failed_exits("geotrain", peers, told, said.append)
    again = _failed_exits("geotrain", peers, told, said.append)
    assert len(first) == 1 and again == [] and len(said) == 1
    assert first[0].startswith("peer 1 exited with status 1: my task broke")
    assert said[0].startswith("geotrain: peer 1 exited")


@pytest.mark.slow
def test_a_task_that_fails_stops_the_run_at_once_saying_why(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent)  # (peers find tests_tasks from here)
    scenario = scenario_from_dict({
        "name": "broken", "task": "tests_tasks:broken_loss", "duration_s": 30,
        "regions": [{"name": "here", "peers": 2}],
        "links": {"inside": {"delay_ms": 1, "rate_mbit": 1000}},
    })  # fmt: skip
    options = RunOptions(scenario=scenario, out=tmp_path / "run", target=0.9, emulation="none",
                         baseline="none", link_check=False)  # fmt: skip
    started, lines = time.monotonic(), []
    with pytest.raises(TestbedError, match="before the run had seen any peer take a step") as info:
        run_testbed(options, echo=lines.append)
    assert "exited with status" in str(info.value)
    assert "deliberate failure inside my loss" in "\n".join(lines) + str(info.value)
    assert time.monotonic() - started < 150  # not the 180 s start-up timeout
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True)
    assert leftover.stdout.strip() == b""  # every peer process is gone
