# The member list and its merge rules (SWIM incarnations, Lifeguard suspicion). Invariants: only a
# member raises its own incarnation (to refute); "alive" beats "suspect"/"dead" only at a higher
# incarnation; "suspect" beats "alive" at an equal or higher one; "dead" and "left" beat both at an
# equal or higher one; every state change queues one update for piggybacking and one event.
from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum

from ._membership_config import MembershipConfig
from ._messages import MemberUpdate


class MemberState(StrEnum):
    """The state of a member as this node believes it."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)


@dataclass(frozen=True, slots=True)
class Member:
    """A member as seen from this node."""

    peer_id: str
    address: str
    state: MemberState
    incarnation: int


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """Something node/ may log: kind is joined, suspected, dead, left or refuted."""

    kind: str
    peer_id: str
    incarnation: int
    at: float


@dataclass(slots=True)
class _Record:
    peer_id: str
    address: str
    state: MemberState
    incarnation: int
    changed_at: float
    suspecters: list[str] = field(default_factory=list)  # distinct origins, first one first


class MembershipTable:
    """Members, their states and incarnations, the updates waiting to be piggybacked.

    Args:
        self_id: this node's id.
        self_address: where this node is reached.
        incarnation: this node's starting incarnation (a restarted daemon may pass a larger one).
        config: timers and fan-outs.
    """

    def __init__(
        self, self_id: str, self_address: str, incarnation: int, config: MembershipConfig
    ) -> None:
        self.self_id = self_id
        self.self_address = self_address
        self.incarnation = incarnation
        self.left = False
        self._config = config
        self._records: dict[str, _Record] = {}
        self._broadcasts: dict[str, list] = {}  # peer_id -> [MemberUpdate, sends left]
        self._events: list[MembershipEvent] = []
        self._live_cache: tuple[str, ...] | None = None

    # -- queries -------------------------------------------------------------------------------
    def get(self, peer_id: str) -> _Record | None:
        return self._records.get(peer_id)

    def live_ids(self) -> tuple[str, ...]:
        """Ids of alive and suspect members, sorted; the same tuple object until a change."""
        if self._live_cache is None:
            self._live_cache = tuple(
                sorted(p for p, r in self._records.items() if r.state in _LIVE)
            )
        return self._live_cache

    def ids_in(self, *states: MemberState) -> list[str]:
        return sorted(p for p, r in self._records.items() if r.state in states)

    def size(self) -> int:
        """Members counted for timers: this node plus every alive or suspect member."""
        return 1 + len(self.live_ids())

    def members(self) -> list[Member]:
        return [
            Member(r.peer_id, r.address, r.state, r.incarnation)
            for r in sorted(self._records.values(), key=lambda r: r.peer_id)
        ]

    def self_update(self) -> MemberUpdate:
        state = MemberState.LEFT if self.left else MemberState.ALIVE
        return MemberUpdate(self.self_id, self.self_address, str(state), self.incarnation)

    def update_of(self, peer_id: str) -> MemberUpdate:
        r = self._records[peer_id]
        origin = r.suspecters[0] if r.state is MemberState.SUSPECT else ""
        return MemberUpdate(r.peer_id, r.address, str(r.state), r.incarnation, origin)

    def drain_events(self) -> list[MembershipEvent]:
        events, self._events = self._events, []
        return events

    # -- suspicion timers ----------------------------------------------------------------------
    def suspicion_deadline(self, record: _Record) -> float:
        confirmations = max(0, len(record.suspecters) - 1)
        return record.changed_at + self._config.suspicion_timeout(self.size(), confirmations)

    def next_suspicion_deadline(self) -> float:
        deadlines = [
            self.suspicion_deadline(r)
            for r in self._records.values()
            if r.state is MemberState.SUSPECT
        ]
        return min(deadlines, default=float("inf"))

    def expire(self, now: float) -> None:
        """Declare dead every suspect whose suspicion ran out; forget long-dead members."""
        for r in list(self._records.values()):
            if r.state is MemberState.SUSPECT and now >= self.suspicion_deadline(r):
                self._set(r, MemberState.DEAD, r.incarnation, now, "dead")
            elif r.state not in _LIVE and now - r.changed_at > self._config.dead_retention_s:
                del self._records[r.peer_id]
                self._broadcasts.pop(r.peer_id, None)

    # -- changes -------------------------------------------------------------------------------
    def _set(
        self, r: _Record, state: MemberState, inc: int, now: float, event: str, origin: str = ""
    ) -> None:
        if (r.state in _LIVE) != (state in _LIVE):
            self._live_cache = None
        r.state, r.incarnation, r.changed_at = state, inc, now
        r.suspecters = [origin or self.self_id] if state is MemberState.SUSPECT else []
        self._queue(self.update_of(r.peer_id))
        self._events.append(MembershipEvent(event, r.peer_id, inc, now))

    def _queue(self, update: MemberUpdate) -> None:
        self._broadcasts[update.peer_id] = [update, self._config.retransmits(self.size())]

    def _refute(self, inc: int, now: float) -> None:
        if self.left or inc < self.incarnation:
            return
        self.incarnation = inc + 1
        self._queue(self.self_update())
        self._events.append(MembershipEvent("refuted", self.self_id, self.incarnation, now))

    def suspect(self, peer_id: str, now: float) -> None:
        """Our own probe of `peer_id` failed: suspect it at its current incarnation."""
        r = self._records.get(peer_id)
        if r is not None and r.state is MemberState.ALIVE:
            self._set(r, MemberState.SUSPECT, r.incarnation, now, "suspected")

    def heard_from(self, peer_id: str, address: str, now: float) -> None:
        """A message came from `peer_id`: learn it if unknown (its incarnation comes later)."""
        if peer_id != self.self_id and peer_id not in self._records:
            self.apply(MemberUpdate(peer_id, address, "alive", 0), now)

    def apply(self, u: MemberUpdate, now: float) -> None:
        """Merge one (validated) update from a peer into the table."""
        if u.peer_id == self.self_id:
            if u.state != "alive" and not self.left:
                self._refute(u.incarnation, now)
            return
        r = self._records.get(u.peer_id)
        state = MemberState(u.state)
        if r is None:
            if state in _LIVE:
                r = _Record(u.peer_id, u.address, MemberState.ALIVE, u.incarnation, now)
                self._records[u.peer_id] = r
                self._live_cache = None
                self._queue(self.update_of(u.peer_id))
                self._events.append(MembershipEvent("joined", u.peer_id, u.incarnation, now))
            return
        if state is MemberState.ALIVE:
            self._apply_alive(r, u, now)
        elif state is MemberState.SUSPECT:
            self._apply_suspect(r, u, now)
        elif u.incarnation >= r.incarnation and r.state not in (state, MemberState.LEFT):
            self._set(r, state, u.incarnation, now, str(state))

    def _apply_alive(self, r: _Record, u: MemberUpdate, now: float) -> None:
        if u.incarnation <= r.incarnation:
            return
        r.address = u.address
        kind = {MemberState.ALIVE: "", MemberState.SUSPECT: "refuted"}.get(r.state, "joined")
        if kind:
            self._set(r, MemberState.ALIVE, u.incarnation, now, kind)
        else:
            r.incarnation = u.incarnation
            self._queue(self.update_of(r.peer_id))

    def _apply_suspect(self, r: _Record, u: MemberUpdate, now: float) -> None:
        if r.state not in _LIVE or u.incarnation < r.incarnation:
            return
        origin = u.origin or "?"
        if r.state is MemberState.SUSPECT and u.incarnation == r.incarnation:
            if origin not in r.suspecters:
                r.suspecters.append(origin)  # an independent confirmation: suspicion shortens
                self._queue(u)
        elif r.state is MemberState.SUSPECT:
            r.incarnation, r.changed_at, r.suspecters = u.incarnation, now, [origin]
            self._queue(u)
        else:
            self._set(r, MemberState.SUSPECT, u.incarnation, now, "suspected", origin)

    def leave(self, now: float) -> None:
        self.left = True
        self._events.append(MembershipEvent("left", self.self_id, self.incarnation, now))

    # -- what goes on the wire -----------------------------------------------------------------
    def piggyback(self, limit: int) -> tuple[MemberUpdate, ...]:
        """Up to `limit` queued updates, least-sent first, each sent a bounded number of times."""
        chosen = sorted(self._broadcasts.items(), key=lambda kv: -kv[1][1])[:limit]
        for peer_id, entry in chosen:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._broadcasts[peer_id]
        return tuple(entry[0] for _, entry in chosen)

    def sample(self, k: int, rng: random.Random, about: str | None = None) -> tuple:
        """This node plus up to k-1 random members of any state, `about`'s own record first."""
        others = [p for p in self._records if p != about]
        picked = rng.sample(others, max(0, min(len(others), k - 1 - (about in self._records))))
        if about in self._records and k > 1:
            picked.insert(0, about)
        return (self.self_update(), *(self.update_of(p) for p in picked))
