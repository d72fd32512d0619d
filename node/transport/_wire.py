# The transport's building blocks below the request API: session channels (sealing and opening
# frames straight into nng messages), reassembly records, credentials, and small pynng helpers.
# Invariants: as _transport.py's (one of the transport modules that import pynng); a channel
# moves its replay window only for authentic frames.
from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import pynng
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ..identity import Admission, AdmissionRefused, Identity, peer_id_from_public_key
from ._noise import (
    FrameInfo,
    FrameReceiver,
    FrameSender,
    HandshakeFailed,
    NoiseHandshake,
    PartInfo,
    check_identity_proof,
    frame_length,
    make_identity_proof,
    open_frame,
    parse_frame_prefix,
    seal_frame_into,
)
from ._types import PeerInfo, TransportConfig

HS1, HS2, HS3, HS_OK, HS_REFUSED = 0x01, 0x02, 0x03, 0x04, 0x7F
MAX_REFUSAL_CHARS = 200
# Multi-part requests in flight per connection: the sender waits for a slot, the receiver drops
# the oldest partial message beyond it (only a cancelled request leaves one behind). Bounds the
# receiver's reassembly memory to this many times max_message_bytes per connection.
MAX_PARTIAL_MESSAGES = 2
# Big replies kept per connection until their parts are pulled; the oldest (left by a requester
# that gave up) is dropped beyond it. They hold references to the handler's payloads, no copies.
MAX_PENDING_REPLIES = 16


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


LAZY_BUFFER_BYTES = 1 << 20  # a message being reassembled from this size on is not zero-filled
# (a 5 KB first part that said 256 MiB made the node hold 256 MiB for 30 s)


def message_buffer(size: int) -> bytearray | np.ndarray:
    """A writable buffer for a message of `size` bytes, every byte of which is written before it
    is used (all its parts must come). From LAZY_BUFFER_BYTES on it is left uninitialised
    (a bytearray zero-fills, so touches, all of it): malloc maps a big one afresh (see
    tune_allocator) and its pages are taken only as parts are written into them; a chunk below
    the mmap threshold is a bytearray, reusing the arenas' pages."""
    return bytearray(size) if size < LAZY_BUFFER_BYTES else np.empty(size, dtype=np.uint8)


class _Partial:
    """A multi-part request being reassembled (decrypted straight into its final buffer)."""

    def __init__(self, part: PartInfo) -> None:
        self.part = part
        self.buffer = message_buffer(part.message_len)
        self.claimed: set[int] = set()
        self.done = 0
        self.header: bytes | None = None
        self.last_part_at = float("-inf")  # (trio time) when a part of it came last


class _Credentials:
    """What this node proves in every handshake, and how it judges the other side."""

    def __init__(self, identity: Identity, admission: Admission, clock: Callable[[], float]):
        self.identity = identity
        self.admission = admission
        self.clock = clock
        self.static_key = X25519PrivateKey.generate()
        self._static_pub = self.static_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.proof = make_identity_proof(identity, self._static_pub, admission.credential())

    def renew(self, admission: Admission) -> None:
        """Prove membership with `admission`'s credential from the next handshake on."""
        self.admission = admission
        self.proof = make_identity_proof(self.identity, self._static_pub, admission.credential())

    def own_expiry(self) -> float | None:
        """When our own certificate expires (POSIX seconds), or None without one."""
        cert = self.admission.certificate
        return None if cert is None else float(cert.expires_at)

    def handshake(self, initiator: bool) -> NoiseHandshake:
        return NoiseHandshake(initiator, self.static_key, self.admission.prologue)

    def judge(self, hs: NoiseHandshake, payload: bytes, address: str, direction) -> PeerInfo:
        """Check a peer's proof and admission. Raises HandshakeFailed."""
        proof = check_identity_proof(payload, hs.remote_static)
        try:
            until = self.admission.check(proof.identity_key, proof.credential, self.clock())
        except AdmissionRefused as exc:
            raise HandshakeFailed(f"admission refused: {exc.reason}", "admission") from None
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


def _close_pipe(pipe: pynng.Pipe) -> None:
    try:
        pipe.close()
    except pynng.NNGException:  # already gone
        pass
