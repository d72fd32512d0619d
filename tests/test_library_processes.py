"""Training scripts of their own (tests/examples/own_loop.py, through geotrain.join) in one swarm
with a daemon node: they reach the target together, one is SIGKILLed and resumes from its
checkpoint, a late one syncs the model. Real processes on loopback (slow)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from _swarm import LocalSwarm

from geotrain.node.state import StateDir

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent / "examples" / "own_loop.py"
COMMON = {
    "training": {"task": "digits-mlp", "threads": 1, "eval_every": 25, "num_shards": 4},
    "gossip": {"probe_interval_s": 0.5, "exchange_every": 2},
    "state": {"checkpoint_every": 100, "status_every_s": 0.25},
}


def own_loop(swarm, name: str, shard: int, *extra: str, **sections):
    """A node whose training is the example script's own loop (config written by the swarm)."""
    node = swarm.add(name, **sections)
    node.argv = [sys.executable, str(EXAMPLE), "--config", str(node.config), "--shard",
                 str(shard), "--shards", "4", *extra]  # fmt: skip
    node.start()
    return node


def metric(node) -> float:
    return (node.status() or {}).get("metric") or 0.0


def test_own_loops_and_a_daemon_train_together_resume_and_sync(tmp_path):
    swarm = LocalSwarm(tmp_path, common=COMMON)
    try:
        n0 = swarm.start(swarm.add("n0", training={"shard_index": 0, "wait_for_peers": 2}))
        boot = {"network": {"bootstrap": [n0.address()]}, "training": {"wait_for_peers": 2}}
        l1 = own_loop(swarm, "l1", 1, **boot)
        l2 = own_loop(swarm, "l2", 2, **boot)
        nodes = [n0, l1, l2]
        # together: each at 90% and each with exchanges behind it (which comes first depends on
        # the machine's speed: a fast one reaches 90% on its own shard within a few exchanges)
        swarm.wait_until(
            lambda: all(metric(n) >= 0.9 and (n.status() or {}).get("exchanges_ok", 0) >= 3
                        for n in nodes), 240, "all three at 90% with 3 exchanges each")  # fmt: skip
        assert l1.status()["task"] == "own loop" and l1.status()["metric_name"] == "accuracy"
        # l1 dies hard after its first checkpoint, and comes back from it (its log is the
        # script's own, not JSON: the files tell)
        checkpoints = StateDir(l1.state).checkpoints
        swarm.wait_until(lambda: list(checkpoints.glob("ckpt-*")), 120, "l1's checkpoint")
        l1.signal(signal.SIGKILL)
        l1.wait(30)
        saved = max(int(p.name[5:15]) for p in checkpoints.glob("ckpt-*"))
        l1.start()
        swarm.wait_until(lambda: (l1.status() or {}).get("pid") == l1.pid, 120, "l1 back")
        assert l1.status()["step"] >= saved  # its first status: on from the checkpoint, not 0
        # a fourth, late, fetches the model before its first step and is right there: 25 steps
        # of its own from the seed's model would give about 60%
        late = own_loop(swarm, "late", 3, "--steps", "25", network={"bootstrap": [n0.address()]})
        assert late.wait(180) == 0, late.log_text()
        assert late.status()["step"] == 25 and late.status()["metric"] >= 0.85, late.status()
    finally:
        swarm.stop_all()
