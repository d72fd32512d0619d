"""The secure transport over real loopback sockets: handshake, admission, frames, robustness.

Bad peers are built by hand from pynng and node._noise (the test may import pynng; the layering
rule is about the project's packages).
"""

import contextlib
import functools
import random
import socket
import time

import msgspec
import pynng
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from geotrain.node.identity._admission import Admission, SwarmAuthority
from geotrain.node.identity._identity import Identity
from geotrain.node.transport._backoff import BASE_S as BACKOFF_BASE_S
from geotrain.node.transport._backoff import CAP_S as BACKOFF_CAP_S
from geotrain.node.transport._backoff import MAX_ADDRESSES as MAX_BACKOFF_ADDRESSES
from geotrain.node.transport._backoff import DialBackoff
from geotrain.node.transport._messages import ErrorReply, Header, HeaderCodec, Ping, Pong
from geotrain.node.transport._noise import (
    FRAME_KIND_PULL,
    STATIC_SIGNATURE_CONTEXT,
    IdentityProof,
    NoiseHandshake,
    PartInfo,
    check_identity_proof,
    make_identity_proof,
    open_frame,
    parse_frame_prefix,
    seal_frame,
)
from geotrain.node.transport._transport import (
    HandshakeError,
    LocalTransportError,
    PeerUnreachable,
    RemoteTransportError,
    RequestTimeout,
    TransportConfig,
    open_transport,
)

CONFIG = TransportConfig(handshake_timeout_s=1.0, max_message_bytes=1 << 20)
CODEC = HeaderCodec()


class Node:
    def __init__(self, authority, expires_in_s=3600.0, now=None):
        self.identity = Identity.generate()
        self.cert = authority.admit(
            self.identity.public_key, expires_in_s=expires_in_s, now=now or time.time()
        )
        self.admission = Admission.with_certificate(authority.info, self.cert)
        self.seen = []

    async def handler(self, peer, header, payload):
        self.seen.append((peer.peer_id, header))
        if isinstance(header, Ping) and header.nonce == 666:
            raise RuntimeError("handler bug")
        if isinstance(header, Ping) and header.nonce >= 1000:
            await trio.sleep(header.nonce / 1000)
        return Pong(header.nonce), bytes(payload)[::-1]


@pytest.fixture
def authority():
    return SwarmAuthority.generate()


def _open(node, config=CONFIG, **kw):
    return open_transport(config, node.identity, node.admission, node.handler, **kw)


async def counted(transport, rejected: dict) -> None:
    """Assert `transport` refused exactly these frames. (A request that timed out unanswered
    does not prove the node has read its frame yet: waited for, up to 10 s.)"""
    with trio.move_on_after(10):
        while transport.statistics().frames_rejected != rejected:
            await trio.sleep(0.02)
    assert transport.statistics().frames_rejected == rejected


class RawClient:
    """A hand-driven client speaking the wire protocol, to play a misbehaving peer."""

    def __init__(self, address, identity, prologue, credential=b"", *, redial=True):
        # (redial=False: a connection the node drops stays dropped. Else nng dials again within
        # ~1 s, and a test that counts the connections the node saw close may count it too)
        hold = {} if redial else {"reconnect_time_min": 600_000, "reconnect_time_max": 600_000}
        self.sock = pynng.Req0(recv_max_size=1 << 22, recv_timeout=3000, send_timeout=3000,
                               **hold)  # fmt: skip
        self.sock.resend_time = -1
        self.sock.dial(address, block=True)
        self.identity, self.prologue, self.credential = identity, prologue, credential
        self.counter = 0

    def close(self):
        self.sock.close()

    async def rpc(self, data, timeout=2.0):
        ctx = self.sock.new_context()
        try:
            with trio.move_on_after(timeout):
                await ctx.asend(data)
                return await ctx.arecv()
        except pynng.NNGException:
            return None
        finally:
            ctx.close()
        return None

    async def handshake(self, sign_with=None):
        static = X25519PrivateKey.generate()
        hs = NoiseHandshake(True, static, self.prologue)
        reply = await self.rpc(b"\x01" + hs.write_message(b""))
        assert reply[:1] == b"\x02"
        check_identity_proof(hs.read_message(reply[1:]), hs.remote_static)
        static_pub = static.public_key().public_bytes_raw()
        proof = make_identity_proof(self.identity, static_pub, self.credential)
        if sign_with is not None:  # claim our identity key, but sign with another one
            forged = sign_with.sign(STATIC_SIGNATURE_CONTEXT + static_pub)
            proof = msgspec.msgpack.encode(
                IdentityProof(self.identity.public_key, forged, self.credential)
            )
        reply = await self.rpc(b"\x03" + hs.write_message(proof))
        if reply == b"\x04":
            send, recv = hs.split()
            self.send, self.recv = ChaCha20Poly1305(send), ChaCha20Poly1305(recv)
        return reply

    def frame(self, header, payload=b""):
        frame = bytes(seal_frame(self.send, self.counter, CODEC.encode(header), payload))
        self.counter += 1
        return frame

    def open(self, reply):
        header, payload = open_frame(self.recv, parse_frame_prefix(reply, 1 << 16, 1 << 22), reply)
        return CODEC.decode(header), payload


async def test_request_and_reply_carry_header_payload_and_proven_peers(authority):
    a, b = Node(authority), Node(authority)
    async with _open(a) as ta, _open(b) as tb:
        header, payload, peer = await ta.request(
            tb.address, Ping(7), b"abc", deadline_s=5, expect_peer=b.identity.peer_id
        )
        assert header == Pong(7) and bytes(payload) == b"cba"
        assert peer.peer_id == b.identity.peer_id and peer.direction == "outbound"
        assert b.seen == [(a.identity.peer_id, Ping(7))]
        stats_a, stats_b = ta.statistics(), tb.statistics()
    assert stats_a.handshakes_ok == stats_b.handshakes_ok == 1
    assert stats_a.requests_sent == 1 and stats_b.requests_served == 1
    assert stats_a.bytes_out == stats_b.bytes_in > 0
    assert stats_a.bytes_in == stats_b.bytes_out > 0
    frame_in, frame_out = stats_a.peer_bytes[b.identity.peer_id]
    assert stats_b.peer_bytes[a.identity.peer_id] == (frame_out, frame_in)
    assert 3 < frame_out < stats_a.bytes_out  # the handshake is not counted per peer


async def test_both_ends_count_every_byte_of_a_request_and_reply_sent_in_parts(authority):
    config = TransportConfig(part_bytes=64 * 1024, max_message_bytes=1 << 20)
    a, b = Node(authority), Node(authority)
    big = bytes(range(256)) * 3000  # 768 KiB each way: 12 parts, the reply's parts pulled
    async with _open(a, config) as ta, _open(b, config) as tb:
        _, payload, _ = await ta.request(tb.address, Ping(1), big, deadline_s=30)
        assert bytes(payload) == big[::-1]
        stats_a, stats_b = ta.statistics(), tb.statistics()
    assert stats_a.bytes_out == stats_b.bytes_in > len(big)
    assert stats_a.bytes_in == stats_b.bytes_out > len(big)


async def test_many_requests_to_many_peers_at_once(authority):
    client, servers = Node(authority), [Node(authority) for _ in range(3)]
    results = {}
    async with _open(client) as tc, _open(servers[0]) as t0:
        async with _open(servers[1]) as t1, _open(servers[2]) as t2:

            async def one(address, nonce):
                header, payload, _ = await tc.request(
                    address, Ping(nonce), nonce.to_bytes(4, "big"), deadline_s=10
                )
                results[nonce] = (header, bytes(payload))

            async with trio.open_nursery() as nursery:
                for nonce in range(60):
                    address = (t0, t1, t2)[nonce % 3].address
                    nursery.start_soon(one, address, nonce)
    assert results == {n: (Pong(n), n.to_bytes(4, "big")[::-1]) for n in range(60)}
    assert [len(s.seen) for s in servers] == [20, 20, 20]


async def test_cancelling_one_request_leaves_the_connection_usable(authority):
    a, b = Node(authority), Node(authority)
    async with _open(a) as ta, _open(b) as tb:
        await ta.request(tb.address, Ping(1), deadline_s=5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(ta.request, tb.address, Ping(3000), deadline_s=9))
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        header, _, _ = await ta.request(tb.address, Ping(2), deadline_s=5)
        assert header == Pong(2)
        with pytest.raises(RequestTimeout):
            await ta.request(tb.address, Ping(2000), deadline_s=0.2)
        header, _, _ = await ta.request(tb.address, Ping(4), deadline_s=5)
        assert header == Pong(4)


async def test_expected_peer_mismatch_fails_the_handshake_outbound(authority):
    a, b = Node(authority), Node(authority)
    async with _open(a) as ta, _open(b) as tb:
        with pytest.raises(HandshakeError, match="peer ID mismatch"):
            await ta.request(
                tb.address, Ping(1), deadline_s=5, expect_peer=Identity.generate().peer_id
            )
        assert b.seen == []
        assert ta.statistics().handshakes_failed == {"peer_mismatch": 1}
        # the right peer ID still works, and a cached connection is checked too
        await ta.request(tb.address, Ping(1), deadline_s=5, expect_peer=b.identity.peer_id)
        with pytest.raises(HandshakeError, match="peer ID mismatch"):
            await ta.request(tb.address, Ping(1), deadline_s=5, expect_peer=a.identity.peer_id)


async def test_inbound_peer_whose_proof_mismatches_its_claimed_identity_is_refused(authority):
    b = Node(authority)
    victim, attacker = Node(authority), Identity.generate()
    async with _open(b) as tb:
        # claims the victim's certificate but proves a different identity key
        raw = RawClient(tb.address, attacker, b.admission.prologue, victim.cert.to_bytes())
        try:
            reply = await raw.handshake()
        finally:
            raw.close()
        assert reply.startswith(b"\x7f") and b"certificate names another peer" in reply
        # proves the victim's key signed the channel? it cannot: signs with its own key instead
        raw = RawClient(tb.address, victim.identity, b.admission.prologue, victim.cert.to_bytes())
        try:
            static_reply = await raw.handshake(sign_with=attacker)
        finally:
            raw.close()
        assert b"not signed by the claimed identity" in static_reply
        assert tb.statistics().handshakes_failed == {"admission": 1, "proof": 1}
        assert b.seen == []


async def test_other_swarm_fails_the_handshake(authority):
    a, b = Node(authority), Node(SwarmAuthority.generate())
    async with _open(a) as ta, _open(b) as tb:
        with pytest.raises(HandshakeError, match="authentication"):
            await ta.request(tb.address, Ping(1), deadline_s=5)
        assert b.seen == []


@pytest.mark.parametrize("case", ["non_member", "expired", "other_swarm_cert", "forged"])
async def test_refused_credentials(authority, case):
    server = Node(authority)
    intruder = Identity.generate()
    if case == "non_member":
        credential, match = b"", "no membership certificate"
    elif case == "expired":
        credential = authority.admit(
            intruder.public_key, expires_in_s=60, now=time.time() - 3600
        ).to_bytes()
        match = "expired"
    elif case == "other_swarm_cert":
        other = SwarmAuthority.generate()
        credential = other.admit(intruder.public_key, expires_in_s=60, now=time.time()).to_bytes()
        match = "another swarm"
    else:
        impostor = SwarmAuthority(authority.swarm_id, SwarmAuthority.generate().private_key)
        credential = impostor.admit(
            intruder.public_key, expires_in_s=60, now=time.time()
        ).to_bytes()
        match = "not the swarm authority"
    async with _open(server) as ts:
        raw = RawClient(ts.address, intruder, server.admission.prologue, credential)
        try:
            reply = await raw.handshake()
            assert reply.startswith(b"\x7f") and match.encode() in reply
            # refused peers get nothing served
            assert await raw.rpc(b"\x10" + bytes(40), timeout=0.5) is None
        finally:
            raw.close()
        assert server.seen == []
        assert ts.statistics().handshakes_failed == {"admission": 1}


async def test_expired_certificate_refused_by_a_real_transport(authority):
    a = Node(authority, expires_in_s=60, now=time.time() - 3600)
    b = Node(authority)
    async with _open(a) as ta, _open(b) as tb:
        # a knows its own certificate expired: it says so and does not dial at all
        with pytest.raises(LocalTransportError, match="our membership certificate expired at "
                           ".* get a renewed one"):  # fmt: skip
            await ta.request(tb.address, Ping(1), deadline_s=5)
        assert tb.statistics().handshakes_failed == {} and ta.statistics().requests_sent == 0
        # b dialling a fails on b's side: a's proof carries an expired certificate
        with pytest.raises(HandshakeError, match="certificate expired"):
            await tb.request(ta.address, Ping(1), deadline_s=5)


async def test_a_renewed_certificate_is_used_without_a_restart(authority):
    a = Node(authority, expires_in_s=60, now=time.time() - 3600)
    b = Node(authority)
    async with _open(a) as ta, _open(b) as tb:
        assert ta.certificate_expires_at == a.cert.expires_at < time.time()
        with pytest.raises(LocalTransportError, match="expired"):
            await ta.request(tb.address, Ping(1), deadline_s=5)
        renewed = authority.admit(a.identity.public_key, expires_in_s=3600, now=time.time())
        ta.renew(Admission.with_certificate(authority.info, renewed))
        header, _, _ = await ta.request(tb.address, Ping(7), deadline_s=5)
        assert header == Pong(7) and ta.certificate_expires_at == renewed.expires_at
        # a certificate for somebody else, or another swarm, is refused
        stranger = authority.admit(Identity.generate().public_key, expires_in_s=60, now=time.time())
        with pytest.raises(LocalTransportError, match="another identity"):
            ta.renew(Admission.with_certificate(authority.info, stranger))
        other = SwarmAuthority.generate()
        with pytest.raises(LocalTransportError, match="another swarm"):
            ta.renew(Admission.with_certificate(
                other.info, other.admit(a.identity.public_key, expires_in_s=60, now=time.time())))


async def test_repeated_handshake_failures_back_off(authority):
    outsider = Node(SwarmAuthority(authority.swarm_id, SwarmAuthority.generate().private_key))
    b = Node(authority)
    async with _open(outsider) as to, _open(b) as tb:
        for _ in range(2):  # the first retry is immediate
            with pytest.raises(HandshakeError, match="handshake with .* failed: admission"):
                await to.request(tb.address, Ping(1), deadline_s=5)
        # then it waits, without touching the network
        for _ in range(20):
            with pytest.raises(HandshakeError, match="not dialling .* 2 handshakes in a row"):
                await to.request(tb.address, Ping(1), deadline_s=5)
        assert to.statistics().handshakes_failed == {"admission": 2}


def test_backoff_doubles_with_jitter_up_to_a_cap_and_clears_on_success():
    backoff = DialBackoff(random.Random(1))
    waits = [backoff.failed("tcp://x", now=0.0) for _ in range(14)]
    assert waits[0] == 0
    for n, wait in enumerate(waits[1:], start=2):
        full = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (n - 2))
        assert full / 2 <= wait <= full
    assert max(waits) <= BACKOFF_CAP_S and waits[-1] >= BACKOFF_CAP_S / 2
    assert backoff.wait_s("tcp://x", now=1.0) > 0 and backoff.wait_s("tcp://y", now=1.0) == 0
    backoff.succeeded("tcp://x")
    assert backoff.wait_s("tcp://x", now=1.0) == 0 and backoff.failures("tcp://x") == 0
    for i in range(MAX_BACKOFF_ADDRESSES + 10):  # addresses from the network: bounded
        backoff.failed(f"tcp://h{i}", now=0.0)
    assert backoff.failures("tcp://h0") == 0 and backoff.failures(f"tcp://h{i}") == 1


async def test_replayed_frame_is_rejected(authority):
    server, client = Node(authority), Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, client.identity, server.admission.prologue)
        raw.credential = client.cert.to_bytes()
        try:
            assert await raw.handshake() == b"\x04"
            frame = raw.frame(Ping(5), b"xy")
            header, payload = raw.open(await raw.rpc(frame))
            assert header == Pong(5) and bytes(payload) == b"yx"
            assert await raw.rpc(frame, timeout=1.0) is None
        finally:
            raw.close()
        await counted(ts, {"replay": 1})
        assert len(server.seen) == 1


async def test_unencrypted_bytes_after_the_handshake_are_rejected(authority):
    server, client = Node(authority), Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, client.identity, server.admission.prologue)
        raw.credential = client.cert.to_bytes()
        try:
            assert await raw.handshake() == b"\x04"
            plain = seal_frame(ChaCha20Poly1305(bytes(32)), 0, CODEC.encode(Ping(1)), b"")
            assert await raw.rpc(bytes(plain), timeout=1.0) is None
        finally:
            raw.close()
        await counted(ts, {"auth": 1})
        assert server.seen == []


async def test_stalled_handshake_hits_its_deadline_inbound(authority):
    server = Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, Identity.generate(), server.admission.prologue)
        try:
            hs = NoiseHandshake(True, X25519PrivateKey.generate(), server.admission.prologue)
            assert (await raw.rpc(b"\x01" + hs.write_message(b"")))[:1] == b"\x02"
            with trio.fail_after(10):
                while ts.statistics().handshakes_failed.get("deadline", 0) == 0:
                    await trio.sleep(0.05)
            assert await raw.rpc(b"\x03" + bytes(100), timeout=0.5) is None
        finally:
            raw.close()


async def test_stalled_handshake_hits_its_deadline_outbound(authority):
    client = Node(authority)
    with pynng.Rep0(listen="tcp://127.0.0.1:0", recv_max_size=1 << 16) as mute:
        port = str(mute.listeners[0].local_address).rsplit(":", 1)[1]
        async with _open(client) as tc:
            with pytest.raises(HandshakeError, match="deadline"):
                await tc.request(f"tcp://127.0.0.1:{port}", Ping(1), deadline_s=10)
            assert tc.statistics().handshakes_failed == {"deadline": 1}


async def test_nobody_listening_is_peer_unreachable(authority):
    client = Node(authority)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with _open(client) as tc:
        with pytest.raises(PeerUnreachable):
            await tc.request(f"tcp://127.0.0.1:{port}", Ping(1), deadline_s=5)


async def test_an_address_no_node_has_is_never_dialled(authority, tmp_path):
    """nng dials any URL it knows: a member gossiped at ipc:///path made a node connect to a
    Unix socket of its machine and send it nng's header."""
    from geotrain.node.transport import LocalTransportError

    path = tmp_path / "trap.sock"
    with socket.socket(socket.AF_UNIX) as trap:
        trap.bind(str(path))
        trap.listen(4)
        trap.setblocking(False)
        async with _open(Node(authority)) as tc:
            for url in (f"ipc://{path}", "inproc://trap", "ws://127.0.0.1:9/x", "tcp://:7"):
                with pytest.raises(LocalTransportError, match="dials tcp://HOST:PORT only"):
                    await tc.request(url, Ping(1), deadline_s=2)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody came


async def _keep_asking(transport, address, answers, stop):
    nonce = 0
    while not stop.is_set():
        header, _, _ = await transport.request(address, Ping(nonce), deadline_s=5)
        answers.append(header == Pong(nonce))
        nonce += 1
        await trio.sleep(0.01)


async def test_garbage_drops_that_connection_and_others_keep_being_served(authority):
    server, good, bad = Node(authority), Node(authority), Node(authority)
    answers, stop = [], trio.Event()
    async with _open(server) as ts, _open(good) as tg:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_asking, tg, ts.address, answers, stop)
            # garbage before any handshake
            raw = RawClient(ts.address, bad.identity, server.admission.prologue)
            assert await raw.rpc(b"\xde\xad\xbe\xef" * 50, timeout=1.0) is None
            raw.close()
            # garbage after a completed handshake
            raw = RawClient(ts.address, bad.identity, server.admission.prologue)
            raw.credential = bad.cert.to_bytes()
            assert await raw.handshake() == b"\x04"
            assert await raw.rpc(b"\x10" + bytes(range(200)), timeout=1.0) is None
            raw.close()
            before = len(answers)
            while len(answers) < before + 5:
                await trio.sleep(0.01)
            stop.set()
    assert all(answers) and len(answers) >= 5
    rejected = ts.statistics().frames_rejected
    assert rejected["unexpected"] == 1 and rejected["length"] == 1


async def test_oversized_frame_is_refused_without_allocation(authority):
    server, good, big = Node(authority), Node(authority), Node(authority)
    small = TransportConfig(handshake_timeout_s=1.0, max_message_bytes=1024)
    answers, stop = [], trio.Event()
    async with _open(server, small) as ts, _open(good) as tg:
        port = int(ts.address.rsplit(":", 1)[1])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_asking, tg, ts.address, answers, stop)
            # speak SP over TCP by hand: header for Req0 (protocol 0x30), then a message whose
            # length field claims 1 TiB. The node must hang up rather than try to allocate it.
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", port))
            await sock.send(b"\x00SP\x00\x00\x30\x00\x00")
            assert len(await sock.recv(8)) == 8
            await sock.send((1 << 40).to_bytes(8, "big") + b"\x00" * 64)
            with trio.fail_after(10):
                try:
                    assert await sock.recv(1) == b""
                except ConnectionResetError:
                    pass
            sock.close()
            # an admitted peer (whose own limit is higher) sending more is cut off too
            async with _open(big) as tb:
                with pytest.raises(PeerUnreachable):
                    await tb.request(ts.address, Ping(1), b"x" * 2048, deadline_s=5)
            # and our own limit is enforced before anything is sent
            with pytest.raises(LocalTransportError):
                await tg.request(
                    ts.address, Ping(1), b"x" * (CONFIG.max_message_bytes + 1), deadline_s=5
                )
            before = len(answers)
            while len(answers) < before + 5:
                await trio.sleep(0.01)
            stop.set()
    assert all(answers)
    assert ts.statistics().frames_rejected == {"length": 1}


async def test_unknown_header_type_gets_an_error_reply(authority):
    class Teleport(Header, frozen=True, tag="teleport"):
        where: str

    a, b = Node(authority), Node(authority)
    codec = HeaderCodec((*CODEC.types, Teleport))
    async with _open(a, codec=codec) as ta, _open(b) as tb:
        header, _, _ = await ta.request(tb.address, Teleport("mars"), deadline_s=5)
        assert header.code == "unknown_type" and "teleport" in header.reason
        header, _, _ = await ta.request(tb.address, Ping(666), deadline_s=5)
        assert header == ErrorReply("internal", "the handler failed")
        assert tb.statistics().frames_rejected == {"header": 1}


async def test_allow_list_admits_listed_peers_only():
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()

    async def echo(peer, header, payload):
        return Pong(header.nonce), b""

    def adm(*ids):
        return Admission.with_allow_list("lab", [i.peer_id for i in ids])

    async with open_transport(CONFIG, a, adm(b), echo) as ta:
        async with open_transport(CONFIG, b, adm(a), echo) as tb:
            async with open_transport(CONFIG, c, adm(a, b), echo) as tc:
                assert (await tb.request(ta.address, Ping(1), deadline_s=5))[0] == Pong(1)
                with pytest.raises(HandshakeError, match="allow-list"):
                    await tc.request(ta.address, Ping(1), deadline_s=5)
                with pytest.raises(HandshakeError, match="allow-list"):
                    await ta.request(tc.address, Ping(1), deadline_s=5)


async def test_closing_under_cancellation_is_clean(authority):
    a, b = Node(authority), Node(authority)
    with trio.move_on_after(0.3):
        async with _open(a) as ta, _open(b) as tb:
            await ta.request(tb.address, Ping(9000), deadline_s=30)
    async with _open(a) as ta:  # the same node can start again
        assert ta.statistics().handshakes_ok == 0


def test_bad_config_names_field_and_value():
    with pytest.raises(ValueError, match="handshake_timeout_s: -1"):
        TransportConfig(handshake_timeout_s=-1)
    with pytest.raises(ValueError, match="listen: 'localhost'"):
        TransportConfig(listen="localhost")


async def test_big_requests_travel_in_parts_and_arrive_whole(authority):
    config = TransportConfig(part_bytes=64 * 1024, parts_in_flight=3, max_message_bytes=1 << 20,
                             max_reassembly_bytes=8 << 20)  # (four at once: 3 MiB)  # fmt: skip
    a, b = Node(authority), Node(authority)
    payload = bytes(range(256)) * 3000 + b"tail"  # 768 KiB + 4: 13 parts, the last one short
    async with _open(a, config) as ta, _open(b, config) as tb:
        async with trio.open_nursery() as nursery:
            for nonce in range(3):  # several multi-part requests at once on one connection
                nursery.start_soon(
                    functools.partial(ta.request, tb.address, Ping(nonce), payload, deadline_s=20)
                )
        header, reply, _ = await ta.request(tb.address, Ping(9), payload, deadline_s=20)
    assert header == Pong(9) and bytes(reply) == payload[::-1]
    assert sorted(n for _, h in b.seen for n in [h.nonce]) == [0, 1, 2, 9]


async def test_a_part_sent_twice_is_rejected(authority):
    server, client = Node(authority), Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, client.identity, server.admission.prologue)
        raw.credential = client.cert.to_bytes()
        try:
            assert await raw.handshake() == b"\x04"
            part = PartInfo(message_id=1, index=0, count=2, message_len=10)
            first = bytes(seal_frame(raw.send, 0, b"", b"01234", part))
            assert (await raw.rpc(first))[:1] == b"\x10"  # acknowledged
            again = bytes(seal_frame(raw.send, 1, b"", b"01234", part))
            assert await raw.rpc(again, timeout=1.0) is None
        finally:
            raw.close()
        await counted(ts, {"part": 1})
        assert server.seen == []


async def test_cancelled_multi_part_requests_do_not_wedge_the_connection(authority):
    config = TransportConfig(part_bytes=64 * 1024, parts_in_flight=2, max_message_bytes=1 << 21)
    a, b = Node(authority), Node(authority)
    payload = bytes(2 << 20)  # 32 parts
    async with _open(a, config) as ta, _open(b, config) as tb:
        await ta.request(tb.address, Ping(1), deadline_s=10)
        for _ in range(3):  # each leaves a half-sent message behind on the server
            with trio.move_on_after(0.01):
                await ta.request(tb.address, Ping(2), payload, deadline_s=20)
        for nonce in (3, 4, 5):
            header, reply, _ = await ta.request(tb.address, Ping(nonce), payload, deadline_s=20)
            assert header == Pong(nonce) and len(reply) == len(payload)


async def test_strangers_cannot_pile_up_pending_handshakes_nor_lock_newcomers_out(authority):
    """At the cap, a new connection closes the oldest unfinished handshake: refusing the
    newcomer instead let one stranger holding every pending slot lock out all new peers."""
    server = Node(authority)
    config = TransportConfig(handshake_timeout_s=30, max_pending_handshakes=2)
    async with _open(server, config) as ts:
        raws = []
        try:
            for _ in range(3):
                raws.append(RawClient(ts.address, Identity.generate(), server.admission.prologue))
                hs = NoiseHandshake(True, X25519PrivateKey.generate(), server.admission.prologue)
                assert (await raws[-1].rpc(b"\x01" + hs.write_message(b"")))[:1] == b"\x02"
            assert ts.statistics().handshakes_failed["too_many_pending"] == 1
            # an honest newcomer still gets through while strangers hold the slots
            client = Node(authority)
            async with _open(client, config) as tc:
                await tc.request(ts.address, Ping(1), deadline_s=10)
        finally:
            for raw in raws:
                raw.close()


async def test_a_replayed_reply_is_rejected_by_the_client(authority):
    """A hand-driven server answers the second request with its first reply again."""
    client, fake = Node(authority), Node(authority)
    with pynng.Rep0(listen="tcp://127.0.0.1:0", recv_max_size=1 << 20) as rep:
        port = str(rep.listeners[0].local_address).rsplit(":", 1)[1]

        async def serve():
            hs = NoiseHandshake(False, X25519PrivateKey.generate(), fake.admission.prologue)
            hs.read_message((await rep.arecv())[1:])
            static = hs._s.public_key().public_bytes_raw()
            proof = make_identity_proof(fake.identity, static, fake.cert.to_bytes())
            await rep.asend(b"\x02" + hs.write_message(proof))
            hs.read_message((await rep.arecv())[1:])
            await rep.asend(b"\x04")
            send = ChaCha20Poly1305(hs.split()[0])
            await rep.arecv()
            first = bytes(seal_frame(send, 0, CODEC.encode(Pong(1)), b""))
            await rep.asend(first)
            await rep.arecv()
            await rep.asend(first)

        async with _open(client) as tc, trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            address = f"tcp://127.0.0.1:{port}"
            assert (await tc.request(address, Ping(1), deadline_s=5))[0] == Pong(1)
            with pytest.raises(RemoteTransportError, match="replay"):
                await tc.request(address, Ping(2), deadline_s=5)
            assert tc.statistics().frames_rejected == {"replay": 1}


async def test_sessions_end_when_the_admission_expires(authority):
    start = time.time()
    now = [start]

    def clock():
        return now[0]

    a = Node(authority, expires_in_s=100, now=start)  # a's certificate runs out first
    b, c = Node(authority), Node(authority, expires_in_s=200, now=start)
    async with _open(a, clock=clock) as ta, _open(b, clock=clock) as tb:
        async with _open(c, clock=clock) as tc:
            _, _, peer = await ta.request(tb.address, Ping(1), deadline_s=5)
            assert peer.admitted_until == b.cert.expires_at
            await tb.request(tc.address, Ping(2), deadline_s=5)
            now[0] = start + 150
            # inbound: b cuts a's session at its next frame
            with pytest.raises(PeerUnreachable):
                await ta.request(tb.address, Ping(3), deadline_s=5)
            assert tb.statistics().frames_rejected == {"expired": 1}
            # and a knows its own certificate ran out: it does not dial again
            with pytest.raises(LocalTransportError, match="our membership certificate expired"):
                await ta.request(tb.address, Ping(4), deadline_s=5)
            # outbound: b's session with c is still good until c's certificate ends...
            assert (await tb.request(tc.address, Ping(5), deadline_s=5))[0] == Pong(5)
            now[0] = start + 250
            # ...then b redials instead of using the old session, and the handshake refuses c
            with pytest.raises(HandshakeError, match="certificate expired"):
                await tb.request(tc.address, Ping(6), deadline_s=5)
            assert [h.nonce for _, h in c.seen] == [2, 5]


async def test_a_stranger_cannot_make_a_node_take_in_more_than_a_part(authority):
    # a message above part_bytes only ever travels in parts, so nng refuses a bigger frame from
    # anyone before allocating it: no stranger's unauthenticated 64 MiB (it could hold up to
    # max_message_bytes, 320 MiB by default, per connection) while real peers' big messages,
    # in parts, still go through
    config = TransportConfig()  # the node's defaults: parts of 4 MiB, 10 s for a handshake
    server, good = Node(authority), Node(authority)
    async with _open(server, config) as ts, _open(good, config) as tg:
        port = int(ts.address.rsplit(":", 1)[1])
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", port))
        await sock.send(b"\x00SP\x00\x00\x30\x00\x00")
        assert len(await sock.recv(8)) == 8
        await sock.send((64 << 20).to_bytes(8, "big") + b"\x00" * 64)
        with trio.fail_after(3):  # (well before the unfinished handshake's 10 s)
            try:
                assert await sock.recv(1) == b""  # hung up at once
            except ConnectionResetError:
                pass
        sock.close()
        payload = bytes(range(256)) * (40 * 4096)  # 40 MiB: ten parts
        reply, data, _ = await tg.request(ts.address, Ping(7), payload, deadline_s=60)
        assert reply == Pong(7) and bytes(data) == payload[::-1]


async def test_a_multi_part_request_the_peer_refuses_raises_our_error(authority):
    small = TransportConfig(part_bytes=64 * 1024, max_message_bytes=256 * 1024)
    large = TransportConfig(part_bytes=64 * 1024, max_message_bytes=1 << 20)
    a, b = Node(authority), Node(authority)
    async with _open(a, large) as ta, _open(b, small) as tb:
        await ta.request(tb.address, Ping(1), deadline_s=5)
        with pytest.raises(PeerUnreachable):  # not an ExceptionGroup from inner tasks
            await ta.request(tb.address, Ping(2), bytes(600 * 1024), deadline_s=5)
        assert tb.statistics().frames_rejected["length"] >= 1
        assert (await ta.request(tb.address, Ping(3), deadline_s=5))[0] == Pong(3)


async def test_big_replies_travel_in_parts_too(authority):
    config = TransportConfig(part_bytes=64 * 1024, parts_in_flight=3, max_message_bytes=1 << 20)
    a = Node(authority)
    big = bytes(range(256)) * 2000 + b"end"  # 500 KiB + 3: 8 parts

    async def handler(peer, header, payload):
        return Pong(header.nonce), big[header.nonce :]

    async with _open(a, config) as ta:
        b = Node(authority)
        b.handler = handler
        async with _open(b, config) as tb:
            async with trio.open_nursery() as nursery:
                for nonce in range(4):
                    nursery.start_soon(
                        functools.partial(ta.request, tb.address, Ping(nonce), deadline_s=20)
                    )
            header, reply, _ = await ta.request(tb.address, Ping(7), deadline_s=20)
            assert header == Pong(7) and bytes(reply) == big[7:]
            assert tb.statistics().frames_rejected == {}


async def test_pulling_a_reply_part_that_was_never_offered_is_rejected(authority):
    server, client = Node(authority), Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, client.identity, server.admission.prologue)
        raw.credential = client.cert.to_bytes()
        try:
            assert await raw.handshake() == b"\x04"
            pull = seal_frame(raw.send, 0, b"", b"", PartInfo(0, 1, 2, 10), FRAME_KIND_PULL)
            assert await raw.rpc(bytes(pull), timeout=1.0) is None
        finally:
            raw.close()
        await counted(ts, {"part": 1})


async def test_a_peer_whose_connection_closes_is_reported_by_id(authority):
    """A dead or departed peer's exchange with us must end when its connection closes, not when
    it idles out: the transport names the authenticated peer whose connection to us closed."""
    a, b = Node(authority), Node(authority)
    gone: list[str] = []
    async with _open(b, on_disconnect=gone.append) as tb:
        async with _open(a) as ta:
            await ta.request(tb.address, Ping(1), deadline_s=5)
            assert gone == []
        with trio.fail_after(5):
            while not gone:
                await trio.sleep(0.01)
        assert gone == [a.identity.peer_id]
        # a stranger that never authenticated is not reported
        raw = RawClient(tb.address, Identity.generate(), b"other swarm")
        raw.close()
        await trio.sleep(0.3)
        assert gone == [a.identity.peer_id]


async def test_a_peer_is_reported_gone_only_when_its_last_connection_closes(authority):
    """`geotrain status --node ... --config node.toml` connects as the node's own identity: its
    connection closing must not end the exchanges that node is driving over its other one."""
    a, b = Node(authority), Node(authority)
    gone: list[str] = []
    async with _open(b, on_disconnect=gone.append) as tb, _open(a) as ta:
        async with _open(a) as status_client:  # the same identity, a second connection
            await ta.request(tb.address, Ping(1), deadline_s=5)
            await status_client.request(tb.address, Ping(2), deadline_s=5)
        await trio.sleep(0.5)
        assert gone == []  # a is still connected
        await ta.request(tb.address, Ping(3), deadline_s=5)  # and still served
    with trio.fail_after(5):
        while not gone:
            await trio.sleep(0.01)
    assert gone == [a.identity.peer_id]


async def test_a_stranger_flooding_bad_frames_costs_the_log_a_few_lines_a_minute(authority):
    # every bad message is counted; the log says at most WARNINGS_PER_MINUTE of them a minute,
    # where they came from, and how many it left out
    from structlog.testing import capture_logs

    from geotrain.node._log_quota import WARNINGS_PER_MINUTE

    server = Node(authority)
    async with _open(server) as ts:
        with capture_logs() as logs:
            for _ in range(WARNINGS_PER_MINUTE + 10):
                with pynng.Req0(dial=ts.address, recv_timeout=300, send_timeout=2000) as s:
                    s.resend_time = -1  # (one request each)
                    s.send(b"")  # an empty message before any handshake
                    with contextlib.suppress(pynng.NNGException):  # (hung up on)
                        await trio.to_thread.run_sync(s.recv)
            # (the last recv may give up before the node has read the last frame)
            with trio.fail_after(10):
                while ts.statistics().frames_rejected["unexpected"] < WARNINGS_PER_MINUTE + 10:
                    await trio.sleep(0.02)
        said = [e for e in logs if e["event"] == "frame_rejected"]
        assert ts.statistics().frames_rejected["unexpected"] == WARNINGS_PER_MINUTE + 10
        assert len(said) == WARNINGS_PER_MINUTE
        assert "empty message" in said[0]["detail"] and said[0]["remote"].startswith("127.0.0.1")


async def test_a_connection_that_keeps_failing_handshakes_is_closed(authority):
    """After a refused handshake a connection could start another at once: one stranger's
    connection ran ~11,800 in 8 s (7.4 CPU-seconds of the node's). A few are answered, with
    the refusal an honest peer needs; then the connection is closed."""
    from geotrain.node.transport._inbound import MAX_FAILED_HANDSHAKES

    server = Node(authority)
    async with _open(server) as ts:
        raw = RawClient(ts.address, Identity.generate(), server.admission.prologue)
        try:
            low_order = b"\x01" + bytes(32)  # an HS1 whose key gives an all-zero secret
            for _ in range(MAX_FAILED_HANDSHAKES):
                reply = await raw.rpc(low_order)
                assert reply is not None and reply[:1] == b"\x7f"  # HS_REFUSED
                assert b"invalid public key" in reply
            assert await raw.rpc(low_order, timeout=1.0) is None  # closed
        finally:
            raw.close()
        stats = ts.statistics()
        assert stats.handshakes_failed["noise"] == MAX_FAILED_HANDSHAKES
        assert stats.frames_rejected["handshakes"] == 1


async def test_an_oversized_frame_is_counted_and_logged_and_the_node_serves_on(authority):
    """nng drops a frame over recv_max_size by closing its connection, unread: a stranger's
    8 MiB and 300 MB frames left no counter and no log line (a stranger's trial)."""
    from structlog.testing import capture_logs

    server = Node(authority)
    async with _open(server, CONFIG) as ts:
        raw = RawClient(ts.address, Identity.generate(), server.admission.prologue, redial=False)
        try:
            with capture_logs() as logs:
                big = b"\x01" + bytes(CONFIG.recv_max_size + 1024)
                assert await raw.rpc(big, timeout=1.0) is None  # no answer: dropped unread
                with trio.fail_after(5):
                    while not ts.statistics().handshakes_failed.get("closed"):
                        await trio.sleep(0.02)
        finally:
            raw.close()
        said = [e for e in logs if e["event"] == "handshake_failed"]
        assert said and said[0]["reason"].startswith("closed:") and "remote" in said[0]
        client = Node(authority)  # and an honest peer is served as before
        async with _open(client, CONFIG) as tc:
            header, _, _ = await tc.request(ts.address, Ping(7), deadline_s=10)
            assert header == Pong(7)
        # an honest peer that hangs up after its handshake is not counted
        assert ts.statistics().handshakes_failed == {"closed": 1}


async def test_a_connection_closed_unread_is_counted_even_when_nng_s_close_note_is_lost(
        authority, monkeypatch):  # fmt: skip
    """pynng passes a pipe's close on only if it saw the pipe open first, and the two notes come
    from different threads: one CI run in ~40 waited 5 s for the oversized frame's "closed" in
    vain. The sweep now finds such a connection gone and counts it as closed, not as a deadline."""
    from geotrain.node.transport._inbound import _Inbound

    monkeypatch.setattr(_Inbound, "note_remove", lambda self, pipe: None)  # the note is lost
    server = Node(authority)
    async with _open(server, CONFIG) as ts:
        raw = RawClient(ts.address, Identity.generate(), server.admission.prologue, redial=False)
        try:
            assert await raw.rpc(b"\x01" + bytes(CONFIG.recv_max_size + 1024), timeout=1.0) is None
            with trio.fail_after(CONFIG.handshake_timeout_s * 3):
                while not ts.statistics().handshakes_failed:
                    await trio.sleep(0.02)
        finally:
            raw.close()
        assert ts.statistics().handshakes_failed == {"closed": 1}


async def test_a_connection_whose_close_note_overtakes_its_open_note_is_counted_once(
        authority, monkeypatch):  # fmt: skip
    """nng's notes of a pipe come from different threads: its close can reach the node before
    its opening (which pynng then adds back). The late opening made a fresh session for the dead
    pipe, which was counted a second time (a reviewer's reading of pynng)."""
    from geotrain.node.transport._inbound import _Inbound

    held: dict[int, object] = {}

    def note_connect(self, pipe):  # the opening's note is late...
        held[pipe.id] = pipe

    def note_remove(self, pipe):  # ...and comes after the close's
        self.token.run_sync_soon(self._removed, pipe.id)
        if pipe.id in held:
            self.token.run_sync_soon(self._connected, held.pop(pipe.id))

    monkeypatch.setattr(_Inbound, "note_connect", note_connect)
    monkeypatch.setattr(_Inbound, "note_remove", note_remove)
    server = Node(authority)
    async with _open(server, CONFIG) as ts:
        raw = RawClient(ts.address, Identity.generate(), server.admission.prologue)
        try:
            hs = NoiseHandshake(True, X25519PrivateKey.generate(), server.admission.prologue)
            assert (await raw.rpc(b"\x01" + hs.write_message(b"")))[:1] == b"\x02"  # a session
            assert await raw.rpc(b"\x01" + bytes(CONFIG.recv_max_size + 1024), timeout=1.0) is None
            await trio.sleep(CONFIG.handshake_timeout_s * 2.5)  # (sweeps and deadlines pass)
        finally:
            raw.close()
        assert ts.statistics().handshakes_failed == {"closed": 1}


async def test_requests_being_reassembled_hold_at_most_the_budget_over_every_connection(
        authority):  # fmt: skip
    """Each partial request is allocated whole at its first part, and the limit was two per
    connection: three admitted connections announcing 250 MiB each took a node of a 0.5 GB
    estimate to 1.2 GB. Now all connections together hold at most max_reassembly_bytes."""
    from geotrain.node.transport._noise import part_bounds

    config = TransportConfig(max_message_bytes=1 << 20)  # budget: 2 MiB
    server = Node(authority)
    size = 900 * 1024
    lo, hi = part_bounds(size, 2, 0)
    async with _open(server, config) as ts:
        raws = []
        try:
            answers = []
            for _ in range(3):
                client = Node(authority)
                raw = RawClient(ts.address, client.identity, server.admission.prologue)
                raw.credential = client.cert.to_bytes()
                raws.append(raw)
                assert await raw.handshake() == b"\x04"
                part = PartInfo(message_id=1, index=0, count=2, message_len=size)
                frame = bytes(seal_frame(raw.send, 0, b"", b"x" * (hi - lo), part))
                answers.append(await raw.rpc(frame, timeout=1.0))
            assert [a is not None and a[:1] == b"\x10" for a in answers] == [True, True, False]
        finally:
            for raw in raws:
                raw.close()
        assert ts.statistics().frames_rejected == {"reassembly": 1}
        assert server.seen == []
    with pytest.raises(ValueError, match="max_reassembly_bytes"):
        TransportConfig(max_reassembly_bytes=-1)


def test_a_message_being_reassembled_takes_memory_only_as_its_parts_come():
    """A 5 KB first part that said its message was 256 MiB made the node hold 256 MiB for up
    to 30 s (the buffer was zero-filled whole): 50,000x what the peer sent."""
    from geotrain.node.transport._wire import message_buffer

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    before = rss_mb()
    buffer = message_buffer(256 << 20)
    claimed = rss_mb()
    memoryview(buffer)[: 4 << 20] = b"\x01" * (4 << 20)  # one 4 MiB part decrypted into it
    written = rss_mb()
    assert len(buffer) == 256 << 20 and buffer[(4 << 20) - 1] == 1 and buffer[4 << 20] == 0
    assert claimed - before < 16, (before, claimed)  # not the 256 MiB it claims ...
    assert written - before < 16 + 12, (before, written)  # ... only what was written (+4 MiB)
