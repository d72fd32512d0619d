# Routing of a node's incoming requests. Invariants: each message type has exactly one owner
# part; a request of a type nobody owns is refused, counted and logged; while the node starts
# (no routes yet) or a part is held, requests are answered "busy", which the asking peer retries
# and which counts nothing against it.
from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from ._log_quota import log_within_quota
from .transport import ErrorReply, Header, PeerInfo

Handler = Callable[[PeerInfo, Header, memoryview], Awaitable[tuple[Header, bytes]]]


class Part(Protocol):
    """A part of the node that answers requests: the message types it owns and its handler."""

    handles: Iterable[type[Header]]

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]: ...


class Router:
    """Hands each request to the part that owns its message type."""

    def __init__(self) -> None:
        self._routes: dict[type[Header], Handler] = {}
        self.rejected: Counter[str] = Counter()
        self._held: dict[type[Header], str] = {}  # kinds answered "busy" for now, and why

    def hold(self, part: Part, reason: str) -> None:
        """Answer `part`'s requests "busy" (`reason`) until release(): not refused, nothing
        counted against the asking peer, which tries again later."""
        self._held.update(dict.fromkeys(part.handles, reason))

    def release(self) -> None:
        self._held.clear()

    def add(self, part: Part) -> None:
        """Route `part.handles` to `part.handle`.

        Raises:
            ValueError: another part owns one of them already (a bug in the node's wiring).
        """
        for kind in part.handles:
            if kind in self._routes:
                raise ValueError(f"two parts of the node answer {kind.__name__}")
            self._routes[kind] = part.handle

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        handler = self._routes.get(type(header))
        if handler is not None:
            held = self._held.get(type(header))
            if held is not None:
                return ErrorReply(code="busy", reason=held), b""
            return await handler(peer, header, payload)
        if not self._routes:  # still starting: the peer may retry
            return ErrorReply(code="busy", reason="node starting"), b""
        self.rejected["unexpected"] += 1
        kind = type(header).__name__
        log_within_quota("message_rejected", peer=peer.short_id, kind="unexpected", reason=kind)
        return ErrorReply(code="bad_request", reason=f"unexpected {kind}"), b""
