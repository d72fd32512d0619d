"""`geotrain testbed ...` through the real `geotrain` command: registration, bad input refused
before anything starts, and SIGTERM in the middle of a run leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node._cli import main
from testbed._namespaces import list_devices, list_namespaces

TINY = """
name = "tiny"
duration_s = 120
[[regions]]
name = "a"
peers = 2
[links.inside]
delay_ms = 5
rate_mbit = 100
"""


def test_testbed_is_a_geotrain_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["testbed", "run", "--help"])
    assert info.value.code == 0
    assert "--scenario" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--scenario", "mars"], "scenario.name = 'mars'"),
        (["--peers", "1"], "scenario.peers = 1"),
        (["--task", "no-such-task"], "no-such-task"),
        (["--node-set", "policy"], "--node-set 'policy'"),
    ],
)
def test_bad_input_exits_2_naming_it_before_anything_starts(argv, needle, capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["testbed", "run", "--out", str(out), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_report_of_a_directory_without_a_run_exits_2(tmp_path, capsys):
    assert main(["testbed", "report", str(tmp_path)]) == 2
    assert "run.json" in capsys.readouterr().err


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_sigterm_mid_run_stops_cleanly_and_leaves_nothing(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root (network namespaces)")
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "node", "testbed", "run", "--scenario", str(scenario),
           "--baseline", "none", "--target", "1.01", "--no-link-check", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, prefix = [], None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("namespaces:"):
                prefix = line.split()[1].split("p00")[0]
            if "training started" in line or time.monotonic() > deadline:
                break
        assert prefix is not None and "training started" in lines[-1], "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + rest
    assert proc.returncode == 130, log
    assert list_namespaces(prefix) == [] and list_devices(prefix) == [], log
    assert _processes_mentioning(str(out)) == [], log
    # the nodes were stopped, not just killed: they had time to say so
    node_log = (out / "geotrain" / "peer-00.log").read_text()
    assert "stop_requested" in node_log, node_log[-2000:]
    assert json.loads((out / "scenario.json").read_text())["name"] == "tiny"
