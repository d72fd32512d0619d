# Membership wire messages. Invariants: every message is a frozen dataclass of primitive fields
# (str, int, float, bool, tuples of those or of other such dataclasses), so node/ can serialize it
# with msgspec; every variable-length field has a bound below, and `validate_message` checks all of
# them (peer ids also for their characters, addresses for printable ASCII), raising
# RemoteProtocolError for anything a peer could have sent wrong.
from __future__ import annotations

from dataclasses import dataclass

from ._errors import RemoteProtocolError

MAX_ID_LEN = 128
"""Longest peer id accepted (node derives ids from a public key hash, far shorter)."""
ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
"""Characters a peer id may hold (node's ids are "gt" + lowercase base32)."""
MAX_ADDRESS_LEN = 256
"""Longest address accepted, e.g. "tcp://[2001:db8::1]:7000"."""
MAX_UPDATES = 32
"""Most membership updates piggybacked on one Ping, Ack or PingReq."""
MAX_MEMBERS = 256
"""Most members listed in one Join reply or peer exchange."""
MAX_INCARNATION = 2**53
"""Incarnations are counters that only a refutation increments; anything above is an attack."""
MAX_SEQ = 2**63
STATES = ("alive", "suspect", "dead", "left")
"""Member states as they travel on the wire."""


@dataclass(frozen=True, slots=True)
class MemberUpdate:
    """What one node believes about one member; spread by piggybacking and peer exchange.

    Attributes:
        peer_id: the member's id.
        address: where the member is reached (opaque to gossip).
        state: one of "alive", "suspect", "dead", "left".
        incarnation: the member's own counter; only the member increments it, to refute.
        origin: for "suspect", the id of the node that suspects (confirmations count distinct
            origins); empty otherwise.
    """

    peer_id: str
    address: str
    state: str
    incarnation: int
    origin: str = ""


@dataclass(frozen=True, slots=True)
class Join:
    """Sent to a bootstrap address by a node that wants in; answered with a PeerList."""

    sender_address: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Ping:
    """A direct probe. The receiver answers Ack(seq)."""

    seq: int
    sender_address: str
    updates: tuple[MemberUpdate, ...] = ()


@dataclass(frozen=True, slots=True)
class PingReq:
    """Ask the receiver to probe `target_id` for us and forward its Ack (SWIM's indirect probe)."""

    seq: int
    sender_address: str
    target_id: str
    target_address: str
    updates: tuple[MemberUpdate, ...] = ()


@dataclass(frozen=True, slots=True)
class Ack:
    """The answer to Ping(seq); `indirect` when a helper forwards the target's answer."""

    seq: int
    sender_address: str
    indirect: bool = False
    updates: tuple[MemberUpdate, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerList:
    """Peer exchange: a sample of the sender's members. `want_reply` asks for the receiver's."""

    sender_address: str
    members: tuple[MemberUpdate, ...]
    want_reply: bool = False


@dataclass(frozen=True, slots=True)
class Leave:
    """Graceful leave: the sender is going away for good at this incarnation."""

    sender_address: str
    incarnation: int


CLIENT_SCHEME = "client://"
"""Address scheme of a member that nobody can dial (behind NAT, `network.reachable = false`): it
talks only through the connections it opens itself, and is never probed, helped or dialled."""


def client_address(peer_id: str) -> str:
    """The address a client-mode member announces: not dialable, unique per member."""
    return CLIENT_SCHEME + peer_id


def is_client_address(address: str) -> bool:
    """True for the address of a member that cannot be dialled (see CLIENT_SCHEME)."""
    return address.startswith(CLIENT_SCHEME)


def tcp_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a node's address, tcp://HOST:PORT with a port in 0..65535; None for
    anything else."""
    if not address.startswith("tcp://"):
        return None
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or host == "" or "/" in host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


MembershipMessage = Join | Ping | PingReq | Ack | PeerList | Leave
MESSAGE_TYPES: tuple[type, ...] = (Join, Ping, PingReq, Ack, PeerList, Leave)


def _check_str(name: str, value: object, limit: int, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise RemoteProtocolError(f"{name} must be a str, got {type(value).__name__}")
    if len(value) > limit or (not value and not empty_ok):
        raise RemoteProtocolError(f"{name} must be 1..{limit} characters, got {len(value)}")


def is_peer_id(value: object) -> bool:
    """True for a well-formed peer id: 1..MAX_ID_LEN characters, all in ID_CHARS."""
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN and ID_CHARS.issuperset(value)


def _check_id(name: str, value: object, *, empty_ok: bool = False) -> None:
    if empty_ok and value == "":
        return
    if not is_peer_id(value):
        raise RemoteProtocolError(
            f"{name} must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9-_.:], got {value!r:.200}"
        )


def _check_address(name: str, value: object) -> None:
    _check_str(name, value, MAX_ADDRESS_LEN)
    if not all("!" <= ch <= "~" for ch in value):
        raise RemoteProtocolError(f"{name} must be printable ASCII without spaces, got {value!r}")


def _check_int(name: str, value: object, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise RemoteProtocolError(f"{name} must be an int in [0, {limit}), got {value!r}")


def _check_updates(name: str, updates: object, limit: int) -> None:
    if not isinstance(updates, tuple | list):
        raise RemoteProtocolError(f"{name} must be a sequence, got {type(updates).__name__}")
    if len(updates) > limit:
        raise RemoteProtocolError(f"{name} holds {len(updates)} entries, at most {limit} allowed")
    for update in updates:
        if not isinstance(update, MemberUpdate):
            raise RemoteProtocolError(f"{name} must hold MemberUpdate, got {type(update).__name__}")
        _check_id("peer_id", update.peer_id)
        _check_address("address", update.address)
        if update.state not in STATES:
            raise RemoteProtocolError(f"state must be one of {STATES}, got {update.state!r}")
        _check_int("incarnation", update.incarnation, MAX_INCARNATION)
        _check_id("origin", update.origin, empty_ok=True)


def validate_message(msg: object) -> None:
    """Check a decoded membership message from a peer against every bound.

    Args:
        msg: the message as decoded by the transport.

    Raises:
        RemoteProtocolError: naming the first field that is out of bounds or of the wrong type.
    """
    if not isinstance(msg, MESSAGE_TYPES):
        raise RemoteProtocolError(f"not a membership message: {type(msg).__name__}")
    _check_address("sender_address", msg.sender_address)
    if isinstance(msg, Join | Leave):
        _check_int("incarnation", msg.incarnation, MAX_INCARNATION)
    elif isinstance(msg, PeerList):
        _check_updates("members", msg.members, MAX_MEMBERS)
        if not isinstance(msg.want_reply, bool):
            raise RemoteProtocolError(f"want_reply must be a bool, got {msg.want_reply!r}")
    else:
        _check_int("seq", msg.seq, MAX_SEQ)
        _check_updates("updates", msg.updates, MAX_UPDATES)
        if isinstance(msg, PingReq):
            _check_id("target_id", msg.target_id)
            _check_address("target_address", msg.target_address)
        if isinstance(msg, Ack) and not isinstance(msg.indirect, bool):
            raise RemoteProtocolError(f"indirect must be a bool, got {msg.indirect!r}")
