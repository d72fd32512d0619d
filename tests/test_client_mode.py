"""Client-mode peers (network.reachable = false, behind NAT): real `geotrain node run` processes
on loopback (slow). A client dials the reachable peers, starts every exchange itself, and nobody
ever dials it; with reachable peers only the swarm is as before (tests/test_node*.py)."""

from __future__ import annotations

import json

import pytest
from _swarm import LocalSwarm
from test_node import COMMON, reached, start_swarm, stop

from geotrain.node.state import StateDir
from geotrain.testbed._peers import last_json_line

pytestmark = pytest.mark.slow

CLIENT = {"network": {"reachable": False}}


@pytest.fixture
def swarm(tmp_path):
    s = LocalSwarm(tmp_path, common={**COMMON, "training": {**COMMON["training"], "num_shards": 3}})
    yield s
    s.stop_all()


def dials(node) -> set[str]:
    """Addresses `node` dialled (its outbound handshakes, successful or not)."""
    return {
        e["address"] for e in node.log_events()
        if e.get("event") in ("handshake_ok", "handshake_failed")
        and e.get("direction") == "outbound" and "address" in e
    }  # fmt: skip


@pytest.mark.parametrize("algorithm", ["adpsgd", "dpsgd"])
def test_client_trains_with_two_reachable_peers_and_is_never_dialled(swarm, algorithm):
    swarm.common = {**swarm.common, "gossip": {**COMMON["gossip"], "algorithm": algorithm}}
    nodes = start_swarm(swarm, 3, special={2: CLIENT}, max_steps=0)
    reachable, client = nodes[:2], nodes[2]
    swarm.wait_until(lambda: reached(nodes, 0.90), 150, f"{algorithm}: all three at 90%")
    # the reachable peers know the client as a live member (it dialled them) ...
    swarm.wait_until(
        lambda: all((last_json_line(StateDir(n.state).metrics) or {}).get("live_peers") == 2
                    for n in nodes), 30, "every node counts two live peers",
    )  # fmt: skip
    stop(swarm, nodes)
    finals = [n.status() for n in nodes]
    assert finals[2]["exchanges_ok"] > 0, finals[2]
    # ... exchanged with it (over the connections it opened) ...
    client_id = json.loads(StateDir(client.state).node_info.read_text())["peer_id"]
    served = [p for s in finals[:2] for p in s["peers"] if p["peer"] == client_id[:12]]
    # (dpsgd: the client's model came with its round requests and went into their rounds, so
    # both served it; adpsgd: the client picks one partner per exchange, and a fast run can reach
    # the target before it picked the second)
    assert len(served) == 2, finals[:2]
    if algorithm == "dpsgd":
        assert all(p["exchanges_ok"] > 0 for p in served), finals[:2]
    else:
        assert sum(p["exchanges_ok"] for p in served) > 0, finals[:2]
    # ... and never dialled it: neither its loopback listener nor its client address
    client_address = client.address()
    for node in reachable:
        dialled = dials(node)
        assert dialled and client_address not in dialled, dialled
        assert not any(a.startswith("client://") for a in dialled), dialled
    # the client dialled the reachable peers itself
    assert {n.address() for n in reachable} <= dials(client)
