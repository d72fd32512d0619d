# The listening side of the transport: pipe callbacks, handshakes, frames and the request handler.
# Invariants: as _transport.py's; pipe callbacks only hand a note to the trio loop; a bad
# frame or handshake closes its own pipe only and is counted and logged.
from __future__ import annotations

from collections.abc import Callable

import pynng
import structlog
import trio

from .._log_quota import log_within_quota
from ._messages import ErrorReply, Header, HeaderDecodeError
from ._noise import (
    FRAME_KIND_PULL,
    FrameInfo,
    FrameRejected,
    HandshakeFailed,
    NoiseHandshake,
    PartInfo,
    part_bounds,
)
from ._types import PeerInfo
from ._wire import (
    HS1,
    HS2,
    HS3,
    HS_OK,
    HS_REFUSED,
    MAX_PARTIAL_MESSAGES,
    MAX_PENDING_REPLIES,
    MAX_REFUSAL_CHARS,
    _Channel,
    _close_pipe,
    _message_view,
    _OutgoingReply,
    _Partial,
)

log = structlog.get_logger()
# handshakes one connection may fail before it is closed: one connection ran ~11,800 in 8 s and
# cost the node 7.4 CPU-seconds (a refusal is answered, so an honest peer learns why)
MAX_FAILED_HANDSHAKES = 3
# a message being reassembled that got no part for this long is dropped when room is needed
# (an honest sender's parts follow each other within its deadline)
PARTIAL_IDLE_S = 30.0


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
        self.failed_handshakes = 0  # on this connection: a few are answered, then it is closed
        try:  # read while the pipe is open: once nng has closed it, its address is gone
            self.remote = str(pipe.remote_address)
        except Exception:
            self.remote = "?"


class _Inbound:
    """Serves the listening socket: handshakes, frames and the request handler."""

    def __init__(self, sock, config, creds, codec, handler, counters, token,
                 on_disconnect: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.sock, self.config, self.creds, self.codec = sock, config, creds, codec
        self.handler, self.counters, self.token = handler, counters, token
        self.on_disconnect = on_disconnect  # an authenticated peer's connection to us closed
        self.sessions: dict[int, _InboundSession] = {}
        self.closing = False  # the transport is shutting down: closed pipes are ours
        # pipes gone lately: id -> (when, whether its close was counted). nng's notes of a pipe's
        # opening and closing come from different threads and can arrive closing first (or a
        # late message brings the pipe back to pynng): a pipe here gets no new session
        self._gone: dict[int, tuple[float, bool]] = {}

    def _warn(self, event: str, session: _InboundSession, **fields: object) -> None:
        """A warning about what a connection sent, within its quota, naming the connection."""
        if session.peer is not None:
            fields["peer"] = session.peer.short_id
        else:  # (not authenticated: where it came from is all there is)
            fields["remote"] = session.remote
        log_within_quota(event, **fields)

    # -- pipe callbacks: run on nng's threads, only hand a note to the trio loop --
    def note_connect(self, pipe: pynng.Pipe) -> None:
        try:
            self.token.run_sync_soon(self._connected, pipe)
        except trio.RunFinishedError:
            pass

    def note_remove(self, pipe: pynng.Pipe) -> None:
        try:
            self.token.run_sync_soon(self._removed, pipe.id)
        except trio.RunFinishedError:
            pass

    def _removed(self, pipe_id: int) -> None:
        session = self.sessions.pop(pipe_id, None)  # (one we dropped ourselves is gone already)
        if session is not None and session.channel is None:
            self._closed_unfinished(session)
        if session is not None or pipe_id not in self._gone:  # (not one we closed ourselves)
            self._gone[pipe_id] = (trio.current_time(), session is not None)
        if session is None or session.peer is None or self.on_disconnect is None:
            return
        peer_id = session.peer.peer_id
        if any(s.peer is not None and s.peer.peer_id == peer_id for s in self.sessions.values()):
            return  # the peer is still connected (a `geotrain status` run as its identity, say)
        try:  # run_sync_soon: an exception here would take the whole trio loop down
            self.on_disconnect(peer_id)
        except Exception as exc:
            log.error("disconnect_callback_failed", error=f"{type(exc).__name__}: {exc}",
                      exc_info=True)  # fmt: skip

    def _closed_unfinished(self, session: _InboundSession) -> None:
        """A connection closed by the other end or by nng before its handshake finished."""
        if session.failed_handshakes or self.closing:
            return  # counted as its failed handshake already; or closed by our own shutdown
        # nng drops a frame over recv_max_size by closing its connection, unread: this is all
        # that shows of one (seen: 300 MB sent at a node, no counter, no log line)
        self.counters.handshakes_failed["closed"] += 1
        self._warn("handshake_failed", session, direction="inbound",
                   reason="closed: the connection closed before its handshake finished (the "
                   f"other end hung up, or sent a frame over {self.config.recv_max_size} "
                   "bytes, the most one frame may hold, which is dropped unread by closing "
                   "the connection)")  # fmt: skip

    def _connected(self, pipe: pynng.Pipe) -> _InboundSession | None:
        gone = self._gone.get(pipe.id)
        if gone is not None:  # its close came first: counted once, no session made for it
            if not gone[1]:
                self._gone[pipe.id] = (gone[0], True)
                self._closed_unfinished(_InboundSession(pipe, trio.current_time()))
            return None
        if pipe.id not in self.sessions:
            pending = [s for s in self.sessions.values() if s.channel is None]
            if len(pending) >= self.config.max_pending_handshakes:
                # the oldest one goes, not the newcomer: refusing newcomers let one stranger
                # holding the pending slots (reopening them as they expired) lock every new
                # peer out; an honest handshake takes milliseconds, a squatter's lingers
                oldest = min(pending, key=lambda s: s.started)
                self.counters.handshakes_failed["too_many_pending"] += 1
                self._warn("handshake_failed", oldest, direction="inbound",
                           reason="too_many_pending: the oldest unfinished handshake closed")
                self._drop(oldest)
            self.sessions[pipe.id] = _InboundSession(pipe, trio.current_time())
        return self.sessions[pipe.id]

    def _drop(self, session: _InboundSession) -> None:
        self._forget(session.pipe)

    def _forget(self, pipe: pynng.Pipe) -> None:
        """Close a pipe of ours, counted already (or healthy): nothing more is said of it."""
        self.sessions.pop(pipe.id, None)
        self._gone[pipe.id] = (trio.current_time(), True)
        _close_pipe(pipe)

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
                    self._forget(msg.pipe)
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
            keep = max(10.0, 2 * timeout)  # (the notes of one pipe come milliseconds apart)
            self._gone = {k: v for k, v in self._gone.items() if now - v[0] < keep}
            for session in list(self.sessions.values()):
                if session.channel is None and not _pipe_open(session.pipe):
                    # a pending connection nng closed with no note of it that found its session
                    # (one CI run in ~40 waited for the oversized frame's count in vain)
                    self._forget(session.pipe)
                    self._closed_unfinished(session)
                elif session.channel is None and now - session.started >= timeout:
                    self.counters.handshakes_failed["deadline"] += 1
                    self._warn("handshake_failed", session, direction="inbound",
                               reason="deadline")  # fmt: skip
                    self._drop(session)

    async def _on_message(self, msg: pynng.Message) -> pynng.Message | None:
        session = self.sessions.get(msg.pipe.id) or self._connected(msg.pipe)
        if session is None:
            return None
        view = _message_view(msg)
        self.counters.moved(session.peer, len(view), 0)
        try:
            if session.channel is not None:
                reply = await self._on_frame(session, view)
                # every frame out is counted here: replies, part acknowledgements, pulled parts
                self.counters.moved(session.peer, 0, len(reply._buffer))
                return reply
            if not len(view):
                raise FrameRejected("unexpected", "an empty message before the session exists")
            kind = view[0]
            if kind == HS1 and session.handshake is None:
                if session.failed_handshakes >= MAX_FAILED_HANDSHAKES:  # (each costs our CPU)
                    raise FrameRejected("handshakes", f"{session.failed_handshakes} failed "
                                        "handshakes on one connection")  # fmt: skip
                session.handshake = self.creds.handshake(initiator=False)
                session.handshake.read_message(bytes(view[1:]))
                return self._reply(session, HS2, session.handshake.write_message(self.creds.proof))
            if kind == HS3 and session.handshake is not None:
                return self._finish_handshake(session, bytes(view[1:]))
            raise FrameRejected("unexpected", f"kind {kind:#x} before the session exists")
        except FrameRejected as exc:
            self.counters.frames_rejected[exc.reason] += 1
            self._warn("frame_rejected", session, reason=exc.reason, detail=str(exc))
            self._drop(session)
        except HandshakeFailed as exc:
            session.failed_handshakes += 1
            self.counters.handshakes_failed[exc.kind] += 1
            self._warn("handshake_failed", session, direction="inbound", reason=exc.reason)
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
        peer = self.creds.judge(hs, payload, session.remote, "inbound")
        reply = self._reply(session, HS_OK, b"")  # counted before the session (per-peer: frames)
        session.channel, session.peer = _Channel(hs.split(), self.config), peer
        session.handshake = None
        self.counters.handshakes_ok += 1
        self.counters.inbound_handshakes_ok += 1
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
                log_within_quota("partial_message_dropped", "info", peer=session.peer.short_id,
                                 message=oldest)  # fmt: skip
            # every connection's messages being reassembled hold at most the budget in all:
            # each buffer is allocated whole at its first part, and three admitted connections
            # announcing 250 MiB each took a node of a 0.5 GB estimate to 1.2 GB
            self._check_reassembly(session, part.message_len)
            partial = session.partials[part.message_id] = _Partial(part)
        if (partial.part.count, partial.part.message_len) != (part.count, part.message_len):
            raise FrameRejected("part", "parts disagree on the message size")
        if part.index in partial.claimed:
            raise FrameRejected("part", f"part {part.index} sent twice")
        partial.claimed.add(part.index)
        partial.last_part_at = trio.current_time()
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

    def _check_reassembly(self, session: _InboundSession, size: int) -> None:
        """Make room for a new message of `size` bytes to reassemble, or refuse it. Messages no
        part of which came for PARTIAL_IDLE_S are dropped; a peer's own oldest ones make room
        for its new one beyond half the budget (its connections together); beyond the whole
        budget (every connection) it is refused.

        Raises:
            FrameRejected: "reassembly".
        """
        now, budget = trio.current_time(), self.config.reassembly_budget
        held, mine = 0, []
        for other in self.sessions.values():
            for key, p in list(other.partials.items()):
                if now - p.last_part_at > PARTIAL_IDLE_S:  # (abandoned, or kept for its bytes)
                    del other.partials[key]
                    continue
                held += len(p.buffer)
                if other.peer is not None and other.peer.peer_id == session.peer.peer_id:
                    mine.append((p.last_part_at, key, other))
        own = sum(len(o.partials[k].buffer) for _, k, o in mine)
        for _, key, other in sorted(mine, key=lambda m: m[0]):  # its oldest first
            if own + size <= budget // 2:
                break
            dropped = other.partials.pop(key)
            own, held = own - len(dropped.buffer), held - len(dropped.buffer)
            log_within_quota("partial_message_dropped", "info", peer=session.peer.short_id,
                             message=key, reason="the peer's share of the reassembly budget")
        if held + size > budget:
            raise FrameRejected("reassembly", f"a message of {size} bytes while {held} are being "
                                f"reassembled (at most {budget} in all)")

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
        except HeaderDecodeError as exc:
            self.counters.frames_rejected["header"] += 1
            self._warn("frame_rejected", session, reason="header", detail=exc.reason)
            reply_header, reply_payload = ErrorReply(exc.code, exc.reason[:200]), b""
        else:
            reply_header, reply_payload = await self._call_handler(session.peer, header, payload)
        self.counters.requests_served += 1
        return await self._seal_reply(session, self.codec.encode(reply_header), reply_payload)

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


def _pipe_open(pipe: pynng.Pipe) -> bool:
    """Whether nng still holds the pipe: reading an option of a closed one fails."""
    try:
        pipe.remote_address  # noqa: B018 (read for its failure)
    except (pynng.exceptions.NoEntry, pynng.exceptions.Closed):
        return False
    except Exception:  # (anything else is not taken for a close)
        pass
    return True
