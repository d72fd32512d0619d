# The secure channel, sans-I/O: the Noise XX handshake (Noise_XX_25519_ChaChaPoly_SHA256, built on
# `cryptography` primitives per revision 34 of the Noise spec), the identity proof carried inside
# it, and the framing of encrypted messages afterwards. Invariants: nothing here does I/O or reads
# a clock; every input error raises HandshakeFailed or FrameRejected with a short reason and leaves
# the state unchanged (a rejected frame never advances the replay window); a frame's length is
# checked against its header before anything is decrypted or allocated.
from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Literal

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ..identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature

PROTOCOL_NAME = b"Noise_XX_25519_ChaChaPoly_SHA256"
DH_LEN = 32
TAG_LEN = 16
MAX_HANDSHAKE_MESSAGE = 4096
STATIC_SIGNATURE_CONTEXT = b"geotrain/noise-static/1"
MAX_CREDENTIAL_BYTES = 1024

# Message patterns of XX: -> e ; <- e, ee, s, es ; -> s, se
XX_PATTERN: tuple[tuple[str, ...], ...] = (("e",), ("e", "ee", "s", "es"), ("s", "se"))


HandshakeFailureKind = Literal["noise", "proof", "admission", "peer_mismatch", "refused"]


class HandshakeFailed(Exception):
    """The handshake cannot go on: `reason` says why (tampered, wrong swarm, bad proof...), and
    `kind` is the counter it is reported under: "noise" (the Noise messages), "proof" (the
    identity proof), "admission" (not admitted), "peer_mismatch" (another peer than expected) or
    "refused" (the other side refused us)."""

    def __init__(self, reason: str, kind: HandshakeFailureKind = "noise") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind: HandshakeFailureKind = kind


class FrameRejected(Exception):
    """A frame after the handshake was refused. `reason` is one short word for statistics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """Noise's HKDF with two outputs (HMAC-SHA256)."""
    temp = _hmac(chaining_key, ikm)
    out1 = _hmac(temp, b"\x01")
    return out1, _hmac(temp, out1 + b"\x02")


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class _SymmetricState:
    def __init__(self, prologue: bytes) -> None:
        self.h = PROTOCOL_NAME  # exactly HASHLEN bytes, so used as is
        self.ck = self.h
        self.key: ChaCha20Poly1305 | None = None
        self.n = 0
        self.mix_hash(prologue)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp = hkdf2(self.ck, ikm)
        self.key, self.n = ChaCha20Poly1305(temp), 0

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        if self.key is None:
            out = plaintext
        else:
            out = self.key.encrypt(_nonce(self.n), plaintext, self.h)
            self.n += 1
        self.mix_hash(out)
        return out

    def decrypt_and_hash(self, data: bytes) -> bytes:
        if self.key is None:
            out = data
        else:
            try:
                out = self.key.decrypt(_nonce(self.n), data, self.h)
            except InvalidTag:
                # the swarm ID is the prologue: a peer of another swarm fails here, as does a
                # message altered on the way or recorded from another handshake and replayed
                # (they cannot be told apart by design)
                raise HandshakeFailed(
                    "handshake message failed authentication: the peer is of another swarm "
                    "(its swarm ID differs from identity.swarm_id / the swarm file's), or the "
                    "message was altered on the way, or replayed from another handshake") from None
            self.n += 1
        self.mix_hash(data)
        return out


class NoiseHandshake:
    """One side of a Noise XX handshake. Drive it with write_message/read_message in turn.

    Args:
        initiator: True on the side that sends the first message.
        static_key: this side's X25519 static key (a fresh one per transport is fine: it is bound
            to the identity by the signed proof in the payload).
        prologue: bytes both sides must agree on (the swarm ID goes here).
        ephemeral_key: for tests only; a fresh one is generated by default.
    """

    def __init__(
        self,
        initiator: bool,
        static_key: X25519PrivateKey,
        prologue: bytes,
        ephemeral_key: X25519PrivateKey | None = None,
    ) -> None:
        self.initiator = initiator
        self._s = static_key
        self._e = ephemeral_key or X25519PrivateKey.generate()
        self._re: X25519PublicKey | None = None
        self._rs: X25519PublicKey | None = None
        self._sym = _SymmetricState(prologue)
        self._step = 0

    @property
    def complete(self) -> bool:
        return self._step == len(XX_PATTERN)

    @property
    def remote_static(self) -> bytes:
        """The peer's X25519 static public key (known after its `s` token)."""
        if self._rs is None:
            raise HandshakeFailed("remote static key not known yet")
        return _raw(self._rs)

    @property
    def handshake_hash(self) -> bytes:
        return self._sym.h

    def _my_turn(self) -> bool:
        return (self._step % 2 == 0) == self.initiator

    def _dh(self, token: str) -> bytes:
        """The shared secret of `token`.

        Raises:
            HandshakeFailed: the peer's key is a low-order point (an all-zero secret). Writing a
                message computes one too (the responder's "ee" of a stranger's HS1): it escaped
                as a ValueError there, logged with its traceback for every such connection.
        """
        local, remote = {
            "ee": (self._e, self._re),
            "es": (self._e, self._rs) if self.initiator else (self._s, self._re),
            "se": (self._s, self._re) if self.initiator else (self._e, self._rs),
        }[token]
        assert remote is not None  # the pattern orders tokens so that it is known
        try:
            return local.exchange(remote)
        except ValueError:  # low-order point: all-zero shared secret
            raise HandshakeFailed("invalid public key") from None

    def write_message(self, payload: bytes) -> bytes:
        """The next handshake message, carrying `payload` (encrypted once a key exists)."""
        if self.complete or not self._my_turn():
            raise HandshakeFailed("write_message out of turn")
        out = bytearray()
        for token in XX_PATTERN[self._step]:
            if token == "e":
                e_pub = _raw(self._e.public_key())
                out += e_pub
                self._sym.mix_hash(e_pub)
            elif token == "s":
                out += self._sym.encrypt_and_hash(_raw(self._s.public_key()))
            else:
                self._sym.mix_key(self._dh(token))
        out += self._sym.encrypt_and_hash(payload)
        self._step += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Consume the peer's next handshake message and return its payload.

        Raises:
            HandshakeFailed: malformed, tampered, out of turn, or a different prologue.
        """
        if self.complete or self._my_turn():
            raise HandshakeFailed("read_message out of turn")
        if len(message) > MAX_HANDSHAKE_MESSAGE:
            raise HandshakeFailed("handshake message too long")
        at = 0
        for token in XX_PATTERN[self._step]:
            if token in ("e", "s"):
                size = DH_LEN + (TAG_LEN if token == "s" and self._sym.key else 0)
                if len(message) - at < size:
                    raise HandshakeFailed("handshake message too short")
                chunk = message[at : at + size]
                at += size
                if token == "e":
                    self._re = X25519PublicKey.from_public_bytes(chunk)
                    self._sym.mix_hash(chunk)
                else:
                    self._rs = X25519PublicKey.from_public_bytes(self._sym.decrypt_and_hash(chunk))
            else:
                self._sym.mix_key(self._dh(token))
        payload = self._sym.decrypt_and_hash(message[at:])
        self._step += 1
        return payload

    def split(self) -> tuple[bytes, bytes]:
        """(send key, receive key) for this side, once the handshake is complete."""
        if not self.complete:
            raise HandshakeFailed("split before the handshake completed")
        k1, k2 = hkdf2(self._sym.ck, b"")
        return (k1, k2) if self.initiator else (k2, k1)


class IdentityProof(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Handshake payload: the identity key, its signature of the Noise static key, a credential."""

    identity_key: bytes
    static_signature: bytes
    credential: bytes = b""


_proof_decoder = msgspec.msgpack.Decoder(IdentityProof)


def make_identity_proof(identity: Identity, static_public: bytes, credential: bytes) -> bytes:
    """The encoded payload that binds `static_public` to `identity`."""
    sig = identity.sign(STATIC_SIGNATURE_CONTEXT + static_public)
    return msgspec.msgpack.encode(IdentityProof(identity.public_key, sig, credential))


def check_identity_proof(payload: bytes, remote_static: bytes) -> IdentityProof:
    """Decode a peer's proof and check that its identity key signed the static key it used.

    Raises:
        HandshakeFailed: malformed or not signed by the claimed identity.
    """
    try:
        proof = _proof_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise HandshakeFailed(f"malformed identity proof: {exc}", "proof") from None
    if (
        len(proof.identity_key) != PUBLIC_KEY_BYTES
        or len(proof.static_signature) != SIGNATURE_BYTES
        or len(proof.credential) > MAX_CREDENTIAL_BYTES
    ):
        raise HandshakeFailed("identity proof fields have wrong sizes", "proof")
    message = STATIC_SIGNATURE_CONTEXT + remote_static
    if not verify_signature(proof.identity_key, proof.static_signature, message):
        raise HandshakeFailed("channel key is not signed by the claimed identity", "proof")
    return proof


# ---- frames after the handshake -------------------------------------------------------------
# prefix: kind (1) | counter (8) | header length (4) | payload length (8), little-endian, and for a
# part of a multi-part message (kind 0x11) also: message id (8) | part index (4) | part count (4)
# | message length (8); a pull request (kind 0x12) has the same fields and nothing after the
# header tag. Then the encrypted header (chunk 0) and the payload in chunks of
# FRAME_CHUNK bytes (chunks 1..), each with its 16-byte tag. Chunk nonce = chunk index (4) |
# counter (8); the whole prefix is the associated data, so lengths, counter, kind and part
# numbers are authenticated and chunks cannot be cut, moved or swapped.
FRAME_KIND_DATA = 0x10
FRAME_KIND_PART = 0x11
FRAME_KIND_PULL = 0x12  # "send me part `index` of your reply `message_id`": no header, no payload
_PREFIX = struct.Struct("<BQIQ")
_PART = struct.Struct("<QIIQ")
PREFIX_LEN = _PREFIX.size
FRAME_CHUNK = 1 << 20
MAX_COUNTER = 2**63
MAX_PARTS = 1 << 16


@dataclass(frozen=True)
class PartInfo:
    """Where a frame's payload sits in a message that was split into parts."""

    message_id: int
    index: int
    count: int
    message_len: int

    def check(self, payload_len: int) -> None:
        """Raise FrameRejected("part") unless this part's numbers are consistent."""
        if not (2 <= self.count <= MAX_PARTS and self.index < self.count):
            raise FrameRejected("part", f"part {self.index} of {self.count}")
        lo, hi = part_bounds(self.message_len, self.count, self.index)
        if hi - lo != payload_len or lo >= hi:
            raise FrameRejected("part", f"part {self.index} has {payload_len} bytes")


def part_bounds(message_len: int, count: int, index: int) -> tuple[int, int]:
    """Byte range of part `index` when `message_len` bytes are split into `count` parts."""
    size = -(-message_len // count)
    return min(index * size, message_len), min((index + 1) * size, message_len)


def frame_length(header_len: int, payload_len: int, part: bool = False) -> int:
    """Total bytes of a frame carrying a header and a payload of these sizes."""
    n_chunks = -(-payload_len // FRAME_CHUNK)
    extra = _PART.size if part else 0
    return PREFIX_LEN + extra + header_len + TAG_LEN + payload_len + TAG_LEN * n_chunks


def _chunk_nonce(index: int, counter: int) -> bytes:
    return struct.pack("<IQ", index, counter)


def seal_frame(
    key: ChaCha20Poly1305,
    counter: int,
    header: bytes,
    payload: bytes,
    part: PartInfo | None = None,
    kind: int | None = None,
) -> bytearray:
    """Encrypt one frame into a new buffer. Pure and thread-safe."""
    n = len(memoryview(payload).cast("B"))
    out = bytearray(frame_length(len(header), n, part is not None))
    seal_frame_into(key, counter, header, payload, memoryview(out), part, kind)
    return out


def seal_frame_into(
    key: ChaCha20Poly1305,
    counter: int,
    header: bytes,
    payload: bytes,
    out: memoryview,
    part: PartInfo | None = None,
    kind: int | None = None,
) -> None:
    """Encrypt one frame into `out` (exactly `frame_length` bytes, e.g. a socket's message
    buffer, so that big payloads are not copied again). Pure and thread-safe."""
    payload = memoryview(payload).cast("B")
    if len(out) != frame_length(len(header), len(payload), part is not None):
        raise ValueError(f"out: {len(out)} bytes, expected the frame length")
    if kind is None:
        kind = FRAME_KIND_DATA if part is None else FRAME_KIND_PART
    prefix = _PREFIX.pack(kind, counter, len(header), len(payload))
    if part is not None:
        prefix += _PART.pack(part.message_id, part.index, part.count, part.message_len)
    view = memoryview(out).cast("B")
    view[: len(prefix)] = prefix
    at = len(prefix)
    key.encrypt_into(
        _chunk_nonce(0, counter), header, prefix, view[at : at + len(header) + TAG_LEN]
    )
    at += len(header) + TAG_LEN
    for index, lo in enumerate(range(0, len(payload), FRAME_CHUNK), start=1):
        chunk = payload[lo : lo + FRAME_CHUNK]
        key.encrypt_into(
            _chunk_nonce(index, counter), chunk, prefix, view[at : at + len(chunk) + TAG_LEN]
        )
        at += len(chunk) + TAG_LEN


@dataclass(frozen=True)
class FrameInfo:
    """A frame's authenticated-to-be prefix, parsed and length-checked."""

    counter: int
    header_len: int
    payload_len: int
    part: PartInfo | None = None
    kind: int = FRAME_KIND_DATA

    @property
    def prefix_len(self) -> int:
        return PREFIX_LEN + (_PART.size if self.part is not None else 0)


def parse_frame_prefix(frame: bytes, max_header: int, max_payload: int) -> FrameInfo:
    """Check a frame's prefix and total length before any decryption.

    Raises:
        FrameRejected: "short", "kind", "length" or "part".
    """
    if len(frame) < PREFIX_LEN + TAG_LEN:
        raise FrameRejected("short", f"{len(frame)} bytes")
    kind, counter, header_len, payload_len = _PREFIX.unpack_from(frame)
    part = None
    if kind in (FRAME_KIND_PART, FRAME_KIND_PULL):
        if len(frame) < PREFIX_LEN + _PART.size + TAG_LEN:
            raise FrameRejected("short", f"{len(frame)} bytes")
        part = PartInfo(*_PART.unpack_from(frame, PREFIX_LEN))
        if part.message_len > max_payload:
            raise FrameRejected("length", f"message of {part.message_len} bytes")
        if kind == FRAME_KIND_PART:
            part.check(payload_len)
        elif header_len or payload_len or not 1 <= part.index < part.count <= MAX_PARTS:
            raise FrameRejected("part", f"pull of part {part.index} of {part.count}")
    elif kind != FRAME_KIND_DATA:
        raise FrameRejected("kind", f"frame kind {kind:#x}")
    if header_len > max_header or payload_len > max_payload:
        raise FrameRejected("length", f"header {header_len}, payload {payload_len} bytes")
    if len(frame) != frame_length(header_len, payload_len, part is not None):
        raise FrameRejected("length", f"{len(frame)} bytes, prefix says otherwise")
    return FrameInfo(counter, header_len, payload_len, part, kind)


def open_frame(
    key: ChaCha20Poly1305, info: FrameInfo, frame: bytes, out: memoryview | None = None
) -> tuple[bytes, bytearray | None]:
    """Decrypt a frame whose prefix `parse_frame_prefix` accepted. Pure and thread-safe.

    Args:
        out: where the payload goes (exactly payload_len bytes); a new bytearray if None, which
            is then returned as the second item (None is returned when `out` was given).

    Raises:
        FrameRejected: "auth" when any byte was changed (or the frame was not encrypted by us).
    """
    view = memoryview(frame).cast("B")
    prefix = bytes(view[: info.prefix_len])
    at = info.prefix_len
    payload = None
    if out is None:
        payload = bytearray(info.payload_len)
        out = memoryview(payload)
    try:
        header = key.decrypt(
            _chunk_nonce(0, info.counter), view[at : at + info.header_len + TAG_LEN], prefix
        )
        at += info.header_len + TAG_LEN
        for index, lo in enumerate(range(0, info.payload_len, FRAME_CHUNK), start=1):
            size = min(FRAME_CHUNK, info.payload_len - lo)
            key.decrypt_into(
                _chunk_nonce(index, info.counter),
                view[at : at + size + TAG_LEN],
                prefix,
                out[lo : lo + size],
            )
            at += size + TAG_LEN
    except InvalidTag:
        raise FrameRejected("auth", "frame failed authentication") from None
    return header, payload


class ReplayWindow:
    """Sliding-window replay protection over 64-bit frame counters (as in IPsec/WireGuard).

    A counter is accepted once; counters more than `size` below the highest seen are refused.
    """

    def __init__(self, size: int = 1024) -> None:
        if size < 1:
            raise ValueError(f"size: {size}, expected >= 1")
        self.size = size
        self._top = -1
        self._bits = 0  # bit i set: counter (top - i) was seen

    def check(self, counter: int) -> None:
        """Raise FrameRejected("replay") if `counter` was seen or is too old; change nothing."""
        if counter > self._top:
            return
        offset = self._top - counter
        if offset >= self.size:
            raise FrameRejected("replay", f"counter {counter} is older than the window")
        if self._bits >> offset & 1:
            raise FrameRejected("replay", f"counter {counter} was seen before")

    def accept(self, counter: int) -> None:
        """Check and record `counter` in one step (call after the frame authenticated)."""
        self.check(counter)
        if counter > self._top:
            shift = counter - self._top
            if shift >= self.size:  # a jump past the whole window: nothing older stays inside it
                self._bits = 1
            else:
                self._bits = ((self._bits << shift) | 1) & ((1 << self.size) - 1)
            self._top = counter
        else:
            self._bits |= 1 << (self._top - counter)


class FrameSender:
    """The sending half of a channel: one key and a counter that never repeats."""

    def __init__(self, key: bytes) -> None:
        self.aead = ChaCha20Poly1305(key)
        self._next = 0

    def next_counter(self) -> int:
        if self._next >= MAX_COUNTER:
            raise FrameRejected("exhausted", "frame counter exhausted; reconnect")
        counter, self._next = self._next, self._next + 1
        return counter


class FrameReceiver:
    """The receiving half: one key and the replay window."""

    def __init__(self, key: bytes, window: int = 1024) -> None:
        self.aead = ChaCha20Poly1305(key)
        self.window = ReplayWindow(window)
