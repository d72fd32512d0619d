# The member list and its merge rules (SWIM incarnations, Lifeguard suspicion). Invariants: only a
# member raises its own incarnation, by one, to refute a claim at exactly its current incarnation
# (a claim above it is a lie: never adopted, answered with the member's own record), so no
# incarnation of ours nears MAX_INCARNATION; a member's own authenticated word about itself beats
# hearsay about it; "alive" beats "suspect"/"dead" only at a higher incarnation; "suspect" beats
# "alive" at an equal or higher one; "dead" and "left" beat both at an equal or higher one; a
# member learned second-hand is unverified (never a partner or helper, nor announced) until it
# contacts this node itself; at most config.max_members records; a suspicion holds at most
# indirect_probes + 1 origins, each confirmation from a verified live member and at most one per
# sender; every state change queues one update for piggybacking and one event; a member whose
# address is a client address (gossip/_messages.CLIENT_SCHEME) is listed apart from the dialable
# ones, and its last direct contact is kept (its liveness is what this node hears from it).
from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum

from ._membership_config import MembershipConfig
from ._messages import MAX_INCARNATION, MemberUpdate, is_client_address


class MemberState(StrEnum):
    """The state of a member as this node believes it."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)
# a member that said it left, heard from at an older incarnation this long after: not a
# message in flight before the leave, but another process of its identity (a twin) still on
TWIN_AFTER_LEFT_S = 10.0


@dataclass(frozen=True, slots=True)
class Member:
    """A member as seen from this node; `verified` once it contacted this node itself."""

    peer_id: str
    address: str
    state: MemberState
    incarnation: int
    verified: bool = False


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """Something node/ may log: kind is joined, suspected, dead, left, refuted, duplicate
    (another node claims this node's identity at `address`), or twin (a member that said it
    left still talks to us from an older process of its identity: it is alive again)."""

    kind: str
    peer_id: str
    incarnation: int
    at: float
    address: str = ""


@dataclass(slots=True)
class _Record:
    peer_id: str
    address: str
    state: MemberState
    incarnation: int
    changed_at: float
    verified: bool = False
    heard_at: float = float("-inf")  # its last message to this node itself
    suspecters: list[str] = field(default_factory=list)  # distinct origins, first one first
    vouchers: list[str] = field(default_factory=list)  # the sender that brought each origin
    left_said: bool = False  # LEFT by its own word (hearsay's LEFT yields to its own word)
    # revived as a twin over its LEFT at this incarnation: hearsay of that leave (others keep
    # it for dead_retention_s) does not apply (it would flip the record between left and alive)
    revived_over: int = -1


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
        self._verified_cache: tuple[str, ...] | None = None
        self._clients_cache: tuple[str, ...] | None = None  # live client ids, verified or not
        self.changes = 0  # counts changes of members, their states and addresses (not timers)

    # -- queries -------------------------------------------------------------------------------
    def get(self, peer_id: str) -> _Record | None:
        return self._records.get(peer_id)

    def live_ids(self) -> tuple[str, ...]:
        """Ids of alive and suspect members, verified or not, sorted; cached until a change."""
        if self._live_cache is None:
            self._live_cache = tuple(
                sorted(p for p, r in self._records.items() if r.state in _LIVE)
            )
        return self._live_cache

    def verified_live_ids(self) -> tuple[str, ...]:
        """Ids of alive and suspect members that contacted this node themselves, sorted; cached."""
        if self._verified_cache is None:
            self._verified_cache = tuple(p for p in self.live_ids() if self._records[p].verified)
        return self._verified_cache

    def live_client_ids(self) -> tuple[str, ...]:
        """Ids of alive and suspect members with a client address (never dialled), sorted;
        cached."""
        if self._clients_cache is None:
            live = self.live_ids()
            self._clients_cache = tuple(
                p for p in live if is_client_address(self._records[p].address)
            )
        return self._clients_cache

    def unverified_live_count(self) -> int:
        """How many alive or suspect members are known only second-hand (cheap: cached ids)."""
        return len(self.live_ids()) - len(self.verified_live_ids())

    def unverified_live_ids(self) -> list[str]:
        """Ids of alive and suspect members known only second-hand, sorted."""
        return [p for p in self.live_ids() if not self._records[p].verified]

    def is_verified_live(self, peer_id: str) -> bool:
        r = self._records.get(peer_id)
        return r is not None and r.verified and r.state in _LIVE

    def ids_in(self, *states: MemberState, verified_only: bool = False) -> list[str]:
        return sorted(
            p
            for p, r in self._records.items()
            if r.state in states and (r.verified or not verified_only)
        )

    def size(self) -> int:
        """Members counted for timers: this node plus every alive or suspect member."""
        return 1 + len(self.live_ids())

    def members(self) -> list[Member]:
        return [
            Member(r.peer_id, r.address, r.state, r.incarnation, r.verified)
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
                self._forget(r.peer_id)

    # -- changes -------------------------------------------------------------------------------
    def _set(
        self,
        r: _Record,
        state: MemberState,
        inc: int,
        now: float,
        event: str,
        origin: str = "",
        sender: str = "",
    ) -> None:
        if (r.state in _LIVE) != (state in _LIVE):
            self._live_cache = self._verified_cache = self._clients_cache = None
        self.changes += 1
        r.state, r.incarnation, r.changed_at = state, inc, now
        r.left_said = False
        suspect = state is MemberState.SUSPECT
        r.suspecters = [origin or self.self_id] if suspect else []
        r.vouchers = [sender or self.self_id] if suspect else []
        self._queue(self.update_of(r.peer_id))
        self._events.append(MembershipEvent(event, r.peer_id, inc, now))

    def _queue(self, update: MemberUpdate) -> None:
        self._broadcasts[update.peer_id] = [update, self._config.retransmits(self.size())]

    def _add(self, peer_id: str, address: str, inc: int, now: float, verified: bool) -> None:
        """A new alive member; only a verified one is announced (hearsay is not amplified)."""
        self._records[peer_id] = _Record(peer_id, address, MemberState.ALIVE, inc, now, verified)
        self._live_cache = self._verified_cache = self._clients_cache = None
        self.changes += 1
        if verified:
            self._queue(self.update_of(peer_id))
            self._events.append(MembershipEvent("joined", peer_id, inc, now))

    def _set_address(self, r: _Record, address: str) -> None:
        if is_client_address(address) != is_client_address(r.address):
            self._clients_cache = None
        self.changes += int(address != r.address)
        r.address = address

    def _forget(self, peer_id: str) -> None:
        r = self._records.pop(peer_id)
        self.changes += 1
        if r.state in _LIVE:
            self._live_cache = self._verified_cache = self._clients_cache = None
        self._broadcasts.pop(peer_id, None)

    def _make_room(self) -> bool:
        """True when one more record fits, after forgetting the oldest unverified one if need be."""
        if len(self._records) < self._config.max_members:
            return True
        unverified = [r for r in self._records.values() if not r.verified]
        if not unverified:
            return False
        self._forget(min(unverified, key=lambda r: r.changed_at).peer_id)
        return True

    def _apply_about_self(self, u: MemberUpdate, now: float) -> bool:
        """A claim about this node. Returns True when it is wrong (the sender needs our record).

        "Alive at a newer incarnation (a later start time), at another address" is what a
        second node started with this node's identity spreads about itself: said (a duplicate
        event), not fought over (raising our incarnation above it would start a race between
        the two).
        """
        # (a client's twin announces the same address, client://<its ID>: any newer
        # incarnation of ours is another process then)
        if (u.state == "alive" and u.incarnation > self.incarnation
                and (u.address != self.self_address
                     or is_client_address(self.self_address))):  # fmt: skip
            self._events.append(MembershipEvent("duplicate", self.self_id, u.incarnation, now,
                                                u.address))  # fmt: skip
        if self.left or (u.state == "alive" and u.incarnation <= self.incarnation):
            return False
        if u.incarnation == self.incarnation and u.incarnation + 1 < MAX_INCARNATION:
            self.incarnation += 1  # refute; a claim above our incarnation is never adopted
            self._events.append(MembershipEvent("refuted", self.self_id, self.incarnation, now))
        self._queue(self.self_update())
        return True

    def suspect(self, peer_id: str, now: float) -> None:
        """Our own probe of `peer_id` failed: suspect it at its current incarnation. Suspected
        already on another member's word, ours is an independent confirmation (Lifeguard): it
        shortens the suspicion here and is gossiped to shorten it elsewhere. (It was dropped: in
        a 3-node swarm where both survivors suspected a crashed peer, each heard the other's
        suspicion first and neither counted a confirmation: 48 s to dead instead of 8 s.)"""
        r = self._records.get(peer_id)
        if r is None:
            return
        if r.state is MemberState.ALIVE:
            self._set(r, MemberState.SUSPECT, r.incarnation, now, "suspected")
        elif (r.state is MemberState.SUSPECT and self.self_id not in r.suspecters
              and len(r.suspecters) <= self._config.indirect_probes):  # fmt: skip
            r.suspecters.append(self.self_id)
            r.vouchers.append(self.self_id)
            self._queue(MemberUpdate(r.peer_id, r.address, str(MemberState.SUSPECT),
                                     r.incarnation, self.self_id))  # fmt: skip

    def heard_from(self, peer_id: str, address: str, now: float) -> bool:
        """An authenticated message came from `peer_id`: learn it if unknown, mark it verified.

        Returns:
            False when the table is full of verified members and `peer_id` is not one of them.
        """
        r = self._records.get(peer_id)
        if r is None:
            if not self._make_room():
                return False
            self._add(peer_id, address, 0, now, verified=True)  # its incarnation comes later
            r = self._records[peer_id]
        elif not r.verified:
            r.verified, r.address = True, address  # its own address beats hearsay
            self._verified_cache = self._clients_cache = None
            self.changes += 1
            self._queue(self.update_of(peer_id))
            self._events.append(MembershipEvent("joined", peer_id, r.incarnation, now))
        r.heard_at = now
        return True

    def apply_own_word(self, peer_id: str, address: str, inc: int, now: float) -> None:
        """`peer_id` itself (authenticated) says it is alive at `inc`: that beats hearsay.

        A lower incarnation than recorded replaces it too, since only the member sets it: this
        undoes a third party's made-up incarnation. A member that said itself it left needs a
        higher one to return; one that left by hearsay (which a made-up incarnation, raised by
        a suspicion, could keep out for good) returns at its word.
        """
        r = self._records.get(peer_id)
        if r is None:
            return
        if r.state is MemberState.LEFT and r.left_said and inc <= r.incarnation:
            # an older process of its identity still talking well after the newer one said it
            # left (two processes with one key file: a client's twin is not seen by address)
            # is alive: it was shown "left" for good while it exchanged on
            if not (inc < r.incarnation and now - r.changed_at > TWIN_AFTER_LEFT_S):
                return
            self._events.append(MembershipEvent("twin", peer_id, inc, now, address))
            r.revived_over = r.incarnation
        if r.state is MemberState.ALIVE and inc <= r.incarnation:
            if inc < r.incarnation:
                r.incarnation = inc
                self._queue(self.update_of(peer_id))
            return
        self._set_address(r, address)
        kind = {MemberState.ALIVE: "", MemberState.SUSPECT: "refuted"}.get(r.state, "joined")
        if kind:
            self._set(r, MemberState.ALIVE, inc, now, kind)
        else:
            r.incarnation = inc
            self._queue(self.update_of(peer_id))

    def apply(self, u: MemberUpdate, now: float, sender: str) -> bool:
        """Merge one (validated) update that `sender` sent into the table.

        Returns:
            True when the update is a wrong claim about this node (answer with our own record).
        """
        if u.peer_id == self.self_id:
            return self._apply_about_self(u, now)
        r = self._records.get(u.peer_id)
        state = MemberState(u.state)
        if r is None:
            if state in _LIVE and len(self._records) < self._config.max_members:
                self._add(u.peer_id, u.address, u.incarnation, now, verified=False)
        elif state is MemberState.ALIVE:
            self._apply_alive(r, u, now)
        elif state is MemberState.SUSPECT:
            self._apply_suspect(r, u, now, sender)
        elif state is MemberState.LEFT and u.incarnation <= r.revived_over:
            pass  # the twin's leave, which we overruled (others still gossip it)
        elif u.incarnation >= r.incarnation and r.state not in (state, MemberState.LEFT):
            # dead or left: hearsay never raises a member's incarnation (a made-up 2^53 - 1 put
            # it where its own word could never beat it: a live member cut off for good, even
            # after a restart); the member itself may
            inc = u.incarnation if sender == u.peer_id else r.incarnation
            self._set(r, state, inc, now, str(state))
            r.left_said = state is MemberState.LEFT and sender == u.peer_id
        return False

    def _apply_alive(self, r: _Record, u: MemberUpdate, now: float) -> None:
        if u.incarnation <= r.incarnation:
            return
        self._set_address(r, u.address)
        kind = {MemberState.ALIVE: "", MemberState.SUSPECT: "refuted"}.get(r.state, "joined")
        if kind:
            self._set(r, MemberState.ALIVE, u.incarnation, now, kind)
        else:
            r.incarnation = u.incarnation
            self._queue(self.update_of(r.peer_id))

    def _apply_suspect(self, r: _Record, u: MemberUpdate, now: float, sender: str) -> None:
        if r.state not in _LIVE or u.incarnation < r.incarnation:
            return
        origin = u.origin or "?"
        if r.state is MemberState.SUSPECT and u.incarnation == r.incarnation:
            if self._confirms(r, origin, sender):
                r.suspecters.append(origin)  # an independent confirmation: suspicion shortens
                r.vouchers.append(sender)
                self._queue(u)
        elif r.state is MemberState.SUSPECT:
            r.incarnation, r.changed_at = u.incarnation, now
            r.suspecters, r.vouchers = [origin], [sender]
            self._queue(u)
        else:
            self._set(r, MemberState.SUSPECT, u.incarnation, now, "suspected", origin, sender)

    def _confirms(self, r: _Record, origin: str, sender: str) -> bool:
        """Whether `origin`'s suspicion, brought by `sender`, counts as one more confirmation.

        At most indirect_probes confirmations, each from a verified live member other than the
        suspect, and at most one per sender, who must be that member or a verified live one.
        """
        if len(r.suspecters) > self._config.indirect_probes:
            return False
        if origin in r.suspecters or sender in r.vouchers or origin == r.peer_id:
            return False
        if not self.is_verified_live(origin):
            return False
        return sender == origin or self.is_verified_live(sender)

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
        """This node plus up to k-1 random members of any state, `about`'s record first."""
        others = [p for p in self._records if p != about]
        picked = rng.sample(others, max(0, min(len(others), k - 1 - (about in self._records))))
        if about in self._records and k > 1:
            picked.insert(0, about)
        return (self.self_update(), *(self.update_of(p) for p in picked))
