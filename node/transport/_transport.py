# The secure request/response transport. This module and its parts (_wire: channels and
# credentials; _inbound: the listening side; _outbound: the dialing side) are the only modules
# that import pynng. Invariants: every socket has recv_max_size (nng's default is
# unlimited) and send/receive timeouts; no pynng exception leaves these modules; pipe callbacks
# only hand a note to the trio loop; a pipe carries at most one handshake and one session, and any
# bad frame on it closes that pipe only; nothing received is trusted before it authenticated under
# a session key; all tasks live in the nursery of `open_transport` and stop when it exits.
#
# Wire: each node listens with a Rep0 socket and dials Req0 sockets to each peer, one connection
# and session each (contexts let many requests share one; resend is off, because a resent frame
# would look like a replay). A peer gets a further connection, up to connections_per_peer, only
# when every one it has carries requests_per_connection requests already: one TCP connection
# may not fill a long fat link (its window, its slow start, a loss halving it). Before the
# session exists a message is one kind byte + body: 0x01 Noise msg 1 -> 0x02 msg 2, 0x03 msg 3 ->
# 0x04 accepted | 0x7f reason. After it, every request and reply is one encrypted frame (_noise),
# except that a request above part_bytes travels as several part frames, each answered (an empty
# acknowledgement, or the reply for the part that completed the message).
from __future__ import annotations

import atexit
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pynng
import structlog
import trio

from geotrain.gossip import is_client_address

from ..identity import Admission, Identity
from ._backoff import DialBackoff
from ._inbound import _Inbound
from ._messages import Header, HeaderCodec, HeaderDecodeError
from ._noise import HandshakeFailed
from ._outbound import _Outbound, _rpc
from ._types import Handler as Handler
from ._types import HandshakeError as HandshakeError
from ._types import ListenError as ListenError
from ._types import LocalTransportError as LocalTransportError
from ._types import PeerInfo as PeerInfo
from ._types import PeerUnreachable as PeerUnreachable
from ._types import RemoteTransportError as RemoteTransportError
from ._types import RequestTimeout as RequestTimeout
from ._types import TransportConfig as TransportConfig
from ._types import TransportError as TransportError
from ._types import TransportStatistics as TransportStatistics
from ._types import _Counters, dialable
from ._wire import (
    HS1,
    HS2,
    HS3,
    HS_OK,
    HS_REFUSED,
    MAX_REFUSAL_CHARS,
    _Channel,
    _Credentials,
    _timeout_ms,
)

log = structlog.get_logger()


def _skip_nng_fini_in_child() -> None:
    """nng is not fork-safe: a forked child (a user's os.fork after join) inherits nng's state
    without its threads, and pynng's exit handler (nng_fini) waited on them for ever, so the
    child hung at exit. The child never uses the parent's sockets: it skips that handler."""
    handler = getattr(getattr(pynng, "nng", None), "_pynng_atexit", None)
    if handler is not None:
        atexit.unregister(handler)


os.register_at_fork(after_in_child=_skip_nng_fini_in_child)


class Transport:
    """A node's secure endpoint. Made by `open_transport`; do not construct directly."""

    def __init__(self, config, creds, codec, counters, nursery, address) -> None:
        self.config, self._creds, self.codec = config, creds, codec
        self._counters, self._nursery = counters, nursery
        self.address: str = address  # the bound listen address, port 0 resolved
        self._outbound: dict[str, list[_Outbound]] = {}  # by address, each with its session
        self._dial_locks: dict[str, trio.Lock] = {}
        self._backoff = DialBackoff()
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
            LocalTransportError, PeerUnreachable (also for a client-mode peer's address, which
            is never dialled), HandshakeError, RequestTimeout, RemoteTransportError (all
            TransportError).
        """
        if self._closed:
            raise PeerUnreachable("transport is closed")
        if is_client_address(address):  # a client-mode peer (behind NAT) is reached only by its
            raise PeerUnreachable(f"{address} is a client-mode peer: nobody dials it")  # requests
        try:
            header_bytes = self.codec.encode(header)
        except TypeError as exc:
            raise LocalTransportError(str(exc)) from None
        if memoryview(payload).nbytes > self.config.max_message_bytes:
            raise LocalTransportError(
                f"payload of {memoryview(payload).nbytes} bytes exceeds max_message_bytes"
            )
        with trio.move_on_after(deadline_s) as scope:
            conn = await self._connection(address, expect_peer)
            conn.in_flight += 1
            try:
                reply = await self._exchange(conn, header_bytes, payload)
            finally:
                conn.in_flight -= 1
        if scope.cancelled_caught:
            raise RequestTimeout(f"no reply from {address} within {deadline_s} s")
        try:
            reply_header = self.codec.decode(reply[0])
        except HeaderDecodeError as exc:
            self._counters.frames_rejected["header"] += 1
            raise RemoteTransportError(f"bad reply header from {address}: {exc.reason}") from None
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

    def _usable(self, address: str) -> list[_Outbound]:
        """The live connections to `address` (one whose peer's admission ended is marked lost:
        a new handshake must pass it again)."""
        conns = self._outbound.get(address, [])
        now = self._creds.clock()
        for conn in conns:
            if now >= conn.peer.admitted_until:
                conn.lost.set()
        return [c for c in conns if not c.lost.is_set()]

    def _idlest(self, address: str) -> _Outbound | None:
        """The live connection to `address` with the fewest requests in flight, unless a new
        one should be dialled: none is live, or every one is full and there is room for more.
        (A request that finds them full waits for the connection being dialled, one dial at a
        time: it would wait as long for a slot of a full one.)"""
        conns = self._usable(address)
        if not conns:
            return None
        best = min(conns, key=lambda c: c.in_flight)
        cfg = self.config
        if best.in_flight < cfg.requests_per_connection:
            return best
        return best if len(conns) >= cfg.connections_per_peer else None

    async def _connection(self, address: str, expect_peer: str | None) -> _Outbound:
        lock = self._dial_locks.setdefault(address, trio.Lock())
        try:
            conn = self._idlest(address)
            if conn is None:
                async with lock:
                    conn = self._idlest(address)
                    if conn is None:
                        self._may_dial(address)
                        conn = await self._dial(address, expect_peer)
                        self._outbound.setdefault(address, []).append(conn)
                        self._nursery.start_soon(self._watch, conn)
        finally:
            # One lock per address while someone dials it, not one per address ever tried.
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                if self._dial_locks.get(address) is lock and not self._outbound.get(address):
                    del self._dial_locks[address]
        if expect_peer is not None and conn.peer.peer_id != expect_peer:
            raise HandshakeError(
                f"peer ID mismatch at {address}: expected {expect_peer}, "
                f"proved {conn.peer.peer_id}",
                definite=True,
            )
        return conn

    def _may_dial(self, address: str) -> None:
        """Raise instead of dialling when our certificate expired, `address` is no node's
        (not tcp://HOST:PORT: a peer's gossip named an ipc:// socket of this machine) or it is
        backed off."""
        if not dialable(address):
            raise LocalTransportError(f"not dialling {address[:100]!r}: a node dials "
                                      "tcp://HOST:PORT only")  # fmt: skip
        expires_at = self._creds.own_expiry()
        if expires_at is not None and self._creds.clock() >= expires_at:
            raise LocalTransportError(
                f"our membership certificate expired at {_utc(expires_at)}: no peer admits us; "
                "get a renewed one from the swarm operator (geotrain swarm admit) and replace the "
                "certificate file"
            )
        wait = self._backoff.wait_s(address, trio.current_time())
        if wait > 0:
            raise HandshakeError(
                f"not dialling {address} for {wait:.1f} s more: "
                f"{self._backoff.failures(address)} handshakes in a row failed"
            )

    def renew(self, admission: Admission) -> None:
        """Prove membership with a renewed credential from the next handshake on (connections
        already open keep theirs).

        Raises:
            LocalTransportError: the credential is for another swarm or another identity.
        """
        cert = admission.certificate
        if admission.prologue != self._creds.admission.prologue:
            raise LocalTransportError("renewed admission is for another swarm")
        if cert is not None and cert.peer_public_key != self._creds.identity.public_key:
            raise LocalTransportError("renewed certificate names another identity than ours")
        self._creds.renew(admission)

    @property
    def certificate_expires_at(self) -> float | None:
        """When our own membership certificate expires (POSIX seconds), or None without one."""
        return self._creds.own_expiry()

    async def _watch(self, conn: _Outbound) -> None:
        try:
            await conn.lost.wait()
            log.info("connection_lost", peer=conn.peer.short_id, address=conn.address)
        finally:
            conns = self._outbound.get(conn.address, [])
            if conn in conns:
                conns.remove(conn)
            if not conns:
                self._outbound.pop(conn.address, None)
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
                    raise _refusal(reply)
                peer = creds.judge(hs, hs.read_message(reply[1:]), address, "outbound")
                if expect_peer is not None and peer.peer_id != expect_peer:
                    raise HandshakeFailed(
                        f"peer ID mismatch: expected {expect_peer}, proved {peer.peer_id}",
                        "peer_mismatch",
                    )
                reply = await _rpc(
                    sock, bytes([HS3]) + hs.write_message(creds.proof), self._counters
                )
                if reply[:1] != bytes([HS_OK]):
                    raise _refusal(reply)
        except trio.TooSlowError:
            self._counters.handshakes_failed["deadline"] += 1
            retry = self._backoff.failed(address, trio.current_time())
            log.warning("handshake_failed", direction="outbound", address=address,
                        reason="deadline", retry_in_s=round(retry, 1))  # fmt: skip
            raise HandshakeError(f"handshake with {address} missed its deadline") from None
        except HandshakeFailed as exc:
            self._counters.handshakes_failed[exc.kind] += 1
            retry = self._backoff.failed(address, trio.current_time())
            log.warning("handshake_failed", direction="outbound", address=address,
                        reason=exc.reason, retry_in_s=round(retry, 1))  # fmt: skip
            raise HandshakeError(f"handshake with {address} failed: {exc.reason}",
                                 definite=True) from None
        self._backoff.succeeded(address)
        self._counters.handshakes_ok += 1
        log.info("handshake_ok", peer=peer.short_id, direction="outbound", address=address)
        return _Channel(hs.split(), self.config), peer

    def _close_all(self) -> None:
        self._closed = True
        for conns in list(self._outbound.values()):
            for conn in conns:
                conn.sock.close()
        self._outbound.clear()


def _utc(posix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(posix_s))


def _refusal(reply: bytes) -> HandshakeFailed:
    if reply[:1] == bytes([HS_REFUSED]):
        text = reply[1 : 1 + MAX_REFUSAL_CHARS].decode("utf-8", "replace")
        return HandshakeFailed("refused by peer: " + text, "refused")
    return HandshakeFailed(f"unexpected handshake reply (kind {reply[:1].hex() or 'empty'})")


@asynccontextmanager
async def open_transport(
    config: TransportConfig,
    identity: Identity,
    admission: Admission,
    handler: Handler,
    *,
    codec: HeaderCodec | None = None,
    clock: Callable[[], float] = time.time,
    on_disconnect: Callable[[str], None] | None = None,
) -> AsyncIterator[Transport]:
    """Listen on `config.listen` and serve requests until the block exits.

    Args:
        config: socket limits and timeouts.
        identity: this node's key; admission: who may connect, and our own credential.
        handler: called for each incoming request with the proven peer, the header and the
            payload (a memoryview valid during the call); returns (reply header, reply payload).
        codec: header types in use (the default registry of node._messages if None).
        clock: wall clock for certificate expiry (POSIX seconds).
        on_disconnect: called (in the trio loop, must not block) with a peer's ID when a
            connection that peer opened to us and authenticated on closes: the peer died, went
            away or was cut off; what it was sending us will not come.

    Raises:
        TransportError: the address cannot be listened on.
        LocalTransportError: our certificate does not name our identity.
    """
    if admission.certificate is not None and (
        admission.certificate.peer_public_key != identity.public_key
    ):
        raise LocalTransportError("admission certificate names another identity than ours")
    codec = codec or HeaderCodec(max_header_bytes=config.max_header_bytes)
    creds = _Credentials(identity, admission, clock)
    counters = _Counters()
    timeout_ms = _timeout_ms(config.io_timeout_s)
    with pynng.Rep0(
        recv_max_size=config.recv_max_size, send_timeout=timeout_ms, recv_timeout=timeout_ms
    ) as sock:
        inbound = _Inbound(
            sock, config, creds, codec, handler, counters, trio.lowlevel.current_trio_token(),
            on_disconnect,
        )
        sock.add_post_pipe_connect_cb(inbound.note_connect)
        sock.add_post_pipe_remove_cb(inbound.note_remove)
        try:
            listener = sock.listen(config.listen)
        except pynng.NNGException as exc:
            raise ListenError(f"cannot listen on {config.listen}: {exc}") from None
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
                    inbound.closing = True  # our own close drops the pending handshakes
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


# ---- baselines for the benchmarks: plain pynng, here because the transport modules own pynng ----
@asynccontextmanager
async def open_raw_pynng_pair(max_bytes: int) -> AsyncIterator[Callable[[bytes], Awaitable[None]]]:
    """A Req0->Rep0 pair over loopback with no security, for benchmarks only. Yields
    `round_trip(payload)`: send `payload` one way with pynng's ordinary bytes API, 2 bytes back."""
    async with open_raw_pynng_exchange(max_bytes, in_flight=1) as exchange:

        async def round_trip(payload: bytes) -> None:
            await exchange(payload, 2)

        yield round_trip


@asynccontextmanager
async def open_raw_pynng_exchange(
    max_bytes: int, in_flight: int
) -> AsyncIterator[Callable[[bytes, int], Awaitable[None]]]:
    """Like open_raw_pynng_pair, but `exchange(payload, reply_bytes)` gets `reply_bytes` back, and
    up to `in_flight` requests may run at once (one nng context each on both ends)."""
    limit = max_bytes + 1024
    opts = {"recv_max_size": limit, "recv_timeout": 600_000, "send_timeout": 600_000}
    with pynng.Rep0(**opts) as rep, pynng.Req0(**opts) as req:
        listener = rep.listen("tcp://127.0.0.1:0")
        req.dial(_bound_address("tcp://127.0.0.1:0", str(listener.local_address)), block=True)
        reply = bytes(max_bytes)

        async def serve() -> None:
            with rep.new_context() as ctx:
                while True:
                    data = await ctx.arecv()
                    await ctx.asend(reply[: int.from_bytes(data[:8], "big")])

        async def exchange(payload: bytes, reply_bytes: int) -> None:
            with req.new_context() as ctx:
                await ctx.asend(reply_bytes.to_bytes(8, "big") + payload)
                await ctx.arecv()

        async with trio.open_nursery() as nursery:
            for _ in range(in_flight):
                nursery.start_soon(serve)
            yield exchange
            nursery.cancel_scope.cancel()
