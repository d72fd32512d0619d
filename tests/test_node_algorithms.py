"""The non-default algorithms in the daemon: real `geotrain node run` processes (slow).

Each runs 4 peers on digits-mlp over loopback until all are at 90% test accuracy.
"""

from __future__ import annotations

import pytest
from _swarm import LocalSwarm
from test_node import COMMON, reached, start_swarm, stop

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm(tmp_path):
    s = LocalSwarm(tmp_path, common=COMMON)
    yield s
    s.stop_all()


def with_gossip(swarm: LocalSwarm, **gossip) -> None:
    swarm.common = {**COMMON, "gossip": {**COMMON["gossip"], **gossip}}


def run_to_accuracy(swarm: LocalSwarm, special=None, **gossip) -> list[dict]:
    with_gossip(swarm, **gossip)
    nodes = start_swarm(swarm, 4, special=special, max_steps=0)
    swarm.wait_until(lambda: reached(nodes, 0.90), 150, f"{gossip}: all four at 90%")
    stop(swarm, nodes)
    finals = [n.status() for n in nodes]
    assert all(s["algorithm"] == gossip["algorithm"] for s in finals)
    # every algorithm reports its exchanges, rejections and the codec used per peer
    assert all(s["exchanges_ok"] > 0 and s["rejected_updates"] == 0 for s in finals), finals
    used = [p for s in finals for p in s["peers"] if p["exchanges_ok"] > 0]
    assert used and all(p["codec"] is not None for p in used), finals
    return finals


def test_dpsgd_rounds_reach_accuracy(swarm):
    finals = run_to_accuracy(swarm, algorithm="dpsgd")
    stats = [s["algorithm_stats"] for s in finals]
    assert all(st["rounds"] >= 10 for st in stats), stats
    # with four equal peers on loopback nearly every round hears from all three neighbours
    assert sum(st["full_rounds"] for st in stats) >= 0.8 * sum(st["rounds"] for st in stats)


def test_choco_with_topk_reaches_accuracy_and_a_restart_with_another_algorithm_is_refused(swarm):
    finals = run_to_accuracy(swarm, algorithm="choco", codec="topk:0.01")
    assert sum(s["exchanges_ok"] for s in finals) >= 8, finals
    used = [p for s in finals for p in s["peers"] if p["exchanges_ok"] > 0]
    assert used and all(p["codec"] == "topk:0.01" for p in used)
    # one of them restarted with another algorithm on its choco checkpoint: a clear error
    # (one swarm for both: a solo node started only to write that checkpoint took 20 s)
    node = swarm.nodes[0]
    assert node.params()  # a checkpoint exists
    swarm.start(node, "gossip.algorithm=diloco", "gossip.codec=int8", "training.wait_for_peers=0")
    node.proc.wait(120)
    assert node.proc.returncode == 2
    assert "algorithm 'choco'" in node.log_text() and "'diloco'" in node.log_text()


def test_diloco_reaches_accuracy_with_outer_steps(swarm):
    finals = run_to_accuracy(swarm, algorithm="diloco", codec="int8",
                             diloco={"inner_steps": 10, "consensus_every": 1})  # fmt: skip
    stats = [s["algorithm_stats"] for s in finals]
    assert all(st["outer_steps"] >= 2 for st in stats), stats
    assert sum(st["peer_deltas_used"] for st in stats) >= 6, stats
    assert sum(st["consensus_mixes"] for st in stats) >= 4, stats  # outer parameters swapped


def test_selsync_reaches_accuracy_and_reports_how_often_it_communicated(swarm):
    finals = run_to_accuracy(
        swarm, algorithm="selsync", exchange_every=1, selsync={"threshold": 0.02}
    )
    stats = [s["algorithm_stats"] for s in finals]
    for st, s in zip(stats, finals, strict=True):
        assert st["steps"] == s["step"]
        assert 0 < st["communicated_steps"] < st["steps"]  # some steps, not all
        assert st["comm_fraction"] == pytest.approx(st["communicated_steps"] / st["steps"])
