# Typed, versioned message headers. Invariants: a header on the wire is msgpack
# `[protocol_version, {"type": <tag>, ...fields}]`; decoding never runs code, never unpickles and
# never returns anything but one of the registered Structs; every variable-length field has a bound;
# every input error raises HeaderDecodeError with a reason and an ErrorReply code. To add a message
# type, define a Struct that subclasses Header with a `tag=` and register it with a HeaderCodec.
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# 2: RoundRequest.wait_s. 3: messages owned by the algorithms (ChocoResync replaces an ErrorReply
# whose reason started with "resync"); a v2 node is refused with "unsupported protocol version".
PROTOCOL_VERSION = 3
MAX_HEADER_BYTES = 64 * 1024
MAX_REASON_CHARS = 512
MAX_SPEC_CHARS = 128

U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
CodecSpec = Annotated[str, msgspec.Meta(max_length=MAX_SPEC_CHARS)]  # a compress/ spec string
Name = Annotated[str, msgspec.Meta(max_length=64)]  # an algorithm or other short name


class HeaderDecodeError(ValueError):
    """Bytes from the network are not a valid header: `reason` says why, and `code` is the
    ErrorReply code that tells the sender ("bad_request", "unknown_type" or
    "unsupported_version")."""

    def __init__(self, reason: str, code: ErrorCode = "bad_request") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code: ErrorCode = code


class Header(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True):
    """Base of every message header. Subclasses set `tag="..."` (the wire type name)."""


class Ping(Header, frozen=True, tag="ping"):
    """Liveness / RTT probe; the reply is a Pong with the same nonce."""

    nonce: U63


class Pong(Header, frozen=True, tag="pong"):
    nonce: U63


ErrorCode = Literal["bad_request", "unknown_type", "unsupported_version", "internal", "busy"]


class ErrorReply(Header, frozen=True, tag="error"):
    """The answer to a request the responder could not serve."""

    code: ErrorCode
    reason: Reason = ""


HEADER_TYPES: tuple[type[Header], ...] = (Ping, Pong, ErrorReply)


class HeaderCodec:
    """Encodes and decodes headers of a fixed set of types and one protocol version.

    Args:
        types: the Header subclasses accepted (HEADER_TYPES by default).
        version: the protocol version written and the only one accepted.
        max_header_bytes: longer inputs are refused before decoding.
    """

    def __init__(
        self,
        types: tuple[type[Header], ...] = HEADER_TYPES,
        version: int = PROTOCOL_VERSION,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        if not types or not all(issubclass(t, Header) for t in types):
            raise ValueError(f"types: {types!r}, expected a non-empty tuple of Header subclasses")
        if not 0 < max_header_bytes <= 2**24:
            raise ValueError(f"max_header_bytes: {max_header_bytes}, expected 1..16 MiB")
        self.types = types
        self.version = version
        self.max_header_bytes = max_header_bytes
        self._tags = frozenset(t.__struct_config__.tag for t in types)
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        union = types[0] if len(types) == 1 else _union(types)
        self._body = msgspec.msgpack.Decoder(union)
        self._tag_only = msgspec.msgpack.Decoder(_TagOnly)

    def encode(self, header: Header) -> bytes:
        """Wire bytes of `header`.

        Raises:
            TypeError: `header` is not one of this codec's types (a bug in the caller).
        """
        if type(header) not in self.types:
            raise TypeError(f"header type {type(header).__name__} is not registered")
        return self._encoder.encode((self.version, header))

    def decode(self, data: bytes | memoryview) -> Header:
        """Parse wire bytes into a header.

        Raises:
            HeaderDecodeError: too long, not msgpack, another version, an unknown type, or a field
                out of bounds.
        """
        if len(data) > self.max_header_bytes:
            raise HeaderDecodeError(f"header is {len(data)} bytes, limit {self.max_header_bytes}")
        try:
            version, body = self._envelope.decode(data)
        except msgspec.DecodeError as exc:
            raise HeaderDecodeError(f"not a header envelope: {exc}") from None
        if version != self.version:
            raise HeaderDecodeError(
                f"unsupported protocol version {version} (expected {self.version})",
                "unsupported_version",
            )
        try:
            return self._body.decode(body)
        except msgspec.DecodeError as exc:
            raise self._explain(body, exc) from None

    def _explain(self, body: msgspec.Raw, exc: msgspec.DecodeError) -> HeaderDecodeError:
        try:
            tag = self._tag_only.decode(body).type
        except msgspec.DecodeError:
            return HeaderDecodeError(f"invalid header: {exc}")
        if tag not in self._tags:
            return HeaderDecodeError(f"unknown message type {tag[:64]!r}", "unknown_type")
        return HeaderDecodeError(f"invalid {tag!r} header: {exc}")


class _TagOnly(msgspec.Struct):
    type: Annotated[str, msgspec.Meta(max_length=256)]


def _union(types: tuple[type[Header], ...]) -> object:
    union = types[0]
    for t in types[1:]:
        union = union | t
    return union
