"""What a long-running daemon spends of its machine: descriptors under a flood of idle
connections (slow: a real `geotrain node run` process)."""

from __future__ import annotations

import socket
import time

import pytest
from _swarm import LocalSwarm

pytestmark = pytest.mark.slow

SOFT_LIMIT = 256  # a small box's soft limit (1024 is common: the flood here is sized for 256)


def test_idle_connections_at_the_port_do_not_make_checkpoints_fail(tmp_path):
    """400 connections that never speak took all of a node's 256 descriptors for ~16 s (nng
    holds each until its handshake times out) and every checkpoint meanwhile failed (EMFILE).
    The node raises its soft limit at start and says the count on its status."""
    swarm = LocalSwarm(tmp_path, common={
        "training": {"task": "digits-mlp", "threads": 1, "eval_every": 10**6},
        "state": {"checkpoint_every": 5, "status_every_s": 0.2},
    })  # fmt: skip
    node = swarm.add("a", training={"wait_for_peers": 0})
    node.prefix = ("bash", "-c", f'ulimit -Sn {SOFT_LIMIT} && exec "$@"', "ulimit")
    try:
        swarm.start(node)
        swarm.wait_until(lambda: (node.status() or {}).get("step", 0) >= 20, 120, "training")
        host, port = node.address().removeprefix("tcp://").rsplit(":", 1)
        assert node.status()["open_files_limit"] > SOFT_LIMIT
        socks, most = [], 0
        try:
            for _ in range(400):
                socks.append(socket.create_connection((host, int(port)), timeout=5))
            step = node.status()["step"]
            deadline = time.monotonic() + 60
            # (until it trained 20 steps on AND its status said the flood: a fast node can take
            # 20 steps before its next status, written every 0.2 s, counts the connections)
            while ((node.status()["step"] < step + 20 or most <= SOFT_LIMIT)
                   and time.monotonic() < deadline):  # fmt: skip
                most = max(most, node.status()["open_files"] or 0)
                time.sleep(0.2)
        finally:
            for s in socks:
                s.close()
        log = node.log_text()
        assert most > SOFT_LIMIT, most  # the flood was held open while it trained ...
        assert node.status()["step"] >= step + 20, log[-3000:]
        assert '"checkpoint_failed"' not in log, log[-3000:]  # ... and no write failed
    finally:
        swarm.stop_all()
