"""LocalSwarm's fork server: a forked node is a process of its own, as a fresh one would be (its
exit status, its signals, its log, its environment), and none outlives the server's client."""

from __future__ import annotations

import os
import signal
import time

import pytest

from geotrain.node.testing import ForkedProcess, ForkServer, LocalSwarm

pytestmark = pytest.mark.slow

COMMON = {"training": {"task": "digits-mlp", "threads": 1, "eval_every": 10**6,
                       "wait_for_peers": 0},
          "state": {"status_every_s": 0.2}}  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_forked_node_trains_stops_on_sigterm_and_says_so_in_its_log(tmp_path):
    swarm = LocalSwarm(tmp_path, common=COMMON, fork_server=True)
    node = swarm.start(swarm.add("a"))
    try:
        assert isinstance(node.proc, ForkedProcess)
        assert node.proc.pid != os.getpid() and os.getpgid(node.proc.pid) == node.proc.pid
        node.address()  # its node.json names the forked pid
        swarm.wait_until(lambda: (node.status() or {}).get("step", 0) >= 10, 60, "training")
        assert node.proc.poll() is None
        node.signal(signal.SIGTERM)
        assert node.wait(60) == 0  # a clean stop, as a fresh process's
        assert '"node_stopped"' in node.log_text()  # it stopped the way a node stops, logged
    finally:
        swarm.stop_all()


def test_a_bad_config_exits_non_zero_with_its_error_and_a_kill_is_minus_nine(tmp_path):
    swarm = LocalSwarm(tmp_path, common=COMMON, fork_server=True)
    bad = swarm.add("bad", training={"task": "no-such-task"})
    swarm.start(bad)
    assert bad.wait(60) != 0
    assert "no-such-task" in bad.log_text()
    node = swarm.start(swarm.add("b"))
    node.address()
    node.proc.send_signal(signal.SIGKILL)
    assert node.wait(30) == -signal.SIGKILL


def test_the_child_gets_the_requested_environment_and_its_own_random_seed(tmp_path):
    # the environment, cwd and PYTHONPATH a process is started with are its own, whatever the
    # server imported with; siblings' global generators differ, as fresh processes' would
    (tmp_path / "probe_mod.py").write_text(
        "import os, sys, numpy, torch\n"
        "print(os.environ['GEOTRAIN_PROBE'], os.getcwd(), sys.argv[1:],"
        " numpy.random.rand(), torch.rand(1).item())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GEOTRAIN_PROBE": "42"}
    server = ForkServer(env)
    try:
        outs = []
        for name in ("x", "y"):
            log = tmp_path / f"{name}.log"
            proc = server.spawn(["a", "b"], str(log), cwd=str(tmp_path), module="probe_mod")
            assert proc.wait(30) == 0, log.read_text()
            outs.append(log.read_text().split())
        assert outs[0][:4] == ["42", str(tmp_path), "['a',", "'b']"]
        assert outs[0][4] != outs[1][4] and outs[0][5] != outs[1][5]  # numpy's, torch's
        version = tmp_path / "version.log"
        assert server.spawn(["--version"], str(version)).wait(30) == 0
        assert version.read_text().strip()
    finally:
        server.close()


def test_closing_the_client_kills_every_node_it_forked(tmp_path):
    swarm = LocalSwarm(tmp_path, common=COMMON)
    node = swarm.add("a")
    server = ForkServer(swarm._env())
    proc = server.spawn(node.argv[3:], str(node.log))
    pid = proc.pid
    deadline = time.monotonic() + 60
    while not (node.status() or {}).get("step") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pid)
    server.close()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
