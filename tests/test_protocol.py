"""The daemon's messages: membership messages in headers, and a node's answers to bad ones."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from geotrain.gossip._errors import RemoteProtocolError
from geotrain.gossip._messages import Ack, MemberUpdate, PeerList, Ping
from geotrain.node._config import config_from_toml
from geotrain.node._node import Node
from geotrain.node._protocol import (
    Delivered,
    Gossip,
    Probe,
    ProbeReply,
    node_header_codec,
    unwrap_gossip,
    wrap_gossip,
)
from geotrain.node.algorithms.adpsgd import Exchange
from geotrain.node.identity import Admission, Identity
from geotrain.node.transport import (
    PROTOCOL_VERSION,
    ErrorReply,
    HeaderDecodeError,
    Pong,
    TransportConfig,
    open_transport,
)
from geotrain.node.transport import Ping as TransportPing


@pytest.mark.parametrize(
    "message",
    [
        Ping(
            seq=7,
            sender_address="tcp://a:1",
            updates=(MemberUpdate("p1", "tcp://b:2", "alive", 3),),
        ),
        Ack(seq=7, sender_address="tcp://a:1", indirect=True),
        PeerList(sender_address="tcp://a:1", members=(), want_reply=True),
    ],
)
def test_membership_messages_round_trip_through_headers(message):
    codec = node_header_codec()
    header = codec.decode(codec.encode(wrap_gossip(message)))
    assert isinstance(header, Gossip) and unwrap_gossip(header) == message


def test_out_of_bounds_membership_message_is_refused():
    bad = Ping(seq=1, sender_address="x" * 1000)
    with pytest.raises(RemoteProtocolError, match="sender_address"):
        unwrap_gossip(wrap_gossip(bad))


@given(
    kind=st.sampled_from(["join", "ping", "pingreq", "ack", "peerlist", "leave"]), body=st.binary()
)
def test_random_bodies_only_raise_our_error(kind, body):
    try:
        unwrap_gossip(Gossip(kind=kind, body=body))
    except RemoteProtocolError:
        pass


def test_unknown_gossip_kind_is_a_header_error():
    codec = node_header_codec()
    envelope = (PROTOCOL_VERSION, {"type": "gossip", "kind": "shout", "body": b""})
    raw = msgspec.msgpack.encode(envelope)
    with pytest.raises(HeaderDecodeError, match="invalid 'gossip' header"):
        codec.decode(raw)


CONFIG = """
[identity]
key = "unused"
open_swarm = true
[training]
task = "synthetic-linreg"
threads = 1
[gossip]
probe_interval_s = 0.2
"""


async def test_a_node_answers_bad_messages_with_errors_and_keeps_serving(tmp_path: Path):
    config = config_from_toml(CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path}/state"'])
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    client_admission = Admission.open_swarm("geotrain")

    async def no_requests(peer, header, payload):
        return ErrorReply(code="bad_request"), b""

    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        async with open_transport(
            TransportConfig(),
            Identity.generate(),
            client_admission,
            no_requests,
            codec=node_header_codec(),
        ) as client:

            async def ask(header, payload=b""):
                reply, _, _ = await client.request(address, header, payload, deadline_s=10)
                return reply

            bad = await ask(Gossip(kind="ping", body=b"\xc1garbage"))
            assert isinstance(bad, ErrorReply) and bad.code == "bad_request"
            plan = node.algorithm.plan(node.algorithm.ctx.chunk_numel)

            def opening(**changes) -> Exchange:
                fields = {"algorithm": "adpsgd", "codec": "none", "step": 0, "xid": 1,
                          "plan": plan.digest, "chunk_numel": plan.chunk_numel,
                          "chunks": len(plan), **changes}  # fmt: skip
                return Exchange(**fields)

            wrong_algo = await ask(opening(algorithm="choco"))
            assert isinstance(wrong_algo, ErrorReply) and "adpsgd" in wrong_algo.reason
            bad_codec = await ask(opening(codec="zip:9"))
            assert isinstance(bad_codec, ErrorReply) and bad_codec.code == "bad_request"
            garbage_model = await ask(opening(), b"junk")
            assert isinstance(garbage_model, ErrorReply) and "rejected" in garbage_model.reason
            too_big = await ask(Probe(), bytes(2 << 20))
            assert isinstance(too_big, ErrorReply)
            # ... and the node still serves everyone.
            assert isinstance(await ask(TransportPing(nonce=5)), Pong)
            assert await ask(Probe(), bytes(1000)) == ProbeReply(received=1000)
            good = wrap_gossip(Ping(seq=1, sender_address="tcp://127.0.0.1:1"))
            assert isinstance(await ask(good), Delivered)
        assert node.rejected_messages["gossip"] == 1 and node.rejected_messages["probe"] == 1
        assert node.status().rejected_updates == 1
        # garbage frames from a connection that never handshakes: refused and counted
        import pynng

        with pynng.Req0(dial=address, send_timeout=2000) as raw:
            await raw.asend(b"\xc3not a frame")
            with trio.fail_after(10):
                while not node.status().frames_rejected:
                    await trio.sleep(0.05)
        # ... and `geotrain status` says what was refused (it was in the metrics only)
        status = node.status().to_json()
        assert status["messages_rejected"] == {"gossip": 1, "probe": 1}
        from geotrain.node.state import render_status

        shown = render_status(status)
        # pynng's Req0 sends its unanswered request again when it redials, so the node may
        # have refused the same garbage more than once by now: each one is counted
        frames = status["frames_rejected"]
        assert set(frames) == {"unexpected"} and frames["unexpected"] >= 1, frames
        n = frames["unexpected"]
        assert f"refused   frames {n} (unexpected {n})" in shown, shown
        assert "messages 2 (gossip 1, probe 1)" in shown, shown
        # the garbage model above is the one update refused, as undecodable (the refused
        # frames are the transport's, counted apart however often pynng resent them)
        assert node.status().rejected_by_reason == {"decode": 1}
        node.request_stop()


async def test_status_over_the_network(tmp_path: Path):
    from geotrain.node.cli._node_cli import fetch_status
    from geotrain.node.state._status import render_status

    config = config_from_toml(CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path}/state"'])
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    Identity.generate().save(tmp_path / "client.key")
    client = config_from_toml(CONFIG, base=tmp_path, overrides=['identity.key="client.key"'])
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        data = await fetch_status(address, client, deadline_s=10)
        assert data["peer_id"] == node.identity.peer_id and data["task"] == "synthetic-linreg"
        assert "synthetic-linreg / adpsgd" in render_status(data)
        other_swarm = config_from_toml(
            CONFIG, base=tmp_path, overrides=['identity.key="client.key"', 'identity.swarm_id="x"']
        )
        with pytest.raises(ValueError, match=address):
            await fetch_status(address, other_swarm, deadline_s=3)
        node.request_stop()


async def test_status_of_a_node_of_another_swarm_says_why_once(tmp_path: Path, capsys):
    # the status client's own transport logged the failed handshake as a warning, and the
    # command then printed the same reason as its error, the address twice in it
    from geotrain.node.cli._main import main

    config = config_from_toml(CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path}/state"'])
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    Identity.generate().save(tmp_path / "client.key")
    client = CONFIG.replace('"unused"', '"client.key"\nswarm_id = "other"')
    (tmp_path / "client.toml").write_text(client)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        capsys.readouterr()
        argv = ["status", "--node", address, "--config", str(tmp_path / "client.toml"),
                "--timeout", "3"]  # fmt: skip
        assert await trio.to_thread.run_sync(main, argv) == 1
        err = capsys.readouterr().err
        node.request_stop()
    assert err.count("another swarm") == 1, err
    assert err.count(address) == 1, err


def test_status_from_an_address_needs_a_config(capsys):
    from geotrain.node.cli._main import main

    assert main(["status", "--node", "tcp://127.0.0.1:9"]) == 1
    assert "needs --config" in capsys.readouterr().err


@pytest.mark.parametrize("level", [None, "info"])
def test_status_prints_no_log_lines_of_its_own_transport_unless_asked(tmp_path, capsys, level):
    # `geotrain status --node tcp://...` opens a transport of its own to ask: its start is no
    # news to someone reading a status (warnings and errors still show)
    from geotrain.node.cli._main import main

    Identity.generate().save(tmp_path / "client.key")
    (tmp_path / "client.toml").write_text(CONFIG.replace('"unused"', '"client.key"'))
    argv = ["status", "--node", "tcp://127.0.0.1:9", "--config", str(tmp_path / "client.toml"),
            "--timeout", "1"]  # fmt: skip
    assert main(([] if level is None else ["--log-level", level]) + argv) == 1
    err = capsys.readouterr().err
    assert ("transport_listening" in err) == (level == "info"), err
    assert "127.0.0.1:9" in err  # (the failure is said)


def test_the_pending_handshake_cap_and_the_connections_per_peer_are_the_configs(tmp_path: Path):
    config = config_from_toml(CONFIG, base=tmp_path, overrides=[
        f'state.dir="{tmp_path}/state"', "network.max_pending_handshakes=300",
        "network.connections_per_peer=1"])  # fmt: skip
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    assert node._transport_config().max_pending_handshakes == 300
    assert node._transport_config().connections_per_peer == 1


async def test_a_node_fetching_the_swarms_model_answers_exchanges_busy_until_it_has_it():
    """A restarted node with no checkpoint served exchanges before its state sync and refused
    an honest peer's model by the norm check (its own was fresh), six times in 3 s, each
    counted against that peer."""
    from geotrain.node._router import Router
    from geotrain.node.transport import PeerInfo

    served = []

    class Part:
        handles = (Exchange,)

        async def handle(self, peer, header, payload):
            served.append(header)
            return Delivered(), b""

    router = Router()
    part = Part()
    router.add(part)
    router.hold(part, "starting: fetching the swarm's model (state sync)")
    peer = PeerInfo(peer_id="gt" + "a" * 50, public_key=b"", address="tcp://127.0.0.1:1",
                    direction="inbound")  # fmt: skip
    header = Exchange(algorithm="adpsgd", codec="none", step=0, xid=1, plan=0, chunk_numel=1,
                      chunks=1)  # fmt: skip
    reply, _ = await router.handle(peer, header, memoryview(b""))
    assert isinstance(reply, ErrorReply) and reply.code == "busy" and "state sync" in reply.reason
    assert served == [] and not router.rejected  # (busy: nothing counted against the peer)
    router.release()
    reply, _ = await router.handle(peer, header, memoryview(b""))
    assert isinstance(reply, Delivered) and served == [header]


async def test_a_node_holds_its_exchanges_through_its_start_up_fetch(tmp_path: Path, monkeypatch):
    # the node's own wiring of the hold above: from its start until its state sync returns
    from geotrain.node._state_sync import StateSync

    fetched = trio.Event()

    async def slow_fetch(self, stop):
        await fetched.wait()
        return False

    monkeypatch.setattr(StateSync, "fetch", slow_fetch)
    config = config_from_toml(CONFIG, base=tmp_path, overrides=[
        f'state.dir="{tmp_path}/state"', 'network.bootstrap=["tcp://127.0.0.1:9"]'])  # fmt: skip
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.run)
        async with open_transport(
            TransportConfig(), Identity.generate(), Admission.open_swarm("geotrain"),
            lambda *_: None, codec=node_header_codec(),
        ) as client:  # fmt: skip
            plan = node.algorithm.plan(node.algorithm.ctx.chunk_numel)
            opening = Exchange(algorithm="adpsgd", codec="none", step=0, xid=1, plan=plan.digest,
                               chunk_numel=plan.chunk_numel, chunks=len(plan))  # fmt: skip

            async def ask():
                reply, _, _ = await client.request(address, opening, b"", deadline_s=10)
                return reply

            held = await ask()
            assert isinstance(held, ErrorReply) and held.code == "busy", held
            assert "state sync" in held.reason
            fetched.set()
            with trio.fail_after(30):
                while node.trainer.step < 1:
                    await trio.sleep(0.05)
            after = await ask()
            assert not (isinstance(after, ErrorReply) and "state sync" in after.reason), after
        node.request_stop()
