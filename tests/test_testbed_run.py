"""The testbed end to end: real nodes in namespaces behind the userspace emulator, faults, the DDP
baseline, cleanup, and `testbed report` re-rendering from the files (issue 8's CI tests)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from geotrain.testbed._cli import cmd_report
from geotrain.testbed._namespaces import list_devices, list_namespaces
from geotrain.testbed._netem import choose_backend
from geotrain.testbed._run import RunOptions, run_testbed
from geotrain.testbed._scenario import scenario_from_dict

SMALL = {
    "name": "small",
    "description": "4 peers, 2 regions, short links; peer 3 is killed and restarted",
    "task": "digits-mlp",
    "duration_s": 40,
    "regions": [{"name": "east", "peers": 2}, {"name": "west", "peers": 2}],
    "links": {
        "inside": {"delay_ms": 2, "rate_mbit": 500},
        "between": [{"regions": ["east", "west"], "delay_ms": 10, "rate_mbit": 100}],
    },
    "stragglers": [{"peer": 2, "slowdown": 2.0}],
    "faults": [
        {"at_s": 0, "action": "kill", "peer": 3},
        {"at_s": 1, "action": "restart", "peer": 3},
    ],
}
SYSTEM_KEYS = {
    "system", "algorithm", "time_to_target_s", "final_metric", "bytes_sent_total",
    "steps_per_s_median", "steps_per_s_by_peer",
}  # fmt: skip
LINK_KEYS = {"src", "dst", "spec_rtt_ms", "measured_rtt_ms", "spec_mbit", "measured_mbit"}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _userspace_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root (network namespaces)")
    choice = choose_backend("auto")
    if choice.backend == "none":
        pytest.skip(choice.reason)


@pytest.mark.slow
def test_small_scenario_reaches_target_survives_restart_and_leaves_nothing(tmp_path: Path):
    _userspace_or_skip()
    out = tmp_path / "run"
    lines: list[str] = []
    options = RunOptions(
        scenario=scenario_from_dict(SMALL), out=out, target=0.95, emulation="userspace",
        baseline="ddp", progress_every_s=2.0,
    )  # fmt: skip
    summary = run_testbed(options, echo=lines.append)
    log = "\n".join(lines)
    prefix = next(line.split()[1].split("p00")[0] for line in lines if "namespaces:" in line)

    # nothing left behind: no namespace, device or process of this run
    assert list_namespaces(prefix) == [] and list_devices(prefix) == [], log
    assert _processes_mentioning(str(out)) == [], log

    geotrain, ddp = summary["systems"]
    assert geotrain["system"] == "geotrain" and ddp["system"] == "ddp"
    assert set(geotrain) >= SYSTEM_KEYS and set(ddp) >= SYSTEM_KEYS
    assert summary["emulation"] == "userspace" and summary["peers"] == 4
    assert summary["target"] == {"metric": "accuracy", "value": 0.95}
    # geotrain got there with every peer, the restarted one included
    assert geotrain["time_to_target_s"] is not None, log
    restarted = [json.loads(line) for line in
                 (out / "geotrain" / "peer-03" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["metric"] is not None and r["metric"] >= 0.95 for r in restarted), log
    faults = [(f["system"], f["fault"], f["applied"]) for f in summary["faults"]]
    assert ("geotrain", "t=0s kill peer 3", True) in faults, log
    assert ("geotrain", "t=1s restart peer 3", True) in faults, log
    assert ("ddp", "t=0s kill peer 3", False) in faults, log  # said, not hidden
    restarted_log = (out / "geotrain" / "peer-03.log").read_text()
    assert restarted_log.count('"node_started"') == 2
    # the peer's own log says where the testbed killed and restarted it
    said = [json.loads(line)["event"] for line in restarted_log.splitlines()
            if '"by": "launcher"' in line]  # fmt: skip
    assert said == ["testbed_killed", "testbed_restarted"], said
    # the DDP baseline ran in the same namespaces: all ranks stepped, bytes crossed the emulator
    assert all(r is not None and r > 0 for r in ddp["steps_per_s_by_peer"]), log
    assert ddp["bytes_sent_total"] > 0 and geotrain["bytes_sent_total"] > 0
    assert "emulator" in geotrain["bytes_source"]
    links = {(link["src"], link["dst"]): link for link in summary["links"]}
    assert set(links) == {("east", "east"), ("west", "west"), ("east", "west"), ("west", "east")}
    assert all(set(link) >= LINK_KEYS for link in links.values())
    assert links[("east", "west")]["measured_rtt_ms"] >= 20.0  # 2 x 10 ms one way
    for name in ("metric.png", "bytes.png", "consensus.png", "scenario.json"):
        assert (out / name).stat().st_size > 0
    assert (out / "geotrain" / "peer-00" / "metrics.jsonl").exists()
    assert (out / "ddp" / "peer-00.jsonl").exists()

    # `testbed report` re-renders everything from the directory alone
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for name in ("summary.json", "metric.png", "bytes.png", "consensus.png"):
        (copy / name).unlink()
    assert cmd_report(argparse.Namespace(dir=copy)) == 0
    assert json.loads((copy / "summary.json").read_text()) == summary
    assert (copy / "metric.png").stat().st_size > 0
