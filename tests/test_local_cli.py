"""`geotrain local -n N -- python SCRIPT`: N real peers of a script of one's own, on loopback, in
a swarm of their own; `geotrain.join(model)` finds its config; Ctrl-C stops them all cleanly.
Real processes: signals and the CLI are the point. Also join's settings in code (in-process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import geotrain
from geotrain.node import Admission, Identity

GEOTRAIN = [sys.executable, "-c", "import sys, geotrain; sys.exit(geotrain._console())"]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import geotrain

    torch.manual_seed(int(os.environ["GEOTRAIN_LOCAL_INDEX"]))  # each its own start
    model = torch.nn.Linear(4, 1)
    steps = int(sys.argv[1])
    with geotrain.join(model, gossip={"exchange_every": 2}) as swarm:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.05))
        while not steps or swarm.step < steps:
            x = torch.randn(16, 4)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
            time.sleep(0.005)
        status = swarm.status()
        print("RESULT", json.dumps({"peer": swarm.peer_id, "step": swarm.step,
                                    "exchanges": status.exchanges_ok,
                                    "config": os.environ["GEOTRAIN_CONFIG"],
                                    "peers": os.environ["GEOTRAIN_LOCAL_PEERS"]}))
""")


def local(tmp_path: Path, n: int, steps: int) -> subprocess.Popen:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOTRAIN_")}
    return subprocess.Popen([*GEOTRAIN, "local", "-n", str(n), "--", sys.executable, "train.py",
                             str(steps)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_local_runs_n_peers_of_a_script_in_one_swarm_of_their_own(tmp_path):
    proc = local(tmp_path, 2, 300)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    results = {line[:3]: json.loads(line.split("RESULT ", 1)[1])
               for line in out.splitlines() if "RESULT " in line}  # fmt: skip
    assert sorted(results) == ["[0]", "[1]"], out  # each peer's output, its index in front
    assert results["[0]"]["peer"] != results["[1]"]["peer"]
    assert all(r["step"] == 300 and r["peers"] == "2" for r in results.values())
    root = tmp_path / "geotrain-local" / "train"  # the default: the script's, where it ran
    assert {Path(r["config"]).parent for r in results.values()} == {
        root / "peer-0", root / "peer-1"}
    for i in (0, 1):  # separate state dirs and logs
        assert (root / f"peer-{i}" / "state" / "checkpoints").is_dir()
        assert "node_stopped" in (root / f"peer-{i}" / "log.txt").read_text()
    assert "state_synced" in (root / "peer-1" / "log.txt").read_text()  # one swarm: 1 took 0's
    assert results["[0]"]["exchanges"] + results["[1]"]["exchanges"] >= 1, out


@pytest.mark.slow
def test_ctrl_c_stops_every_peer_cleanly(tmp_path):
    proc = local(tmp_path, 2, 0)  # trains until stopped
    root = tmp_path / "geotrain-local" / "train"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            steps = [_status_step(root / f"peer-{i}") for i in (0, 1)]
            if all(s >= 20 for s in steps):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the peers did not train: {proc.poll()} {proc.stdout.read()}")
        pids = [json.loads((root / f"peer-{i}" / "state" / "node.json").read_text())["pid"]
                for i in (0, 1)]  # fmt: skip
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends it
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    for i, pid in enumerate(pids):
        log = (root / f"peer-{i}" / "log.txt").read_text()
        assert "checkpoint_written" in log and "node_stopped" in log, log[-2000:]
        assert "peers_killed" not in out
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _status_step(folder: Path) -> int:
    try:
        return int(json.loads((folder / "state" / "status.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


def test_join_with_no_config_outside_geotrain_local_says_how_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("GEOTRAIN_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # (no identity.key here)
    with pytest.raises(geotrain.ConfigError, match=r"geotrain local -n 3 -- python"):
        geotrain.join(torch.nn.Linear(2, 1))


def test_join_takes_settings_in_code_over_a_file_and_overrides_over_both(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text('[identity]\nopen_swarm = true\n[gossip]\nexchange_every = 4\n'
                      'codec = "none"\n')
    with geotrain.join(config, torch.nn.Linear(2, 1), gossip={"exchange_every": 7,
                       "codec": "int8", "diloco": {"inner_steps": 9}},
                       state={"dir": tmp_path / "s"}, overrides=["gossip.codec=sign"],
                       identity=Identity.generate(),
                       admission=Admission.open_swarm("geotrain")) as swarm:  # fmt: skip
        gossip = swarm.node.config.gossip
        assert (gossip.exchange_every, gossip.codec) == (7, "sign")
        assert gossip.algorithm_settings["diloco"].inner_steps == 9
        assert swarm.node.config.state.dir == tmp_path / "s"
    with pytest.raises(geotrain.ConfigError, match=r"gossip.exchange_evry"):
        geotrain.join(config, torch.nn.Linear(2, 1), gossip={"exchange_evry": 7})
