# SWIM-style membership driver (probing, indirect probes, join, peer exchange, leave), sans-I/O.
# Invariants: time only arrives as `now`; randomness only from the injected rng; a message from a
# peer is validated before any state changes; at most one probe is outstanding; every Send names
# the destination address (and the peer id when known); no reply is ever awaited: a missing answer
# is noticed by this machine's own timers, driven by tick() at next_deadline(); an Ack counts only
# from the peer that was pinged (or, forwarded, from a helper we asked); this node pings for others
# only members it has verified, at the address it recorded itself; a member with a client address
# (is_client_address) is never sent anything to: not probed, verified, asked to help, told of a
# leave or chosen for peer exchange; it is suspected when it has been silent towards this node for
# config.client_silence_s, and node/ answers it only on the connections it opens.
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import LocalProtocolError, RemoteProtocolError
from ._membership_config import MembershipConfig
from ._membership_table import Member, MembershipEvent, MembershipTable, MemberState
from ._messages import (
    MAX_ADDRESS_LEN,
    MAX_INCARNATION,
    Ack,
    Join,
    Leave,
    MembershipMessage,
    MemberUpdate,
    PeerList,
    Ping,
    PingReq,
    is_client_address,
    is_peer_id,
    validate_message,
)

MAX_FORWARDS = 1024
"""Most indirect probes this node runs for others at once; further PingReqs are ignored."""
MAX_FORWARDS_PER_PEER = 2
"""Most indirect probes run at once for one requester (an honest one has one probe open)."""
JOIN_FIRST_RETRY_S = 0.25
"""The first resend of an unanswered Join; each next one waits twice as long, up to join_retry_s."""


@dataclass(frozen=True, slots=True)
class Send:
    """A message for node/ to deliver: to `address`, which belongs to `peer_id` when known."""

    address: str
    peer_id: str | None
    message: MembershipMessage


@dataclass(frozen=True, slots=True)
class RttSample:
    """A round-trip time measured by a direct probe, for the link table."""

    peer_id: str
    rtt_s: float
    at: float


@dataclass(slots=True)
class _Probe:
    seq: int
    target: str
    sent_at: float
    indirect_sent: bool = False
    helpers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Forward:
    """An indirect probe run for `requester`: its Ack(seq) goes back once `target` answers."""

    requester: str
    address: str
    seq: int
    target: str
    expires: float


class Membership:
    """One node's view of the swarm, kept by SWIM probing with Lifeguard suspicion.

    Args:
        self_id: this node's peer id.
        self_address: where peers reach this node (opaque here).
        config: timers and fan-outs.
        rng: the only source of randomness (probe order, helpers, samples).
        incarnation: starting incarnation; a restarted daemon may pass a larger one.
    """

    def __init__(
        self,
        self_id: str,
        self_address: str,
        config: MembershipConfig,
        rng: random.Random,
        incarnation: int = 0,
    ) -> None:
        if not is_peer_id(self_id) or not 0 < len(self_address) <= MAX_ADDRESS_LEN:
            raise LocalProtocolError(f"bad self_id {self_id!r} or self_address {self_address!r}")
        if not 0 <= incarnation < MAX_INCARNATION // 2:
            raise LocalProtocolError(f"incarnation {incarnation!r}: expected in [0, 2**52)")
        self._config = config
        self._rng = rng
        self._table = MembershipTable(self_id, self_address, incarnation, config)
        self._seq = 0
        self._probe: _Probe | None = None
        self._order: list[str] = []
        self._order_pos = 0
        self._forwards: dict[int, _Forward] = {}
        self._rtts: list[RttSample] = []
        self._bootstrap: tuple[str, ...] = ()
        self._joined = True
        inf = float("-inf")
        self._next_probe_at = self._next_exchange_at = self._next_reconnect_at = inf
        self._join_retry_at = self._next_verify_at = inf
        self._join_backoff_s = JOIN_FIRST_RETRY_S
        self._verify_pinged: dict[str, float] = {}  # unverified member -> when we last pinged it
        self._dialable: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())
        # A client hears the swarm's news only in answers to what it sends (piggybacked updates
        # run out on the members that are pinged): it swaps member lists every two periods.
        # Servers back off while their table holds still (MembershipConfig's
        # peer_exchange_max_interval_s); a client does not: swaps are how it hears the news.
        self._exchange_interval_s = self._exchange_base_s = config.peer_exchange_interval_s
        self._exchange_max_s = config.exchange_max_interval_s
        if is_client_address(self_address):
            self._exchange_base_s = min(self._exchange_base_s, 2 * config.probe_interval_s)
            self._exchange_interval_s = self._exchange_max_s = self._exchange_base_s
        self._changes_at_exchange = -1

    # -- public queries ------------------------------------------------------------------------
    @property
    def self_id(self) -> str:
        return self._table.self_id

    @property
    def incarnation(self) -> int:
        return self._table.incarnation

    @property
    def joined(self) -> bool:
        """False from join() until some member answered."""
        return self._joined

    def members(self) -> list[Member]:
        """Every member this node knows of (not itself), dead and left ones while retained."""
        return self._table.members()

    def live_peers(self) -> tuple[str, ...]:
        """Ids of alive and suspect members that contacted this node themselves, sorted.

        Members only heard of second-hand are left out (they are pinged, verify_batch a probe
        period, so a real one is verified within a period or two). One tuple object until
        membership changes.
        """
        return self._table.verified_live_ids()

    def dialable_peers(self) -> tuple[str, ...]:
        """live_peers() less the client-mode members (those nobody can dial), sorted; one tuple
        until membership changes. Partners, helpers and state servers come from these."""
        verified, clients = self._table.verified_live_ids(), self._table.live_client_ids()
        if self._dialable[0] is not verified or self._dialable[1] is not clients:
            gone = set(clients)
            dialable = tuple(p for p in verified if p not in gone) if gone else verified
            self._dialable = (verified, clients, dialable)
        return self._dialable[2]

    def live_count(self) -> int:
        """Members believed alive: live_peers(), plus client-mode members known second-hand (a
        client is verified only by the members it dials itself)."""
        verified = self._table.verified_live_ids()
        clients = self._table.live_client_ids()
        return len(verified) + sum(not self._table.get(p).verified for p in clients)

    def is_client(self, peer_id: str) -> bool:
        """True when `peer_id` is a client-mode member (never dialled)."""
        record = self._table.get(peer_id)
        return record is not None and is_client_address(record.address)

    def address_of(self, peer_id: str) -> str | None:
        record = self._table.get(peer_id)
        return None if record is None else record.address

    def drain_events(self) -> list[MembershipEvent]:
        """Events since the last call: joined, suspected, dead, left, refuted."""
        return self._table.drain_events()

    def drain_rtt_samples(self) -> list[RttSample]:
        """Round-trip times measured by direct probes since the last call."""
        samples, self._rtts = self._rtts, []
        return samples

    def next_deadline(self) -> float:
        """When tick() must be called next (it may be called earlier)."""
        if self._table.left:
            return float("inf")
        deadlines = [
            self._next_probe_at,
            self._next_exchange_at,
            self._next_reconnect_at,
            self._table.next_suspicion_deadline(),
        ]
        if self._probe is not None:
            if not self._probe.indirect_sent:
                deadlines.append(self._probe.sent_at + self._config.probe_timeout_s)
            deadlines.append(self._probe.sent_at + self._config.probe_interval_s)
        if not self._joined:
            deadlines.append(self._join_retry_at)
        if self._config.verify_batch and self._table.unverified_live_count():
            deadlines.append(self._next_verify_at)
        return min(deadlines)

    # -- commands ------------------------------------------------------------------------------
    def join(self, bootstrap_addresses: Sequence[str], now: float) -> list[Send]:
        """Start joining through `bootstrap_addresses` (empty: this node starts a new swarm)."""
        if self._table.left:
            raise LocalProtocolError("join() after leave()")
        self._bootstrap = tuple(a for a in bootstrap_addresses if a != self._table.self_address)
        self._joined = not self._bootstrap
        self._join_backoff_s = JOIN_FIRST_RETRY_S
        out: list[Send] = []
        if not self._joined:
            self._send_joins(now, out)
        return out

    def leave(self, now: float) -> list[Send]:
        """Leave for good: tell up to leave_fanout members, who spread the news."""
        if self._table.left:
            return []
        self._table.leave(now)
        live = list(self.dialable_peers())
        told = self._rng.sample(live, min(len(live), self._config.leave_fanout))
        msg = Leave(self._table.self_address, self._table.incarnation)
        return [self._send_to(peer, msg) for peer in told]

    def tick(self, now: float) -> list[Send]:
        """Run every timer that is due: probes, indirect probes, verification pings, suspicion,
        exchange, rejoin."""
        if self._table.left:
            return []
        out: list[Send] = []
        self._table.expire(now)
        self._probe_step(now, out)
        self._suspect_silent_clients(now)
        self._verify_step(now, out)
        if not self._joined and now >= self._join_retry_at:
            self._send_joins(now, out)
        if self._exchange_interval_s > self._exchange_base_s and (
            self._table.changes != self._changes_at_exchange
        ):  # news after a quiet spell: the next swap comes at the base interval (Trickle)
            self._exchange_interval_s = self._exchange_base_s
            self._next_exchange_at = min(self._next_exchange_at, now + self._exchange_base_s)
        if now >= self._next_exchange_at:
            interval = self._next_exchange_interval()
            if interval > self._exchange_base_s:  # backed off: a random point of its second half
                interval *= 0.5 + 0.5 * self._rng.random()
            self._next_exchange_at = now + interval
            live = self.dialable_peers()
            if live:
                self._send_peer_list(self._rng.choice(live), out)
        if now >= self._next_reconnect_at:
            self._next_reconnect_at = now + self._config.reconnect_interval_s
            self._reconnect(now, out)
        for seq in [s for s, f in self._forwards.items() if f.expires <= now]:
            del self._forwards[seq]
        return out

    def receive(self, msg: MembershipMessage, sender_id: str, now: float) -> list[Send]:
        """Handle a message that `sender_id` sent (its id as proven by the secure channel).

        Raises:
            RemoteProtocolError: the message is malformed or out of bounds; nothing changed.
        """
        validate_message(msg)
        if not is_peer_id(sender_id):
            raise RemoteProtocolError(f"bad sender id {sender_id!r:.200}")
        if sender_id == self._table.self_id:
            raise RemoteProtocolError(
                "a message from a node with this node's own identity: another node runs with "
                "this identity (its key file), or a bootstrap address is this node's own")
        if self._table.left:
            return []
        out: list[Send] = []
        if isinstance(msg, Leave):
            if self._table.get(sender_id) is not None:
                left = MemberUpdate(sender_id, msg.sender_address, "left", msg.incarnation)
                self._table.apply(left, now, sender_id)
            return out
        self._table.heard_from(sender_id, msg.sender_address, now)
        if isinstance(msg, Join):
            self._table.apply_own_word(sender_id, msg.sender_address, msg.incarnation, now)
            self._send_peer_list(sender_id, out, False, msg.sender_address)
        else:
            self._receive_gossip(msg, sender_id, now, out)
        return out

    # -- internals -----------------------------------------------------------------------------
    def _receive_gossip(self, msg, sender_id: str, now: float, out: list[Send]) -> None:
        updates = msg.members if isinstance(msg, PeerList) else msg.updates
        wrong_about_us = False
        for update in updates:
            if update.peer_id == sender_id and update.state == "alive":
                self._table.apply_own_word(sender_id, update.address, update.incarnation, now)
            else:
                wrong_about_us |= self._table.apply(update, now, sender_id)
        if isinstance(msg, Ping):
            piggyback = self._piggyback(sender_id, with_self=wrong_about_us)
            ack = Ack(msg.seq, self._table.self_address, updates=piggyback)
            out.append(self._reply(sender_id, msg.sender_address, ack))
        elif isinstance(msg, PingReq):
            self._help_probe(msg, sender_id, now, out)
        elif isinstance(msg, Ack):
            self._receive_ack(msg, sender_id, now, out)
        else:  # PeerList
            self._joined = True
            if msg.want_reply or wrong_about_us:  # our reply lists our own record first
                self._send_peer_list(sender_id, out, False, msg.sender_address)

    def _help_probe(self, msg: PingReq, sender_id: str, now: float, out: list[Send]) -> None:
        """Ping a member for `sender_id`: only one we verified, at the address we recorded."""
        target = msg.target_id
        if len(self._forwards) >= MAX_FORWARDS or target == sender_id:
            return
        if not self._table.is_verified_live(target) or self.is_client(target):
            return
        if sum(f.requester == sender_id for f in self._forwards.values()) >= MAX_FORWARDS_PER_PEER:
            return
        seq = self._next_seq()
        requester_address = self.address_of(sender_id) or msg.sender_address
        expires = now + self._config.probe_interval_s
        self._forwards[seq] = _Forward(sender_id, requester_address, msg.seq, target, expires)
        ping = Ping(seq, self._table.self_address, self._piggyback(target))
        out.append(self._send_to(target, ping))

    def _receive_ack(self, msg: Ack, sender_id: str, now: float, out: list[Send]) -> None:
        forward = self._forwards.get(msg.seq)
        if forward is not None:
            if sender_id == forward.target and not msg.indirect:
                del self._forwards[msg.seq]
                piggyback = self._piggyback(forward.requester)
                ack = Ack(forward.seq, self._table.self_address, True, piggyback)
                out.append(self._reply(forward.requester, forward.address, ack))
            return
        probe = self._probe
        if probe is None or msg.seq != probe.seq:
            return
        if not msg.indirect and sender_id == probe.target:
            self._rtts.append(RttSample(sender_id, now - probe.sent_at, now))
            self._probe = None
        elif msg.indirect and sender_id in probe.helpers:
            self._probe = None

    def _probe_step(self, now: float, out: list[Send]) -> None:
        cfg, probe = self._config, self._probe
        if probe is not None:
            if not probe.indirect_sent and now >= probe.sent_at + cfg.probe_timeout_s:
                probe.indirect_sent = True
                self._send_ping_reqs(probe, out)
            if now >= probe.sent_at + cfg.probe_interval_s:
                self._probe = None
                self._table.suspect(probe.target, now)
        if self._probe is None and now >= self._next_probe_at:
            self._next_probe_at = now + cfg.probe_interval_s
            target = self._next_target()
            if target is not None:
                self._probe = _Probe(self._next_seq(), target, now)
                ping = Ping(self._probe.seq, self._table.self_address, self._piggyback(target))
                out.append(self._send_to(target, ping))

    def _suspect_silent_clients(self, now: float) -> None:
        """Suspect each verified client that has not contacted this node for client_silence_s
        (nobody probes a client: what it sends is the only sign of its life)."""
        clients = self._table.live_client_ids()
        if not clients:
            return
        quiet_since = now - self._config.client_silence_s(self._table.size())
        for peer in clients:
            record = self._table.get(peer)
            if record.verified and record.state is MemberState.ALIVE:
                if max(record.heard_at, record.changed_at) < quiet_since:
                    self._table.suspect(peer, now)

    def _verify_step(self, now: float, out: list[Send]) -> None:
        """Ping up to verify_batch members known only second-hand: their Ack verifies them."""
        cfg = self._config
        if not cfg.verify_batch or now < self._next_verify_at:
            return
        if not self._table.unverified_live_count():
            self._verify_pinged.clear()
            return
        self._next_verify_at = now + cfg.probe_interval_s
        unverified = [p for p in self._table.unverified_live_ids() if not self.is_client(p)]
        keep = set(unverified)
        for peer in [p for p in self._verify_pinged if p not in keep]:
            del self._verify_pinged[peer]
        quiet_since, never = now - 4 * cfg.probe_interval_s, float("-inf")
        due = [p for p in unverified if self._verify_pinged.get(p, never) <= quiet_since]
        self._rng.shuffle(due)
        due.sort(key=lambda p: self._verify_pinged.get(p, never))  # never pinged first
        for peer in due[: cfg.verify_batch]:
            self._verify_pinged[peer] = now
            out.append(self._send_to(peer, Ping(self._next_seq(), self._table.self_address)))

    def _send_ping_reqs(self, probe: _Probe, out: list[Send]) -> None:
        helpers = [p for p in self.dialable_peers() if p != probe.target]
        helpers = self._rng.sample(helpers, min(len(helpers), self._config.indirect_probes))
        probe.helpers = tuple(helpers)
        address = self.address_of(probe.target) or ""
        for helper in helpers:
            msg = PingReq(
                probe.seq, self._table.self_address, probe.target, address, self._piggyback(helper)
            )
            out.append(self._send_to(helper, msg))

    def _next_target(self) -> str | None:
        """Shuffled round robin over live members (SWIM): each is probed once per cycle."""
        for _ in range(2):
            while self._order_pos < len(self._order):
                candidate = self._order[self._order_pos]
                self._order_pos += 1
                record = self._table.get(candidate)
                if record is not None and record.state in (MemberState.ALIVE, MemberState.SUSPECT):
                    return candidate
            clients = self._table.live_client_ids()
            live = self._table.live_ids()
            self._order = [p for p in live if p not in clients] if clients else list(live)
            self._rng.shuffle(self._order)
            self._order_pos = 0
        return None

    def _reconnect(self, now: float, out: list[Send]) -> None:
        """Contact one dead member (or a bootstrap address when alone) to heal partitions."""
        dead = [p for p in self._table.ids_in(MemberState.DEAD, verified_only=True)
                if not self.is_client(p)]  # fmt: skip
        if dead:
            self._send_peer_list(self._rng.choice(dead), out)
        elif not self._table.verified_live_ids() and self._bootstrap:
            self._send_joins(now, out)

    def _next_exchange_interval(self) -> float:
        """The time to the swap after this one: the interval so far after a change of the member
        table since the last swap (tick has set it back to the base), else twice the last
        interval, at most the maximum."""
        if self._table.changes != self._changes_at_exchange:
            self._changes_at_exchange = self._table.changes
        else:
            self._exchange_interval_s = min(2 * self._exchange_interval_s, self._exchange_max_s)
        return self._exchange_interval_s

    def _send_joins(self, now: float, out: list[Send]) -> None:
        # the first retries come soon (peers started together: the bootstrap may listen a moment
        # after we first knocked), then back off to join_retry_s
        backoff = min(self._join_backoff_s, self._config.join_retry_s)
        self._join_retry_at = now + backoff
        self._join_backoff_s = 2 * backoff
        msg = Join(self._table.self_address, self._table.incarnation)
        out.extend(Send(address, None, msg) for address in self._bootstrap)

    def _send_peer_list(
        self, peer_id: str, out: list[Send], want_reply: bool = True, address: str | None = None
    ) -> None:
        """Send a member sample to `peer_id`, at its recorded address, else at `address`."""
        members = self._table.sample(self._config.peer_exchange_size, self._rng, about=peer_id)
        msg = PeerList(self._table.self_address, members, want_reply)
        out.append(self._reply(peer_id, address, msg) if address else self._send_to(peer_id, msg))

    def _piggyback(self, to_peer: str, with_self: bool = False) -> tuple[MemberUpdate, ...]:
        """Queued updates for `to_peer`; first our own record when `with_self` (it was wrong)."""
        limit = self._config.max_piggyback
        updates = self._table.piggyback(limit - with_self)
        if with_self:
            own = self._table.self_update()
            updates = (own, *(u for u in updates if u.peer_id != own.peer_id))
        record = self._table.get(to_peer)
        if record is not None and (
            record.state is MemberState.DEAD
            or (record.state is MemberState.SUSPECT and is_client_address(record.address))
        ):
            # It talks to us, so it lives: tell it it was declared dead, so that it refutes.
            updates = (self._table.update_of(to_peer), *updates[: limit - 1])
        return updates

    def _reply(self, peer_id: str, address: str, msg: MembershipMessage) -> Send:
        """A Send to `peer_id` at its recorded address, else at the one its message gave."""
        return Send(self.address_of(peer_id) or address, peer_id, msg)

    def _send_to(self, peer_id: str, msg: MembershipMessage) -> Send:
        address = self.address_of(peer_id)
        if address is None:
            raise LocalProtocolError(f"no address known for {peer_id!r}")
        return Send(address, peer_id, msg)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
