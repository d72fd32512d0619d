# The secure request/response transport: the only module that imports pynng. Invariants: every
# socket has recv_max_size (nng's default is unlimited) and send/receive timeouts; no pynng
# exception leaves this module; pipe callbacks only hand a note to the trio loop; a pipe carries at
# most one handshake and one session, and any bad frame on it closes that pipe only; nothing
# received is trusted before it authenticated under a session key; all tasks live in the nursery
# of `open_transport` and stop when it exits.
#
# Wire: each node listens with a Rep0 socket and dials one Req0 socket per peer (contexts let many
# requests share it; resend is off, because a resent frame would look like a replay). Before the
# session exists a message is one kind byte + body: 0x01 Noise msg 1 -> 0x02 msg 2, 0x03 msg 3 ->
# 0x04 accepted | 0x7f reason. After it, every request and reply is one encrypted frame (_noise),
# except that a request above part_bytes travels as several part frames, each answered (an empty
# acknowledgement, or the reply for the part that completed the message).
from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pynng
import structlog
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ._admission import Admission, AdmissionRefused
from ._identity import Identity, peer_id_from_public_key
from ._messages import DecodeError, ErrorReply, Header, HeaderCodec
from ._noise import (
    FRAME_KIND_PART,
    FRAME_KIND_PULL,
    FrameInfo,
    FrameReceiver,
    FrameRejected,
    FrameSender,
    HandshakeFailed,
    NoiseHandshake,
    PartInfo,
    check_identity_proof,
    frame_length,
    make_identity_proof,
    open_frame,
    parse_frame_prefix,
    part_bounds,
    seal_frame_into,
)
from ._transport_types import Handler as Handler
from ._transport_types import HandshakeError as HandshakeError
from ._transport_types import LocalProtocolError as LocalProtocolError
from ._transport_types import PeerInfo as PeerInfo
from ._transport_types import PeerUnreachable as PeerUnreachable
from ._transport_types import RemoteProtocolError as RemoteProtocolError
from ._transport_types import RequestTimeout as RequestTimeout
from ._transport_types import TransportConfig as TransportConfig
from ._transport_types import TransportError as TransportError
from ._transport_types import TransportStatistics as TransportStatistics
from ._transport_types import _Counters

HS1, HS2, HS3, HS_OK, HS_REFUSED = 0x01, 0x02, 0x03, 0x04, 0x7F
MAX_REFUSAL_CHARS = 200
# Multi-part requests in flight per connection: the sender waits for a slot, the receiver drops
# the oldest partial message beyond it (only a cancelled request leaves one behind). Bounds the
# receiver's reassembly memory to this many times max_message_bytes per connection.
MAX_PARTIAL_MESSAGES = 2
# Big replies kept per connection until their parts are pulled; the oldest (left by a requester
# that gave up) is dropped beyond it. They hold references to the handler's payloads, no copies.
MAX_PENDING_REPLIES = 16
log = structlog.get_logger()


def _timeout_ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _new_message(size: int) -> tuple[pynng.Message, memoryview]:
    """An nng message with an uninitialised body of `size` bytes, and a writable view of it, so
    frames are sealed straight into the socket's buffer (no extra copy of big payloads)."""
    msg_p = pynng.ffi.new("nng_msg **")
    pynng.check_err(pynng.lib.nng_msg_alloc(msg_p, size))
    msg = pynng.Message(msg_p[0])
    return msg, memoryview(msg._buffer).cast("B")


def _message_view(msg: pynng.Message) -> memoryview:
    return memoryview(msg._buffer).cast("B")


class _Channel:
    """Keys and counters of one established session, plus sealing/opening with offload."""

    def __init__(self, keys: tuple[bytes, bytes], config: TransportConfig) -> None:
        self.sender = FrameSender(keys[0])
        self.receiver = FrameReceiver(keys[1], config.replay_window)
        self.config = config
        self.next_message_id = 0

    async def seal(
        self,
        header: bytes,
        payload: bytes | memoryview,
        part: PartInfo | None = None,
        kind: int | None = None,
    ) -> pynng.Message:
        counter = self.sender.next_counter()
        n = memoryview(payload).nbytes
        msg, view = _new_message(frame_length(len(header), n, part is not None))
        args = (self.sender.aead, counter, header, payload, view, part, kind)
        if n >= self.config.offload_bytes:
            await trio.to_thread.run_sync(seal_frame_into, *args)
        else:
            seal_frame_into(*args)
        return msg

    def check(self, frame: memoryview) -> FrameInfo:
        """Parse and bound a frame's prefix and check its counter. Raises FrameRejected."""
        cfg = self.config
        info = parse_frame_prefix(frame, cfg.max_header_bytes, cfg.max_message_bytes)
        self.receiver.window.check(info.counter)
        return info

    async def open(
        self, frame: memoryview, info: FrameInfo | None = None, out: memoryview | None = None
    ) -> tuple[bytes, bytearray | None]:
        """Raises FrameRejected; the replay window only moves for authentic frames."""
        info = info or self.check(frame)
        args = (self.receiver.aead, info, frame, out)
        if info.payload_len >= self.config.offload_bytes:
            result = await trio.to_thread.run_sync(open_frame, *args)
        else:
            result = open_frame(*args)
        self.receiver.window.accept(info.counter)
        return result


class _OutgoingReply:
    """A big reply waiting for the requester to pull its parts 1..count-1."""

    def __init__(self, payload: bytes | memoryview, count: int) -> None:
        self.payload = memoryview(payload).cast("B")
        self.count = count
        self.pulled: set[int] = set()


class _Partial:
    """A multi-part request being reassembled (decrypted straight into its final buffer)."""

    def __init__(self, part: PartInfo) -> None:
        self.part = part
        self.buffer = bytearray(part.message_len)
        self.claimed: set[int] = set()
        self.done = 0
        self.header: bytes | None = None


class _Credentials:
    """What this node proves in every handshake, and how it judges the other side."""

    def __init__(self, identity: Identity, admission: Admission, clock: Callable[[], float]):
        self.identity = identity
        self.admission = admission
        self.clock = clock
        self.static_key = X25519PrivateKey.generate()
        static_pub = self.static_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.proof = make_identity_proof(identity, static_pub, admission.credential())

    def handshake(self, initiator: bool) -> NoiseHandshake:
        return NoiseHandshake(initiator, self.static_key, self.admission.prologue)

    def judge(self, hs: NoiseHandshake, payload: bytes, address: str, direction) -> PeerInfo:
        """Check a peer's proof and admission. Raises HandshakeFailed."""
        proof = check_identity_proof(payload, hs.remote_static)
        try:
            until = self.admission.check(proof.identity_key, proof.credential, self.clock())
        except AdmissionRefused as exc:
            raise HandshakeFailed(f"admission refused: {exc.reason}") from None
        peer_id = peer_id_from_public_key(proof.identity_key)
        return PeerInfo(peer_id, proof.identity_key, address, direction, until)


async def _run_all(jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run jobs concurrently; on failure raise the first real error itself, not a group (a
    cancellation of the caller is left to propagate as trio wants)."""
    try:
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)
    except BaseExceptionGroup as group:
        errors = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if errors:
            raise errors[0] from None
        raise


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


def _handshake_failure_kind(reason: str) -> str:
    if reason.startswith("admission refused"):
        return "admission"
    if reason.startswith("peer ID mismatch"):
        return "peer_mismatch"
    if reason.startswith("channel key is not signed") or reason.startswith("malformed identity"):
        return "proof"
    return "noise"


def _close_pipe(pipe: pynng.Pipe) -> None:
    try:
        pipe.close()
    except pynng.NNGException:  # already gone
        pass


class _InboundSession:
    def __init__(self, pipe: pynng.Pipe, started: float) -> None:
        self.pipe = pipe
        self.started = started
        self.handshake: NoiseHandshake | None = None
        self.channel: _Channel | None = None
        self.peer: PeerInfo | None = None
        self.partials: dict[int, _Partial] = {}
        self.replies: dict[int, _OutgoingReply] = {}
        self.next_reply_id = 0


class _Inbound:
    """Serves the listening socket: handshakes, frames and the request handler."""

    def __init__(self, sock, config, creds, codec, handler, counters, token) -> None:
        self.sock, self.config, self.creds, self.codec = sock, config, creds, codec
        self.handler, self.counters, self.token = handler, counters, token
        self.sessions: dict[int, _InboundSession] = {}

    # -- pipe callbacks: run on nng's threads, only hand a note to the trio loop --
    def note_connect(self, pipe: pynng.Pipe) -> None:
        try:
            self.token.run_sync_soon(self._connected, pipe)
        except trio.RunFinishedError:
            pass

    def note_remove(self, pipe: pynng.Pipe) -> None:
        try:
            self.token.run_sync_soon(self.sessions.pop, pipe.id, None)
        except trio.RunFinishedError:
            pass

    def _connected(self, pipe: pynng.Pipe) -> _InboundSession | None:
        if pipe.id not in self.sessions:
            pending = sum(1 for s in self.sessions.values() if s.channel is None)
            if pending >= self.config.max_pending_handshakes:
                self.counters.handshakes_failed["too_many_pending"] += 1
                log.warning("handshake_failed", direction="inbound", reason="too_many_pending")
                _close_pipe(pipe)
                return None
            self.sessions[pipe.id] = _InboundSession(pipe, trio.current_time())
        return self.sessions[pipe.id]

    def _drop(self, session: _InboundSession) -> None:
        self.sessions.pop(session.pipe.id, None)
        _close_pipe(session.pipe)

    async def serve(self) -> None:
        """One worker: receive a message on its own context, answer it, repeat."""
        ctx = self.sock.new_context()
        try:
            while True:
                try:
                    msg = await ctx.arecv_msg()
                except pynng.Timeout:
                    continue
                except pynng.NNGException:  # closed: the transport is shutting down
                    return
                try:
                    reply = await self._on_message(msg)
                except Exception:  # a bug of ours: drop this connection, keep serving others
                    log.exception("inbound_message_failed")
                    self.sessions.pop(msg.pipe.id, None)
                    _close_pipe(msg.pipe)
                    continue
                if reply is None:
                    continue
                try:
                    await ctx.asend_msg(reply)
                except pynng.NNGException as exc:
                    log.info("reply_not_sent", error=str(exc))
        finally:
            ctx.close()

    async def sweep(self) -> None:
        """Close pipes whose handshake did not finish within handshake_timeout_s."""
        timeout = self.config.handshake_timeout_s
        while True:
            await trio.sleep(min(1.0, timeout / 4))
            now = trio.current_time()
            for session in list(self.sessions.values()):
                if session.channel is None and now - session.started >= timeout:
                    self.counters.handshakes_failed["deadline"] += 1
                    log.warning("handshake_failed", direction="inbound", reason="deadline")
                    self._drop(session)

    async def _on_message(self, msg: pynng.Message) -> pynng.Message | None:
        session = self.sessions.get(msg.pipe.id) or self._connected(msg.pipe)
        if session is None:
            return None
        view = _message_view(msg)
        self.counters.moved(session.peer, len(view), 0)
        try:
            if session.channel is not None:
                return await self._on_frame(session, view)
            kind = view[0] if len(view) else -1
            if kind == HS1 and session.handshake is None:
                session.handshake = self.creds.handshake(initiator=False)
                session.handshake.read_message(bytes(view[1:]))
                return self._reply(session, HS2, session.handshake.write_message(self.creds.proof))
            if kind == HS3 and session.handshake is not None:
                return self._finish_handshake(session, bytes(view[1:]))
            raise FrameRejected("unexpected", f"kind {kind:#x} before the session exists")
        except FrameRejected as exc:
            self.counters.frames_rejected[exc.reason] += 1
            peer = session.peer.short_id if session.peer else None
            log.warning("frame_rejected", peer=peer, reason=exc.reason, detail=str(exc))
            self._drop(session)
        except HandshakeFailed as exc:
            self.counters.handshakes_failed[_handshake_failure_kind(exc.reason)] += 1
            log.warning("handshake_failed", direction="inbound", reason=exc.reason)
            session.handshake = None
            refusal = exc.reason.encode("utf-8", "replace")[:MAX_REFUSAL_CHARS]
            return self._reply(session, HS_REFUSED, refusal)
        return None

    def _reply(self, session: _InboundSession, kind: int, body: bytes) -> pynng.Message:
        self.counters.moved(session.peer, 0, 1 + len(body))
        return pynng.Message(bytes([kind]) + body)

    def _finish_handshake(self, session: _InboundSession, message: bytes) -> pynng.Message:
        hs = session.handshake
        payload = hs.read_message(message)
        peer = self.creds.judge(hs, payload, str(session.pipe.remote_address), "inbound")
        reply = self._reply(session, HS_OK, b"")  # counted before the session (per-peer: frames)
        session.channel, session.peer = _Channel(hs.split(), self.config), peer
        session.handshake = None
        self.counters.handshakes_ok += 1
        log.info("handshake_ok", peer=peer.short_id, direction="inbound")
        return reply

    async def _on_part(self, session: _InboundSession, view: memoryview, info: FrameInfo):
        """Decrypt one part into its message; the message when it is complete, else None."""
        part = info.part
        partial = session.partials.get(part.message_id)
        if partial is None:
            if len(session.partials) >= MAX_PARTIAL_MESSAGES:
                oldest = min(session.partials)
                del session.partials[oldest]
                log.info("partial_message_dropped", peer=session.peer.short_id, message=oldest)
            partial = session.partials[part.message_id] = _Partial(part)
        if (partial.part.count, partial.part.message_len) != (part.count, part.message_len):
            raise FrameRejected("part", "parts disagree on the message size")
        if part.index in partial.claimed:
            raise FrameRejected("part", f"part {part.index} sent twice")
        partial.claimed.add(part.index)
        lo, hi = part_bounds(part.message_len, part.count, part.index)
        header, _ = await session.channel.open(view, info, memoryview(partial.buffer)[lo:hi])
        if header:
            partial.header = header
        partial.done += 1
        if partial.done < part.count:
            return None
        session.partials.pop(part.message_id, None)
        if partial.header is None:
            raise FrameRejected("part", "no part carried the header")
        return partial.header, partial.buffer

    async def _seal_reply(self, session: _InboundSession, header: bytes, payload) -> pynng.Message:
        """A reply frame; a big payload is stored and only its first part sent (pull the rest)."""
        n = memoryview(payload).nbytes
        if n <= self.config.part_bytes:
            return await session.channel.seal(header, payload)
        count = -(-n // self.config.part_bytes)
        reply_id = session.next_reply_id
        session.next_reply_id += 1
        if len(session.replies) >= MAX_PENDING_REPLIES:
            del session.replies[min(session.replies)]
        stored = session.replies[reply_id] = _OutgoingReply(payload, count)
        lo, hi = part_bounds(n, count, 0)
        part = PartInfo(reply_id, 0, count, n)
        return await session.channel.seal(header, stored.payload[lo:hi], part)

    async def _on_pull(self, session: _InboundSession, view: memoryview, info: FrameInfo):
        await session.channel.open(view, info)  # authenticate the (empty) pull request
        want = info.part
        stored = session.replies.get(want.message_id)
        if (
            stored is None
            or (want.count, want.message_len) != (stored.count, len(stored.payload))
            or want.index in stored.pulled
        ):
            raise FrameRejected("part", f"pull of unknown reply part {want.index}")
        stored.pulled.add(want.index)
        if len(stored.pulled) == stored.count - 1:
            del session.replies[want.message_id]
        lo, hi = part_bounds(want.message_len, want.count, want.index)
        return await session.channel.seal(b"", stored.payload[lo:hi], want)

    async def _on_frame(self, session: _InboundSession, view: memoryview) -> pynng.Message:
        if self.creds.clock() >= session.peer.admitted_until:
            raise FrameRejected("expired", "the peer's admission expired during the session")
        info = session.channel.check(view)
        if info.kind == FRAME_KIND_PULL:
            return await self._on_pull(session, view, info)
        if info.part is None:
            header_bytes, payload = await session.channel.open(view, info)
        else:
            message = await self._on_part(session, view, info)
            if message is None:  # acknowledge a part with an empty header
                return await session.channel.seal(b"", b"")
            header_bytes, payload = message
        try:
            header = self.codec.decode(header_bytes)
        except DecodeError as exc:
            self.counters.frames_rejected["header"] += 1
            log.warning(
                "frame_rejected", peer=session.peer.short_id, reason="header", detail=exc.reason
            )
            code = "bad_request"
            if exc.reason.startswith("unknown message type"):
                code = "unknown_type"
            elif exc.reason.startswith("unsupported protocol version"):
                code = "unsupported_version"
            reply_header, reply_payload = ErrorReply(code, exc.reason[:200]), b""
        else:
            reply_header, reply_payload = await self._call_handler(session.peer, header, payload)
        self.counters.requests_served += 1
        reply = await self._seal_reply(session, self.codec.encode(reply_header), reply_payload)
        self.counters.moved(session.peer, 0, len(reply._buffer))
        return reply

    async def _call_handler(self, peer: PeerInfo, header: Header, payload: bytearray):
        try:
            reply_header, reply_payload = await self.handler(peer, header, memoryview(payload))
            if type(reply_header) not in self.codec.types:
                raise TypeError(f"handler returned unregistered header {reply_header!r}")
            if memoryview(reply_payload).nbytes > self.config.max_message_bytes:
                raise ValueError("handler returned a payload above max_message_bytes")
        except Exception:
            log.exception("handler_failed", peer=peer.short_id, header=type(header).__name__)
            return ErrorReply("internal", "the handler failed"), b""
        return reply_header, reply_payload


class _Outbound:
    """One dialed Req0 socket to one address and its established session."""

    def __init__(self, address: str, sock: pynng.Req0, channel: _Channel, peer: PeerInfo):
        self.address, self.sock, self.channel, self.peer = address, sock, channel, peer
        self.lost = trio.Event()
        self.multipart_slots = trio.Semaphore(MAX_PARTIAL_MESSAGES)

    async def exchange(
        self, header: bytes, payload: bytes | memoryview, counters: _Counters
    ) -> tuple[bytes, bytearray]:
        n, cfg = memoryview(payload).nbytes, self.channel.config
        if n <= cfg.part_bytes:
            return await self._round_trip(await self.channel.seal(header, payload), counters)
        async with self.multipart_slots:
            return await self._exchange_parts(header, payload, counters)

    async def _exchange_parts(self, header, payload, counters) -> tuple[bytes, bytearray]:
        n, cfg = memoryview(payload).nbytes, self.channel.config
        count = -(-n // cfg.part_bytes)
        message_id = self.channel.next_message_id
        self.channel.next_message_id += 1
        view, replies = memoryview(payload).cast("B"), []
        slots = trio.Semaphore(cfg.parts_in_flight)

        async def send_part(index: int) -> None:
            async with slots:
                lo, hi = part_bounds(n, count, index)
                part = PartInfo(message_id, index, count, n)
                hdr = header if index == count - 1 else b""
                msg = await self.channel.seal(hdr, view[lo:hi], part)
                reply = await self._round_trip(msg, counters)
                if reply[0]:
                    replies.append(reply)

        await _run_all([functools.partial(send_part, index) for index in range(count)])
        if len(replies) != 1:
            self.lost.set()
            raise RemoteProtocolError(f"{len(replies)} replies to one multi-part request")
        return replies[0]

    async def _send_receive(self, msg: pynng.Message, counters: _Counters) -> pynng.Message:
        """One request/reply on its own context. Keep the reply alive while its view is used."""
        counters.moved(self.peer, 0, len(msg._buffer))
        ctx = self.sock.new_context()
        try:
            await ctx.asend_msg(msg)
            reply = await ctx.arecv_msg()
        finally:
            ctx.close()
        counters.moved(self.peer, len(reply._buffer), 0)
        return reply

    async def _pull_rest(self, header: bytes, first: PartInfo, buffer: bytearray, counters):
        """Fetch parts 1.. of a big reply whose part 0 is already in `buffer`."""
        out = memoryview(buffer)
        slots = trio.Semaphore(self.channel.config.parts_in_flight)

        async def pull(index: int) -> None:
            async with slots:
                want = PartInfo(first.message_id, index, first.count, first.message_len)
                request = await self.channel.seal(b"", b"", want, FRAME_KIND_PULL)
                reply = await self._send_receive(request, counters)
                view = _message_view(reply)
                got = self.channel.check(view)
                if got.kind != FRAME_KIND_PART or got.part != want:
                    raise FrameRejected("part", f"asked for part {index}, got another frame")
                lo, hi = part_bounds(want.message_len, want.count, index)
                await self.channel.open(view, got, out[lo:hi])

        await _run_all([functools.partial(pull, i) for i in range(1, first.count)])
        return header, buffer

    async def _round_trip(self, msg: pynng.Message, counters: _Counters):
        reply = await self._send_receive(msg, counters)
        view = _message_view(reply)
        try:
            info = self.channel.check(view)
            if info.part is None:
                return await self.channel.open(view, info)
            if info.kind != FRAME_KIND_PART or info.part.index != 0:
                raise FrameRejected("part", "a reply must start with its part 0")
            buffer = bytearray(info.part.message_len)
            lo, hi = part_bounds(info.part.message_len, info.part.count, 0)
            header, _ = await self.channel.open(view, info, memoryview(buffer)[lo:hi])
            return await self._pull_rest(header, info.part, buffer, counters)
        except FrameRejected as exc:
            counters.frames_rejected[exc.reason] += 1
            log.warning("frame_rejected", peer=self.peer.short_id, reason=exc.reason)
            self.lost.set()
            raise RemoteProtocolError(f"bad reply frame from {self.peer.short_id}: {exc}") from None


async def _rpc(sock: pynng.Req0, data: bytes, counters: _Counters) -> bytes:
    ctx = sock.new_context()
    try:
        await ctx.asend(data)
        counters.moved(None, 0, len(data))
        reply = await ctx.arecv()
        counters.moved(None, len(reply), 0)
        return reply
    finally:
        ctx.close()


class Transport:
    """A node's secure endpoint. Made by `open_transport`; do not construct directly."""

    def __init__(self, config, creds, codec, counters, nursery, address) -> None:
        self.config, self._creds, self.codec = config, creds, codec
        self._counters, self._nursery = counters, nursery
        self.address: str = address  # the bound listen address, port 0 resolved
        self._outbound: dict[str, _Outbound] = {}
        self._dial_locks: dict[str, trio.Lock] = {}
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._creds.identity.peer_id

    def statistics(self) -> TransportStatistics:
        """Counters since the transport opened (a frozen snapshot)."""
        return self._counters.snapshot()

    async def request(
        self,
        address: str,
        header: Header,
        payload: bytes | bytearray | memoryview = b"",
        *,
        deadline_s: float,
        expect_peer: str | None = None,
    ) -> tuple[Header, bytearray, PeerInfo]:
        """Send one request and wait for its reply. Safe to call from many tasks at once.

        Args:
            address: the peer's listen URL, e.g. "tcp://10.0.0.2:7000".
            header: a registered Header; payload: raw bytes (e.g. a compress/ payload).
            deadline_s: the whole request (connect, handshake, send, reply) must finish by then.
            expect_peer: the peer ID that must answer at `address`; anyone admitted if None.

        Returns:
            (reply header, reply payload, the proven peer). An ErrorReply header is returned,
            not raised: the peer answered.

        Raises:
            LocalProtocolError, PeerUnreachable, HandshakeError, RequestTimeout,
            RemoteProtocolError (all TransportError).
        """
        if self._closed:
            raise PeerUnreachable("transport is closed")
        try:
            header_bytes = self.codec.encode(header)
        except TypeError as exc:
            raise LocalProtocolError(str(exc)) from None
        if memoryview(payload).nbytes > self.config.max_message_bytes:
            raise LocalProtocolError(
                f"payload of {memoryview(payload).nbytes} bytes exceeds max_message_bytes"
            )
        with trio.move_on_after(deadline_s) as scope:
            conn = await self._connection(address, expect_peer)
            reply = await self._exchange(conn, header_bytes, payload)
        if scope.cancelled_caught:
            raise RequestTimeout(f"no reply from {address} within {deadline_s} s")
        try:
            reply_header = self.codec.decode(reply[0])
        except DecodeError as exc:
            self._counters.frames_rejected["header"] += 1
            raise RemoteProtocolError(f"bad reply header from {address}: {exc.reason}") from None
        return reply_header, reply[1], conn.peer

    async def _exchange(self, conn: _Outbound, header: bytes, payload) -> tuple[bytes, bytearray]:
        self._counters.requests_sent += 1
        try:
            return await conn.exchange(header, payload, self._counters)
        except pynng.Timeout:
            raise RequestTimeout(f"nng timeout talking to {conn.address}") from None
        except pynng.NNGException as exc:
            conn.lost.set()
            await trio.lowlevel.checkpoint()  # a pending cancellation wins over "closed"
            raise PeerUnreachable(f"connection to {conn.address} lost: {exc}") from None

    async def _connection(self, address: str, expect_peer: str | None) -> _Outbound:
        lock = self._dial_locks.setdefault(address, trio.Lock())
        try:
            async with lock:
                conn = self._outbound.get(address)
                if conn is not None and self._creds.clock() >= conn.peer.admitted_until:
                    conn.lost.set()  # admission ended: a new handshake must pass it again
                if conn is None or conn.lost.is_set():
                    conn = await self._dial(address, expect_peer)
                    self._outbound[address] = conn
                    self._nursery.start_soon(self._watch, conn)
        finally:
            # One lock per address while someone dials it, not one per address ever tried.
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                if self._dial_locks.get(address) is lock and address not in self._outbound:
                    del self._dial_locks[address]
        if expect_peer is not None and conn.peer.peer_id != expect_peer:
            raise HandshakeError(
                f"peer ID mismatch at {address}: expected {expect_peer}, proved {conn.peer.peer_id}"
            )
        return conn

    async def _watch(self, conn: _Outbound) -> None:
        try:
            await conn.lost.wait()
            log.info("connection_lost", peer=conn.peer.short_id, address=conn.address)
        finally:
            if self._outbound.get(conn.address) is conn:
                del self._outbound[conn.address]
                lock = self._dial_locks.get(conn.address)
                if lock is not None and not lock.locked():
                    del self._dial_locks[conn.address]
            conn.sock.close()

    def _new_req_socket(self) -> pynng.Req0:
        cfg = self.config
        sock = pynng.Req0(
            recv_max_size=cfg.recv_max_size,
            send_timeout=_timeout_ms(cfg.io_timeout_s),
            recv_timeout=_timeout_ms(cfg.io_timeout_s),
        )
        sock.resend_time = -1  # never resend: a resent frame would be (rightly) a replay
        # No silent redial either: a new pipe has no session. A lost connection is closed and the
        # next request dials afresh.
        sock.reconnect_time_min = sock.reconnect_time_max = _timeout_ms(cfg.io_timeout_s)
        return sock

    async def _dial(self, address: str, expect_peer: str | None) -> _Outbound:
        sock = self._new_req_socket()
        lost = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def note_remove(_pipe: pynng.Pipe) -> None:  # nng thread: only record
            try:
                token.run_sync_soon(lost.set)
            except trio.RunFinishedError:
                pass

        try:
            sock.add_post_pipe_remove_cb(note_remove)
            await trio.to_thread.run_sync(
                lambda: sock.dial(address, block=True), abandon_on_cancel=True
            )
            channel, peer = await self._client_handshake(sock, address, expect_peer)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, pynng.NNGException):
                raise PeerUnreachable(f"cannot connect to {address}: {exc}") from None
            raise
        conn = _Outbound(address, sock, channel, peer)
        conn.lost = lost
        return conn

    async def _client_handshake(self, sock, address, expect_peer) -> tuple[_Channel, PeerInfo]:
        creds = self._creds
        try:
            with trio.fail_after(self.config.handshake_timeout_s):
                hs = creds.handshake(initiator=True)
                reply = await _rpc(sock, bytes([HS1]) + hs.write_message(b""), self._counters)
                if reply[:1] != bytes([HS2]):
                    raise HandshakeFailed(_refusal(reply))
                peer = creds.judge(hs, hs.read_message(reply[1:]), address, "outbound")
                if expect_peer is not None and peer.peer_id != expect_peer:
                    raise HandshakeFailed(
                        f"peer ID mismatch: expected {expect_peer}, proved {peer.peer_id}"
                    )
                reply = await _rpc(
                    sock, bytes([HS3]) + hs.write_message(creds.proof), self._counters
                )
                if reply[:1] != bytes([HS_OK]):
                    raise HandshakeFailed(_refusal(reply))
        except trio.TooSlowError:
            self._counters.handshakes_failed["deadline"] += 1
            log.warning(
                "handshake_failed", direction="outbound", address=address, reason="deadline"
            )
            raise HandshakeError(f"handshake with {address} missed its deadline") from None
        except HandshakeFailed as exc:
            self._counters.handshakes_failed[_handshake_failure_kind(exc.reason)] += 1
            log.warning(
                "handshake_failed", direction="outbound", address=address, reason=exc.reason
            )
            raise HandshakeError(f"handshake with {address} failed: {exc.reason}") from None
        self._counters.handshakes_ok += 1
        log.info("handshake_ok", peer=peer.short_id, direction="outbound", address=address)
        return _Channel(hs.split(), self.config), peer

    def _close_all(self) -> None:
        self._closed = True
        for conn in list(self._outbound.values()):
            conn.sock.close()
        self._outbound.clear()


def _refusal(reply: bytes) -> str:
    if reply[:1] == bytes([HS_REFUSED]):
        return "refused by peer: " + reply[1 : 1 + MAX_REFUSAL_CHARS].decode("utf-8", "replace")
    return f"unexpected handshake reply (kind {reply[:1].hex() or 'empty'})"


@asynccontextmanager
async def open_transport(
    config: TransportConfig,
    identity: Identity,
    admission: Admission,
    handler: Handler,
    *,
    codec: HeaderCodec | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[Transport]:
    """Listen on `config.listen` and serve requests until the block exits.

    Args:
        config: socket limits and timeouts.
        identity: this node's key; admission: who may connect, and our own credential.
        handler: called for each incoming request with the proven peer, the header and the
            payload (a memoryview valid during the call); returns (reply header, reply payload).
        codec: header types in use (the default registry of node._messages if None).
        clock: wall clock for certificate expiry (POSIX seconds).

    Raises:
        TransportError: the address cannot be listened on.
        LocalProtocolError: our certificate does not name our identity.
    """
    if admission.certificate is not None and (
        admission.certificate.peer_public_key != identity.public_key
    ):
        raise LocalProtocolError("admission certificate names another identity than ours")
    codec = codec or HeaderCodec(max_header_bytes=config.max_header_bytes)
    creds = _Credentials(identity, admission, clock)
    counters = _Counters()
    timeout_ms = _timeout_ms(config.io_timeout_s)
    with pynng.Rep0(
        recv_max_size=config.recv_max_size, send_timeout=timeout_ms, recv_timeout=timeout_ms
    ) as sock:
        inbound = _Inbound(
            sock, config, creds, codec, handler, counters, trio.lowlevel.current_trio_token()
        )
        sock.add_post_pipe_connect_cb(inbound.note_connect)
        sock.add_post_pipe_remove_cb(inbound.note_remove)
        try:
            listener = sock.listen(config.listen)
        except pynng.NNGException as exc:
            raise TransportError(f"cannot listen on {config.listen}: {exc}") from None
        address = _bound_address(config.listen, str(listener.local_address))
        transport = None
        try:
            async with trio.open_nursery() as nursery:
                transport = Transport(config, creds, codec, counters, nursery, address)
                for _ in range(config.max_inbound_requests):
                    nursery.start_soon(inbound.serve)
                nursery.start_soon(inbound.sweep)
                log.info("transport_listening", address=address, peer=identity.short_id)
                try:
                    yield transport
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if transport is not None:
                transport._close_all()


def _bound_address(requested: str, local: str) -> str:
    """The URL peers should dial: the requested one with the port actually bound."""
    scheme, _, rest = requested.partition("://")
    if scheme.startswith("tcp") and ":" in local:
        host = rest.rsplit(":", 1)[0]
        return f"{scheme}://{host}:{local.rsplit(':', 1)[1]}"
    return requested


# ---- baseline for node.bench: plain pynng, here because this module alone owns pynng ----------
@asynccontextmanager
async def open_raw_pynng_pair(max_bytes: int) -> AsyncIterator[Callable[[bytes], Awaitable[None]]]:
    """A Req0->Rep0 pair over loopback with no security, for benchmarks only. Yields
    `round_trip(payload)`: send `payload` one way with pynng's ordinary bytes API, 2 bytes back."""
    limit = max_bytes + 1024
    opts = {"recv_max_size": limit, "recv_timeout": 600_000, "send_timeout": 600_000}
    with pynng.Rep0(**opts) as rep, pynng.Req0(**opts) as req:
        listener = rep.listen("tcp://127.0.0.1:0")
        req.dial(_bound_address("tcp://127.0.0.1:0", str(listener.local_address)), block=True)

        async def echo() -> None:
            while True:
                await rep.arecv()
                await rep.asend(b"ok")

        async def round_trip(payload: bytes) -> None:
            await req.asend(payload)
            await req.arecv()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            yield round_trip
            nursery.cancel_scope.cancel()
