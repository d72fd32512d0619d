"""Every algorithm with a client-mode node: two reachable nodes and one client in one trio program
(`open_node`, real transport on loopback). The client exchanges with both (it starts every
exchange), they exchange with it, and neither ever dials it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import geotrain
from geotrain.node import Identity, config_from_toml
from geotrain.node.identity import Admission

pytestmark = pytest.mark.slow

CONFIG = """
[identity]
open_swarm = true
[training]
task = "synthetic-linreg"
threads = 1
eval_every = 10
[gossip]
probe_interval_s = 0.2
exchange_every = 2
[gossip.diloco]
inner_steps = 10
[state]
status_every_s = 0.2
"""


def config(tmp_path: Path, name: str, algorithm: str, *overrides: str):
    return config_from_toml(CONFIG, base=tmp_path, overrides=[
        f'state.dir="{tmp_path / name}"', f'gossip.algorithm="{algorithm}"', *overrides,
    ])  # fmt: skip


def exchanges_with(node, peer_id: str) -> int:
    return sum(p.exchanges_ok for p in node.status().peers if peer_id.startswith(p.peer))


def failures_with(node, peer_id: str) -> int:
    return sum(p.exchanges_failed for p in node.status().peers if peer_id.startswith(p.peer))


def dialled(node) -> set[str]:
    """Addresses `node`'s transport holds a dialled connection to (or tried: refused ones are
    never opened, see Transport.request)."""
    return set(node._transport._outbound)


@pytest.mark.parametrize("algorithm", ["adpsgd", "dpsgd", "choco", "selsync", "diloco"])
async def test_every_algorithm_exchanges_with_a_client_that_nobody_dials(tmp_path, algorithm):
    admission = Admission.open_swarm("geotrain")
    ids = [Identity.generate() for _ in range(3)]
    a_cfg = config(tmp_path, "a", algorithm)
    async with geotrain.open_node(a_cfg, identity=ids[0], admission=admission) as a:
        boot = f'network.bootstrap=["{a.address}"]'
        b_cfg = config(tmp_path, "b", algorithm, boot)
        c_cfg = config(tmp_path, "c", algorithm, boot, "network.reachable=false")
        async with geotrain.open_node(b_cfg, identity=ids[1], admission=admission) as b, \
                geotrain.open_node(c_cfg, identity=ids[2], admission=admission) as c:  # fmt: skip
            client = ids[2].peer_id
            with trio.fail_after(120):
                while not (exchanges_with(c, ids[0].peer_id) >= 2
                           and exchanges_with(c, ids[1].peer_id) >= 2
                           and exchanges_with(a, client) + exchanges_with(b, client) >= 2):
                    await trio.sleep(0.1)  # fmt: skip
            for reachable in (a, b):
                assert client in reachable.membership.live_peers()
                assert client not in reachable.membership.dialable_peers()
                assert reachable.membership.address_of(client).startswith("client://")
                assert failures_with(reachable, client) == 0  # never asked it (it cannot be)
                assert c.address not in dialled(reachable)
                assert not any(x.startswith("client://") for x in dialled(reachable))
            assert dialled(c) >= {a.address, b.address}
            if algorithm == "adpsgd":  # what `geotrain status` shows of a client, and of it
                from geotrain.node.state import render_status

                mine = render_status(c.status().to_json()).splitlines()
                assert "client mode (dials out; nobody dials it)" in mine[0]
                assert c.status().to_json()["reachable"] is False
                theirs = render_status(a.status().to_json()).splitlines()
                header = next(x for x in theirs if x.startswith("peer "))
                row = next(x for x in theirs if x.startswith(client[:12]))
                # its address cut to its column (the whole client://<ID> shifted the row)
                assert "client://" in row and "..." in row and len(row) == len(header), row
                assert "client mode" not in theirs[0]


async def test_late_joiners_sync_their_model_from_a_reachable_peer_never_from_a_client(
    tmp_path, capsys
):
    """A node that joins late with no checkpoint fetches the model; a client is never asked for
    it (nobody can dial one), whether the joiner is reachable or a client itself."""
    admission = Admission.open_swarm("geotrain")
    a_id, c_id, d_id, e_id = (Identity.generate() for _ in range(4))
    async with geotrain.open_node(config(tmp_path, "a", "adpsgd"), identity=a_id,
                                  admission=admission) as a:  # fmt: skip
        boot = f'network.bootstrap=["{a.address}"]'
        c_cfg = config(tmp_path, "c", "adpsgd", boot, "network.reachable=false")
        async with geotrain.open_node(c_cfg, identity=c_id, admission=admission) as c:
            with trio.fail_after(60):
                while a.status().step < 30 or exchanges_with(c, a_id.peer_id) < 2:
                    await trio.sleep(0.1)
            capsys.readouterr()
            d_cfg = config(tmp_path, "d", "adpsgd", boot)
            e_cfg = config(tmp_path, "e", "adpsgd", boot, "network.reachable=false")
            async with geotrain.open_node(d_cfg, identity=d_id, admission=admission) as d, \
                    geotrain.open_node(e_cfg, identity=e_id, admission=admission) as e:  # fmt: skip
                with trio.fail_after(60):
                    while d.status().step < 1 or e.status().step < 1:
                        await trio.sleep(0.1)
                assert c_id.peer_id in {*d.membership.live_peers(), *e.membership.live_peers()}
            out = capsys.readouterr().out
    lines = out.splitlines()
    synced = [line for line in lines if "state_synced" in line and "optimizer_" not in line]
    assert len(synced) == 2, out[-3000:]  # d and e
    # and each took its optimizer's state from the peer it took the model from, unless that
    # peer was the other joiner, still without any (e may fetch from d before d's first step)
    optimizer = [line for line in lines if "optimizer_state_synced" in line
                 or ("optimizer_state_skipped" in line and "no optimizer state yet" in line)]
    assert len(optimizer) == 2, [line for line in lines if "optimizer_state" in line]
    sources = {line.split("peer=")[1].split()[0] for line in synced}
    reachable = {a_id.peer_id[:12], d_id.peer_id[:12]}  # e may fetch from d, a reachable joiner
    assert sources <= reachable and c_id.peer_id[:12] not in sources, synced
    assert "state_sync_failed" not in out and "state_sync_skipped" not in out
