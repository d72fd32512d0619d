"""Typed, versioned headers: round trips, bounds, and clear errors for anything else."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geotrain.node.transport._messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Header,
    HeaderCodec,
    HeaderDecodeError,
    Ping,
    Pong,
)

CODEC = HeaderCodec()


@pytest.mark.parametrize(
    "header", [Ping(0), Pong(2**63 - 1), ErrorReply("busy"), ErrorReply("internal", "boom")]
)
def test_headers_round_trip(header):
    assert CODEC.decode(CODEC.encode(header)) == header


def _raw(version, body):
    return msgspec.msgpack.encode((version, body))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_raw(PROTOCOL_VERSION + 1, {"type": "ping", "nonce": 1}), "unsupported protocol version"),
        (_raw(PROTOCOL_VERSION, {"type": "teleport"}), "unknown message type 'teleport'"),
        (_raw(PROTOCOL_VERSION, {"type": "ping", "nonce": -1}), "invalid 'ping' header"),
        (_raw(PROTOCOL_VERSION, {"type": "ping", "nonce": 1, "x": 2}), "invalid 'ping' header"),
        (
            _raw(PROTOCOL_VERSION, {"type": "error", "code": "internal", "reason": "r" * 513}),
            "invalid 'error' header",
        ),
        (_raw(PROTOCOL_VERSION, {"type": "error", "code": "whatever"}), "invalid 'error'"),
        (_raw(PROTOCOL_VERSION, 5), "invalid header"),
        (b"\xc1", "not a header envelope"),
        (b"", "not a header envelope"),
    ],
)
def test_bad_headers_raise_decode_error_with_a_reason(data, match):
    with pytest.raises(HeaderDecodeError, match=match):
        CODEC.decode(data)


def test_oversized_header_is_refused_before_decoding():
    codec = HeaderCodec(max_header_bytes=16)
    with pytest.raises(HeaderDecodeError, match="limit 16"):
        codec.decode(_raw(PROTOCOL_VERSION, {"type": "error", "code": "busy", "reason": "x" * 40}))


def test_a_new_message_type_is_added_by_registering_a_struct():
    class Hello(Header, frozen=True, tag="hello"):
        name: str

    extended = HeaderCodec((*CODEC.types, Hello))
    assert extended.decode(extended.encode(Hello("n"))) == Hello("n")
    with pytest.raises(HeaderDecodeError, match="unknown message type 'hello'"):
        CODEC.decode(extended.encode(Hello("n")))
    with pytest.raises(TypeError, match="not registered"):
        CODEC.encode(Hello("n"))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_bytes_only_raise_decode_error(data):
    try:
        header = CODEC.decode(data)
    except HeaderDecodeError:
        return
    assert type(header) in CODEC.types


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=8,
    )
)
def test_fuzzed_msgpack_bodies_only_raise_decode_error(body):
    try:
        CODEC.decode(_raw(PROTOCOL_VERSION, body))
    except HeaderDecodeError:
        pass
