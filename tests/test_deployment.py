"""The tutorial "A swarm of three machines" (docs/tutorials/swarm.md), run as written: three
machines, each a network namespace with its own address on one bridge (not the testbed's
launcher), the operator's commands beside them; only PEER_ID_n is pasted in from what machine
n's `node init` printed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.testbed._namespaces import NamespaceSet
from geotrain.testbed._netem import apply_commands, topology_commands

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the machines are network namespaces: root"),
]

TUTORIAL = (Path(__file__).resolve().parent.parent / "docs" / "tutorials" / "swarm.md").read_text()


def readme_steps() -> list[tuple[int | None, str]]:
    """(machine number or None for the operator, command) in the tutorial's order."""
    section = TUTORIAL
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    steps, machine = [], None
    for line in block.splitlines():
        if line.startswith("#"):
            found = re.match(r"# machine (\d)", line)
            machine = int(found.group(1)) if found else None
            assert found or line.startswith("# operator"), line
        elif line.strip():
            steps.append((machine, line.strip()))
    return steps


def readme_renewal() -> str:
    """The section's certificate renewal command (the bash block with --renew)."""
    section = TUTORIAL
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    (renewal,) = [b.strip() for b in blocks if "--renew" in b]
    return renewal


def test_the_readme_deployment_runs_as_written(tmp_path):
    steps = readme_steps()
    assert [m for m, c in steps if c.startswith("geotrain node run")] == [1, 2, 3]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    peer_ids: dict[int, str] = {}
    nodes: dict[int, subprocess.Popen] = {}
    with NamespaceSet(3) as machines:
        apply_commands(topology_commands(machines))
        assert [str(m.address) for m in machines] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]

        def run(machine: int | None, command: str) -> subprocess.CompletedProcess:
            argv = ["bash", "-c", command]
            if machine is not None:
                argv = machines[machine - 1].exec_argv(argv)
            return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=120)  # fmt: skip

        try:
            for machine, command in steps:
                command = re.sub(r"PEER_ID_(\d)", lambda m: peer_ids[int(m.group(1))], command)
                if command.startswith("geotrain node run"):
                    log = open(tmp_path / f"machine-{machine}.log", "w")  # noqa: SIM115
                    nodes[machine] = machines.popen(machine - 1, ["bash", "-c", f"exec {command}"],
                                                    cwd=tmp_path, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT)  # fmt: skip
                    continue
                if command.startswith("geotrain status"):
                    wait_until_trained(tmp_path, nodes)
                done = run(machine, command)
                assert done.returncode == 0, (command, done.stdout, done.stderr)
                if command.startswith("geotrain node init"):
                    peer_ids[machine] = re.search(r"^peer_id (gt\w+)$", done.stdout, re.M)[1]
                if command.startswith("geotrain status"):
                    # every status shows the node and both other machines, alive
                    others = {peer_ids[n][:12] for n in (1, 2, 3)} - {
                        re.search(r"^node\s+(gt\w+)", done.stdout, re.M)[1][:12]}
                    rows = [line for line in done.stdout.splitlines() if line[:12] in others]
                    assert len(rows) == 2 and all(" alive " in r for r in rows), done.stdout
            # the operator renews machine 1's certificate as the tutorial says: its node reloads it
            renewal = re.sub(r"PEER_ID_(\d)", lambda m: peer_ids[int(m.group(1))], readme_renewal())
            done = run(None, renewal)
            assert done.returncode == 0, (renewal, done.stdout, done.stderr)
            deadline = time.monotonic() + 30
            while "certificate_renewed" not in (tmp_path / "machine-1.log").read_text():
                assert time.monotonic() < deadline, "machine 1 did not pick up its renewed file"
                time.sleep(0.5)
            for proc in nodes.values():  # SIGINT, as Ctrl-C on each machine
                proc.send_signal(signal.SIGINT)
            for machine, proc in nodes.items():
                assert proc.wait(timeout=60) == 0, (tmp_path / f"machine-{machine}.log").read_text()
        finally:
            for proc in nodes.values():
                if proc.poll() is None:
                    proc.kill()
    for machine in (1, 2, 3):  # each stopped cleanly: a final checkpoint
        assert list((tmp_path / f"machine-{machine}" / "state" / "checkpoints").glob("ckpt-*"))


def wait_until_trained(root: Path, nodes: dict[int, subprocess.Popen], limit_s: float = 180):
    """Until every machine's node exchanged with the others and sees both alive."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for machine, proc in nodes.items():
            assert proc.poll() is None, (root / f"machine-{machine}.log").read_text()[-3000:]
        statuses = []
        for machine in nodes:
            try:
                status = root / f"machine-{machine}" / "state" / "status.json"
                statuses.append(json.loads(status.read_text()))
            except (OSError, json.JSONDecodeError):
                break
        if len(statuses) == 3 and all(
            s["exchanges_ok"] >= 3 and sum(p["state"] == "alive" for p in s["peers"]) == 2
            for s in statuses
        ):
            return
        time.sleep(0.5)
    pytest.fail("the three machines did not train together within "
                f"{limit_s} s: {(root / 'machine-1.log').read_text()[-3000:]}")  # fmt: skip
