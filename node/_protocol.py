# The daemon's message types on top of the transport's header framework. Invariants: every header
# is a bounded msgspec Struct; membership messages travel as a kind tag plus a msgpack body that
# is decoded into gossip's own dataclass and validated by gossip before gossip sees it; model
# tensors always travel in the payload, as compress/ bytes, never inside a header.
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gossip._errors import RemoteProtocolError
from gossip._messages import MESSAGE_TYPES, MembershipMessage, validate_message

from ._messages import HEADER_TYPES, U63, Header, HeaderCodec

MAX_SPEC_CHARS = 128
MAX_GOSSIP_BODY = 48 * 1024
Spec = Annotated[str, msgspec.Meta(max_length=MAX_SPEC_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=64)]
Degree = Annotated[int, msgspec.Meta(ge=0, le=4096)]

_KINDS: dict[str, type] = {cls.__name__.lower(): cls for cls in MESSAGE_TYPES}
GossipKind = Literal["join", "ping", "pingreq", "ack", "peerlist", "leave"]
assert set(_KINDS) == set(GossipKind.__args__)  # type: ignore[attr-defined]


class Gossip(Header, frozen=True, tag="gossip"):
    """One membership message (gossip/_messages), one way; answered with Delivered."""

    kind: GossipKind
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_GOSSIP_BODY)]


class Delivered(Header, frozen=True, tag="delivered"):
    """The answer to a one-way message: it arrived and was accepted."""


class Exchange(Header, frozen=True, tag="exchange"):
    """Start a pairwise exchange: the payload is the sender's model, encoded with `codec`.

    The responder answers ExchangeReply with its own model encoded with the same codec, and both
    mix. `algorithm` must match the responder's; `step` is informational.
    """

    algorithm: Name
    codec: Spec
    step: U63


class ExchangeReply(Header, frozen=True, tag="exchange_reply"):
    step: U63


class StateRequest(Header, frozen=True, tag="state_request"):
    """A joining node asks for the current model (answered with StateReply + fp32 payload)."""

    algorithm: Name


class StateReply(Header, frozen=True, tag="state_reply"):
    step: U63


class RoundRequest(Header, frozen=True, tag="round_request"):
    """dpsgd: ask a neighbour for its model at the boundary of round `round`.

    The neighbour answers RoundReply once it has reached that round with the model it had there,
    or a newer one when that round is gone; it waits for that at most `wait_s` (the requester's
    deadline: after it nobody listens, and a held request ties up one of its inbound workers).
    `degree` is the requester's neighbour count this round (for Metropolis-Hastings weights).
    """

    algorithm: Name
    codec: Spec
    round: U63
    degree: Degree
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 30.0


class RoundReply(Header, frozen=True, tag="round_reply"):
    round: U63
    degree: Degree


class ChocoExchange(Header, frozen=True, tag="choco_exchange"):
    """choco: the payload is q = C(x - x_hat) for the sender's estimate kept for this link.

    `seq` counts the exchanges completed on this link as the sender saw them; a responder whose
    count differs answers ErrorReply(reason "resync: ...") and both ends restart the link's
    estimates at the initial model, which both hold (same training.seed: `base` must match).
    """

    codec: Spec
    seq: U63
    base: U63  # digest of the initial model the estimates start from (same seed everywhere)


class ChocoReply(Header, frozen=True, tag="choco_reply"):
    seq: U63


class DeltaOffer(Header, frozen=True, tag="delta_offer"):
    """diloco: the payload is the sender's pseudo-gradient of outer round `round`."""

    codec: Spec
    round: U63


class DeltaReply(Header, frozen=True, tag="delta_reply"):
    """The responder's latest pseudo-gradient (empty payload when it has none yet)."""

    round: U63


MAX_PROBE_BYTES = 1 << 20


class Probe(Header, frozen=True, tag="probe"):
    """A link probe: the payload (at most MAX_PROBE_BYTES) measures goodput; answered ProbeReply."""


class ProbeReply(Header, frozen=True, tag="probe_reply"):
    received: U63


class StatusRequest(Header, frozen=True, tag="status_request"):
    """Ask a node for its status (answered StatusReply; payload: the status as JSON)."""


class StatusReply(Header, frozen=True, tag="status_reply"):
    pass


NODE_HEADER_TYPES: tuple[type[Header], ...] = (
    *HEADER_TYPES,
    Gossip,
    Delivered,
    Exchange,
    ExchangeReply,
    StateRequest,
    StateReply,
    Probe,
    ProbeReply,
    RoundRequest,
    RoundReply,
    ChocoExchange,
    ChocoReply,
    DeltaOffer,
    DeltaReply,
    StatusRequest,
    StatusReply,
)


def node_header_codec() -> HeaderCodec:
    return HeaderCodec(NODE_HEADER_TYPES)


_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _KINDS.items()}


def wrap_gossip(message: MembershipMessage) -> Gossip:
    """The header that carries a membership message."""
    return Gossip(kind=type(message).__name__.lower(), body=_encoder.encode(message))  # type: ignore[arg-type]


def unwrap_gossip(header: Gossip) -> MembershipMessage:
    """Decode and validate a membership message from a peer.

    Raises:
        RemoteProtocolError: the body does not decode to the kind's type or breaks a bound.
    """
    try:
        message = _decoders[header.kind].decode(header.body)
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError(f"bad {header.kind} body: {exc}") from None
    validate_message(message)
    return message
