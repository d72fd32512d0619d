# Errors of the gossip protocol, split by whose fault they are (h11's rule). Invariant: a
# RemoteProtocolError never means our state changed; a LocalProtocolError is always our own bug.
from __future__ import annotations


class GossipError(Exception):
    """Base class of every error the gossip package raises on purpose."""


class LocalProtocolError(GossipError):
    """Our own code misused the protocol (a bug here, not the peer's fault)."""


class RemoteProtocolError(GossipError):
    """A peer sent something invalid: drop the message, count it, penalise the peer.

    Raised before any state changes, so the receiving state machine is as it was.
    """


def require_config(config: str, ok: bool, field: str, value: object, expected: str) -> None:
    """Validate one field of a gossip config dataclass.

    Raises:
        ValueError: "<config>.<field> = <value>: expected <expected>" when `ok` is false.
    """
    if not ok:
        raise ValueError(f"{config}.{field} = {value!r}: expected {expected}")
