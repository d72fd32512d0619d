# SWIM-style membership driver (probing, indirect probes, join, peer exchange, leave), sans-I/O.
# Invariants: time only arrives as `now`; randomness only from the injected rng; a message from a
# peer is validated before any state changes; at most one probe is outstanding; every Send names
# the destination address (and the peer id when known); no reply is ever awaited: a missing answer
# is noticed by this machine's own timers, driven by tick() at next_deadline().
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import LocalProtocolError, RemoteProtocolError
from ._membership_config import MembershipConfig
from ._membership_table import Member, MembershipEvent, MembershipTable, MemberState
from ._messages import (
    MAX_ADDRESS_LEN,
    MAX_ID_LEN,
    Ack,
    Join,
    Leave,
    MembershipMessage,
    MemberUpdate,
    PeerList,
    Ping,
    PingReq,
    validate_message,
)

MAX_FORWARDS = 1024
"""Most indirect probes this node runs for others at once; further PingReqs are ignored."""


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
        if not 0 < len(self_id) <= MAX_ID_LEN or not 0 < len(self_address) <= MAX_ADDRESS_LEN:
            raise LocalProtocolError(f"bad self_id {self_id!r} or self_address {self_address!r}")
        self._config = config
        self._rng = rng
        self._table = MembershipTable(self_id, self_address, incarnation, config)
        self._seq = 0
        self._probe: _Probe | None = None
        self._order: list[str] = []
        self._order_pos = 0
        self._forwards: dict[int, tuple[str, str, int, float]] = {}
        self._rtts: list[RttSample] = []
        self._bootstrap: tuple[str, ...] = ()
        self._joined = True
        inf = float("-inf")
        self._next_probe_at = self._next_exchange_at = self._next_reconnect_at = inf
        self._join_retry_at = inf

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
        """Ids of alive and suspect members, sorted; one tuple object until membership changes."""
        return self._table.live_ids()

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
        return min(deadlines)

    # -- commands ------------------------------------------------------------------------------
    def join(self, bootstrap_addresses: Sequence[str], now: float) -> list[Send]:
        """Start joining through `bootstrap_addresses` (empty: this node starts a new swarm)."""
        if self._table.left:
            raise LocalProtocolError("join() after leave()")
        self._bootstrap = tuple(a for a in bootstrap_addresses if a != self._table.self_address)
        self._joined = not self._bootstrap
        out: list[Send] = []
        if not self._joined:
            self._send_joins(now, out)
        return out

    def leave(self, now: float) -> list[Send]:
        """Leave for good: tell up to leave_fanout members, who spread the news."""
        if self._table.left:
            return []
        self._table.leave(now)
        live = list(self._table.live_ids())
        told = self._rng.sample(live, min(len(live), self._config.leave_fanout))
        msg = Leave(self._table.self_address, self._table.incarnation)
        return [self._send_to(peer, msg) for peer in told]

    def tick(self, now: float) -> list[Send]:
        """Run every timer that is due: probes, indirect probes, suspicion, exchange, rejoin."""
        if self._table.left:
            return []
        out: list[Send] = []
        self._table.expire(now)
        self._probe_step(now, out)
        if not self._joined and now >= self._join_retry_at:
            self._send_joins(now, out)
        if now >= self._next_exchange_at:
            self._next_exchange_at = now + self._config.peer_exchange_interval_s
            live = self._table.live_ids()
            if live:
                self._send_peer_list(self._rng.choice(live), out)
        if now >= self._next_reconnect_at:
            self._next_reconnect_at = now + self._config.reconnect_interval_s
            self._reconnect(now, out)
        for seq in [s for s, f in self._forwards.items() if f[3] <= now]:
            del self._forwards[seq]
        return out

    def receive(self, msg: MembershipMessage, sender_id: str, now: float) -> list[Send]:
        """Handle a message that `sender_id` sent (its id as proven by the secure channel).

        Raises:
            RemoteProtocolError: the message is malformed or out of bounds; nothing changed.
        """
        validate_message(msg)
        if not isinstance(sender_id, str) or not 0 < len(sender_id) <= MAX_ID_LEN:
            raise RemoteProtocolError(f"bad sender id {sender_id!r}")
        if sender_id == self._table.self_id:
            raise RemoteProtocolError("a message claims to come from this node itself")
        if self._table.left:
            return []
        out: list[Send] = []
        if isinstance(msg, Join):
            update = MemberUpdate(sender_id, msg.sender_address, "alive", msg.incarnation)
            self._table.apply(update, now)
            self._send_peer_list(sender_id, out, want_reply=False)
        elif isinstance(msg, Leave):
            if self._table.get(sender_id) is not None:
                left = MemberUpdate(sender_id, msg.sender_address, "left", msg.incarnation)
                self._table.apply(left, now)
        else:
            self._table.heard_from(sender_id, msg.sender_address, now)
            self._receive_gossip(msg, sender_id, now, out)
        return out

    # -- internals -----------------------------------------------------------------------------
    def _receive_gossip(self, msg, sender_id: str, now: float, out: list[Send]) -> None:
        updates = msg.members if isinstance(msg, PeerList) else msg.updates
        for update in updates:
            self._table.apply(update, now)
        if isinstance(msg, Ping):
            out.append(
                self._send_to(
                    sender_id,
                    Ack(msg.seq, self._table.self_address, updates=self._piggyback(sender_id)),
                )
            )
        elif isinstance(msg, PingReq):
            if len(self._forwards) < MAX_FORWARDS:
                seq = self._next_seq()
                expires = now + self._config.probe_interval_s
                self._forwards[seq] = (sender_id, msg.sender_address, msg.seq, expires)
                ping = Ping(seq, self._table.self_address, self._piggyback(msg.target_id))
                out.append(Send(msg.target_address, msg.target_id, ping))
        elif isinstance(msg, Ack):
            self._receive_ack(msg, sender_id, now, out)
        else:  # PeerList
            self._joined = True
            if msg.want_reply:
                self._send_peer_list(sender_id, out, want_reply=False)

    def _receive_ack(self, msg: Ack, sender_id: str, now: float, out: list[Send]) -> None:
        forward = self._forwards.pop(msg.seq, None)
        if forward is not None:
            requester, address, seq, _ = forward
            ack = Ack(seq, self._table.self_address, True, self._piggyback(requester))
            out.append(Send(address, requester, ack))
            return
        probe = self._probe
        if probe is not None and msg.seq == probe.seq:
            if not msg.indirect and sender_id == probe.target:
                self._rtts.append(RttSample(sender_id, now - probe.sent_at, now))
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

    def _send_ping_reqs(self, probe: _Probe, out: list[Send]) -> None:
        helpers = [p for p in self._table.live_ids() if p != probe.target]
        helpers = self._rng.sample(helpers, min(len(helpers), self._config.indirect_probes))
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
            self._order = list(self._table.live_ids())
            self._rng.shuffle(self._order)
            self._order_pos = 0
        return None

    def _reconnect(self, now: float, out: list[Send]) -> None:
        """Contact one dead member (or a bootstrap address when alone) to heal partitions."""
        dead = self._table.ids_in(MemberState.DEAD)
        if dead:
            self._send_peer_list(self._rng.choice(dead), out)
        elif not self._table.live_ids() and self._bootstrap:
            self._send_joins(now, out)

    def _send_joins(self, now: float, out: list[Send]) -> None:
        self._join_retry_at = now + self._config.join_retry_s
        msg = Join(self._table.self_address, self._table.incarnation)
        out.extend(Send(address, None, msg) for address in self._bootstrap)

    def _send_peer_list(self, peer_id: str, out: list[Send], want_reply: bool = True) -> None:
        members = self._table.sample(self._config.peer_exchange_size, self._rng, about=peer_id)
        out.append(self._send_to(peer_id, PeerList(self._table.self_address, members, want_reply)))

    def _piggyback(self, to_peer: str) -> tuple[MemberUpdate, ...]:
        updates = self._table.piggyback(self._config.max_piggyback)
        record = self._table.get(to_peer)
        if record is not None and record.state is MemberState.DEAD:
            # It talks to us, so it lives: tell it it was declared dead, so that it refutes.
            updates = (self._table.update_of(to_peer), *updates[: self._config.max_piggyback - 1])
        return updates

    def _send_to(self, peer_id: str, msg: MembershipMessage) -> Send:
        address = self.address_of(peer_id)
        if address is None:
            raise LocalProtocolError(f"no address known for {peer_id!r}")
        return Send(address, peer_id, msg)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
