# The node's own message types (membership, probes, state sync, status) on top of the transport's
# header framework; each algorithm defines its own in its module. Invariants: every header is a
# bounded msgspec Struct; membership messages travel as a kind tag plus a msgpack body that is
# decoded into gossip's own dataclass and validated by gossip before gossip sees it; model tensors
# always travel in the payload, as compress/ bytes, never inside a header.
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from geotrain.gossip import MESSAGE_TYPES, MembershipMessage, RemoteProtocolError, validate_message

from .transport import HEADER_TYPES, U63, Header, HeaderCodec, Name

MAX_GOSSIP_BODY = 48 * 1024

_KINDS: dict[str, type] = {cls.__name__.lower(): cls for cls in MESSAGE_TYPES}
GossipKind = Literal["join", "ping", "pingreq", "ack", "peerlist", "leave"]
assert set(_KINDS) == set(GossipKind.__args__)  # type: ignore[attr-defined]


class Gossip(Header, frozen=True, tag="gossip"):
    """One membership message (gossip/_messages), one way; answered with Delivered."""

    kind: GossipKind
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_GOSSIP_BODY)]


MAX_CARRIED = 16  # membership messages carried back to a client in one Delivered


class Delivered(Header, frozen=True, tag="delivered", omit_defaults=True):
    """The answer to a one-way message: it arrived and was accepted. To a client-mode peer
    (nobody can dial it) it also carries the membership messages waiting for it, the answer to
    this one first: the connection the client opened is the only way back to it."""

    messages: Annotated[tuple[Gossip, ...], msgspec.Meta(max_length=MAX_CARRIED)] = ()


class StateRequest(Header, frozen=True, tag="state_request"):
    """A joining node asks for chunk `index` of the current model, cut into chunks of at most
    `chunk_numel` elements by the plan whose digest is `plan` (both ends derive it from the
    model's names and shapes). Answered StateReply with that chunk in float32; the server keeps
    nothing between requests (each chunk is read from its live model when asked)."""

    algorithm: Name
    plan: U63
    chunk_numel: U63
    index: U63


class StateReply(Header, frozen=True, tag="state_reply"):
    step: U63  # the server's step when the chunk was read
    chunks: U63  # how many chunks the plan has


class OptimizerStateRequest(Header, frozen=True, tag="optimizer_state_request"):
    """A joining node that fetched the model asks for its optimizer's state: with `layout`, the
    optimizer's class and state tensors (answered OptimizerStateReply, payload an
    OptimizerLayout in msgpack); else chunk `index` of those tensors (in name order) cut by the
    plan `plan` of `chunk_numel` elements, in float32. A node without a fitting optimizer
    answers an error, and the joiner trains with a fresh one."""

    plan: U63 = 0
    chunk_numel: U63 = 1
    index: U63 = 0
    layout: bool = False


class OptimizerStateReply(Header, frozen=True, tag="optimizer_state_reply"):
    chunks: U63 = 0  # how many chunks the plan has (0 for a layout)


class BufferStateRequest(Header, frozen=True, tag="buffer_state_request"):
    """A joining node that fetched the model asks for its buffers: the floating-point tensors
    its state_dict keeps besides the parameters (BatchNorm's running statistics), which
    exchanges do not average. Answered BufferStateReply with all of them in one named payload
    (float32, codec none), or an error when they are above MAX_BUFFER_BYTES."""


class BufferStateReply(Header, frozen=True, tag="buffer_state_reply"):
    count: U63  # how many buffers the payload holds


MAX_BUFFER_BYTES = 64 << 20  # buffers are statistics, a small share of a model: one message


MAX_LAYOUT_BYTES = 4 << 20
MAX_STATE_TENSORS = 1 << 16
Scalar = float | int | bool


class OptimizerLayout(msgspec.Struct, frozen=True):
    """An optimizer's state as state sync describes it: its class, each state tensor
    ("optim/<parameter>/<key>", shape, dtype) and the per-parameter scalars."""

    cls: Annotated[str, msgspec.Meta(max_length=200)]
    tensors: Annotated[list[tuple[Annotated[str, msgspec.Meta(max_length=300)],
                                  Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                                            msgspec.Meta(max_length=16)],
                                  Annotated[str, msgspec.Meta(max_length=40)]]],
                       msgspec.Meta(max_length=MAX_STATE_TENSORS)]  # fmt: skip
    scalars: dict[str, dict[str, Scalar]]
    # how many steps the peer's learning-rate scheduler took (None: it has none): a joiner's
    # schedule goes on from there instead of starting over (older peers send nothing)
    schedule_steps: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] | None = None
    # the names of the optimizer's parameters in its order: a joiner whose optimizer lists them
    # in another order takes each state by name (older peers send none: by position)
    params: Annotated[list[Annotated[str, msgspec.Meta(max_length=1000)]],
                      msgspec.Meta(max_length=MAX_STATE_TENSORS)] | None = None  # fmt: skip


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
    StateRequest,
    StateReply,
    OptimizerStateRequest,
    OptimizerStateReply,
    BufferStateRequest,
    BufferStateReply,
    Probe,
    ProbeReply,
    StatusRequest,
    StatusReply,
)


def node_header_codec() -> HeaderCodec:
    """Headers of the node's own services and of every registered algorithm."""
    from .algorithms import algorithm_messages

    return HeaderCodec((*NODE_HEADER_TYPES, *algorithm_messages()))


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
