# The dialing side of the transport: one Req0 socket per peer address and its session, single and
# multi-part requests, pulling the parts of a big reply. Invariants: as node/_transport.py's; a
# connection that saw a bad frame is marked lost and redialed by the next request.
from __future__ import annotations

import functools

import pynng
import structlog
import trio

from ._noise import FRAME_KIND_PART, FRAME_KIND_PULL, FrameRejected, PartInfo, part_bounds
from ._types import PeerInfo, RemoteTransportError, _Counters
from ._wire import MAX_PARTIAL_MESSAGES, _Channel, _message_view, _run_all, message_buffer

log = structlog.get_logger()


class _Outbound:
    """One dialed Req0 socket to one address and its established session."""

    def __init__(self, address: str, sock: pynng.Req0, channel: _Channel, peer: PeerInfo):
        self.address, self.sock, self.channel, self.peer = address, sock, channel, peer
        self.lost = trio.Event()
        self.multipart_slots = trio.Semaphore(MAX_PARTIAL_MESSAGES)
        self.in_flight = 0  # requests on this connection now (the transport spreads them)

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
            raise RemoteTransportError(f"{len(replies)} replies to one multi-part request")
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
            buffer = message_buffer(info.part.message_len)  # (taken as the parts come)
            lo, hi = part_bounds(info.part.message_len, info.part.count, 0)
            header, _ = await self.channel.open(view, info, memoryview(buffer)[lo:hi])
            return await self._pull_rest(header, info.part, buffer, counters)
        except FrameRejected as exc:
            counters.frames_rejected[exc.reason] += 1
            log.warning("frame_rejected", peer=self.peer.short_id, reason=exc.reason)
            self.lost.set()
            reason = f"bad reply frame from {self.peer.short_id}: {exc}"
            raise RemoteTransportError(reason) from None


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
