"""Membership messages: msgspec round trips and the bounds checked on input from peers."""

from __future__ import annotations

import msgspec
import pytest

from geotrain.gossip._errors import RemoteProtocolError
from geotrain.gossip._messages import (
    MAX_ID_LEN,
    MAX_MEMBERS,
    MAX_UPDATES,
    Ack,
    Join,
    Leave,
    MemberUpdate,
    PeerList,
    Ping,
    PingReq,
    is_peer_id,
    validate_message,
)

UPDATE = MemberUpdate("p1", "tcp://198.18.0.5:7000", "suspect", 3, origin="p2")
MESSAGES = [
    Join("tcp://198.18.0.5:7000", 0),
    Ping(7, "tcp://a:1", (UPDATE,)),
    PingReq(8, "tcp://a:1", "p9", "tcp://b:2", (UPDATE, UPDATE)),
    Ack(7, "tcp://b:2", True, ()),
    PeerList("tcp://a:1", (UPDATE,), want_reply=True),
    Leave("tcp://a:1", 4),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_msgspec_and_validates(msg):
    wire = msgspec.msgpack.encode(msg)
    back = msgspec.msgpack.decode(wire, type=type(msg))
    assert back == msg
    validate_message(back)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (Ping(1, "a", (UPDATE,) * (MAX_UPDATES + 1)), "updates"),
        (PeerList("a", (UPDATE,) * (MAX_MEMBERS + 1)), "members"),
        (Ping(2**63, "a"), "seq"),
        (Join("a", -1), "incarnation"),
        (Join("", 0), "sender_address"),
        (PingReq(1, "a", "", "b"), "target_id"),
        (Ping(1, "a", (MemberUpdate("p", "a", "alive", 0, origin="o" * 500),)), "origin"),
        (Ping(1, "a", (MemberUpdate("p", "a", "alive", True),)), "incarnation"),
        (Ack(1, "a", indirect="yes"), "indirect"),
        (Ping(1, "a", (MemberUpdate("p q", "a", "alive", 0),)), "peer_id"),
        (Ping(1, "a", (MemberUpdate("p\x00", "a", "alive", 0),)), "peer_id"),
        (PeerList("a", (MemberUpdate("p", "a", "suspect", 0, origin="o\n"),)), "origin"),
        (PeerList("a", (MemberUpdate("p", "tcp://a b:1", "alive", 0),)), "address"),
        (PingReq(1, "a", "t/../x", "b"), "target_id"),
        (PingReq(1, "a", "t", "b\x7f"), "target_address"),
        (Join("tcp://a:1\n", 0), "sender_address"),
    ],
)
def test_out_of_bounds_input_names_the_field(msg, field):
    with pytest.raises(RemoteProtocolError, match=field):
        validate_message(msg)


def test_msgspec_rejects_wrong_types_before_validation():
    wire = msgspec.msgpack.encode({"seq": "x", "sender_address": "a", "updates": []})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=Ping)


def test_peer_ids_of_the_node_format_are_well_formed():
    assert is_peer_id("gt" + "abcdefghijklmnopqrstuvwxyz234567" + "a" * 20)
    assert is_peer_id("p0") and is_peer_id("host-1.zone_a:7")
    assert not any(is_peer_id(v) for v in ("", "x" * (MAX_ID_LEN + 1), "a b", "ü", 7, None))
