# The node's side of membership and link probing: it runs gossip's sans-I/O Membership (join,
# ticks, messages in and out) and measures the links the partner policy asks about. Invariants:
# every message it sends has a deadline (one probe period); a bad membership message from a peer
# is answered with an error, counted and changes nothing; RTT samples from probes feed the link
# table; its loops live in the node's nursery and stop when it is cancelled. Nothing is ever
# dialled at a client address (a client-mode peer, behind NAT): messages for a client wait in its
# mailbox (at most MAX_CARRIED, the newest kept) and travel back in the Delivered that answers
# its next message, the answer to that message first; a client takes what comes back this way
# as sent by the peer it dialled (the proven one).
from __future__ import annotations

import dataclasses
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Sequence

import structlog
import trio

from geotrain.gossip import (
    LinkTable,
    Member,
    Membership,
    MembershipConfig,
    MemberState,
    PartnerSelector,
    RemoteProtocolError,
    Send,
    is_client_address,
)

from ._config import ConfigError
from ._log_quota import log_within_quota
from ._protocol import (
    MAX_CARRIED,
    MAX_GOSSIP_BODY,
    MAX_PROBE_BYTES,
    Delivered,
    Gossip,
    Probe,
    ProbeReply,
    unwrap_gossip,
    wrap_gossip,
)
from .transport import (
    ErrorReply,
    HandshakeError,
    Header,
    PeerInfo,
    Ping,
    Pong,
    Transport,
    TransportError,
    dialable,
)

# A reachable node that has dialled out to peers but has been dialled by nobody after this long
# (and after several probe periods) says it probably cannot be dialled: behind NAT or a firewall
# that drops inbound connections, it never becomes anyone's member and waits or trains alone.
NOT_DIALLED_AFTER_S = 15.0
LEAVE_FLOOR_S = 1.0  # a leave gets at least this long to be delivered
NOT_DIALLED_PROBE_PERIODS = 5
# A bootstrap peer that does not answer is warned about once it has not for this long (at once
# when it answered and refused us): swarms start in any order, and a peer not up yet is not
# to be warned about as if its address were wrong
BOOTSTRAP_PATIENCE_S = 10.0
PROBE_BYTES = 256 * 1024  # above the link table's smallest goodput sample, small on any link
log = structlog.get_logger()


class IdentityInUse(ConfigError):
    """Another node runs with this node's identity (key file): found at start, while waiting
    for peers."""


class MembershipService:
    """Who is in the swarm, alive, and how the links to them are.

    Args:
        peer_id: this node's ID; address: the address peers dial.
        bootstrap: addresses to join through (empty for the first node).
        probe_interval_s: the failure-detection period.
        transport: sends our messages; links: the node's link table; selector: the partner
            policy (asked which links need a probe); rng: the node's seeded Random.
    """

    def __init__(
        self,
        peer_id: str,
        address: str,
        bootstrap: Sequence[str],
        probe_interval_s: float,
        transport: Transport,
        links: LinkTable,
        selector: PartnerSelector,
        rng: random.Random,
        incarnation: int | None = None,
    ) -> None:
        self.config = MembershipConfig(
            probe_interval_s=probe_interval_s, probe_timeout_s=0.4 * probe_interval_s
        )
        # a restart announces a higher incarnation than its last life's: the wall clock's
        # seconds (a virtual run passes its own, so that its runs repeat bit for bit)
        self.membership = Membership(
            peer_id, address, self.config, rng,
            incarnation=int(time.time()) if incarnation is None else incarnation,
        )
        # this process's own mark, in our refusal of a message signed with our identity: a
        # refusal that carries it came from this very node (a bootstrap address that reaches us
        # under another name), one without it from a twin running with our key
        self._instance = secrets.token_hex(8)
        self._said_self: set[str] = set()  # addresses found to reach this node itself
        self._bootstrap = tuple(bootstrap)
        self._said_unanswered: set[str] = set()  # bootstrap addresses warned about (once each)
        self._answered: set[str] = set()  # bootstrap addresses that answered once
        self._said_waiting: set[str] = set()  # ... said (info) not to answer yet
        self._said_duplicates: set[str] = set()  # addresses of nodes running with our identity
        self._dialled_twins: set[str] = set()  # of those, the ones we dialled ourselves
        self._started_at: float | None = None
        self._address = address
        self._transport = transport
        self._links = links
        self._selector = selector
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.rejected: Counter[str] = Counter()  # membership messages refused, by kind
        self._mailbox: dict[str, deque[Gossip]] = {}  # client peer -> messages waiting for it
        self._not_dialled_warned = False

    # -- the view the rest of the node reads ----------------------------------------------------
    @property
    def bootstrap(self) -> tuple[str, ...]:
        """The addresses this node joins through."""
        return self._bootstrap

    def live_peers(self) -> tuple[str, ...]:
        return self.membership.live_peers()

    def address_of(self, peer_id: str) -> str | None:
        return self.membership.address_of(peer_id)

    def dialable_peers(self) -> tuple[str, ...]:
        """live_peers() less the client-mode peers: those a request can be sent to."""
        return self.membership.dialable_peers()

    def not_dialled_back(self) -> bool:
        """Whether this node warned `not_dialled` and still nobody has dialled it (status)."""
        return self._not_dialled_warned and not self._transport.statistics().inbound_handshakes_ok

    def unanswered_bootstrap(self) -> list[str]:
        """The bootstrap addresses warned about as unanswered, while this node knows no live
        peer (status: a typo'd port looked like an empty swarm)."""
        return [] if self.live_count() else sorted(self._said_unanswered - self._answered)

    def live_count(self) -> int:
        """Peers believed alive, client-mode peers known second-hand included."""
        return self.membership.live_count()

    def members(self) -> list[Member]:
        return self.membership.members()

    # -- loops ----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Join, then keep membership and link probes going until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._started_at = trio.current_time()
            sends = self.membership.join(self._bootstrap, self._started_at)
            nursery.start_soon(self._probe_loop)
            if self._bootstrap and not is_client_address(self._address):
                nursery.start_soon(self._watch_dialled)
            task_status.started()
            while True:
                for send in sends:
                    nursery.start_soon(self._deliver, send)
                self._drain()
                deadline = self.membership.next_deadline()
                now = trio.current_time()
                with trio.move_on_at(deadline if deadline != float("inf") else now + 3600):
                    await self._wake.wait()
                self._wake = trio.Event()
                sends = self.membership.tick(trio.current_time())

    def _drain(self) -> None:
        for sample in self.membership.drain_rtt_samples():
            self._links.record_rtt(sample.peer_id, sample.rtt_s, sample.at)
        for event in self.membership.drain_events():
            if event.kind == "duplicate":
                self._said_duplicate(event.address)
                continue
            if event.kind == "twin":
                log.warning("peer_twin", peer=event.peer_id[:12], incarnation=event.incarnation,
                            detail="this peer said it left, but another process with its "
                            "identity (its key file) still talks to us: taken as alive again; "
                            "two processes with one key share one place in the swarm")  # fmt: skip
                continue
            if event.kind in ("dead", "left"):
                self._mailbox.pop(event.peer_id, None)
            log.info(f"peer_{event.kind}", peer=event.peer_id[:12], incarnation=event.incarnation)

    def _said_duplicate(self, address: str) -> None:
        """Another node runs with this node's identity: said once per address (peers then send
        this node's traffic there; membership went wrong for the honest nodes unsaid)."""
        if address in self._said_duplicates:
            return
        self._said_duplicates.add(address)
        log.warning("identity_in_use_elsewhere", address=address,
                    hint="another node runs with this node's identity (its key file) there: "
                    "peers now send this node's traffic to it; stop it, or give it a key of its "
                    "own (geotrain keygen)")  # fmt: skip

    def _said_dialled_self(self, address: str) -> None:
        """An address we dialled reached this node itself: said once (not a twin)."""
        if address in self._said_self:
            return
        self._said_self.add(address)
        log.info("bootstrap_is_self", address=address,
                 detail="this address reaches this node itself (network.bootstrap names it "
                 "another way than network.advertise)")  # fmt: skip

    async def _watch_dialled(self) -> None:
        """Say so, once, when peers answer our connections but none has dialled ours."""
        await trio.sleep(max(NOT_DIALLED_AFTER_S, NOT_DIALLED_PROBE_PERIODS
                             * self.config.probe_interval_s))  # fmt: skip
        stats = self._transport.statistics()
        outbound = stats.handshakes_ok - stats.inbound_handshakes_ok
        if self._said_duplicates:  # (its twin answers; peers dial the twin: not NAT)
            return
        if outbound and not stats.inbound_handshakes_ok:
            self._not_dialled_warned = True
            log.warning(
                "not_dialled", address=self._address, outbound_connections=outbound,
                hint="peers accepted this node's connections but none could dial it back at its "
                "advertised address: if this machine is behind NAT or a firewall that drops "
                "inbound connections, set network.reachable = false (client mode); otherwise "
                "check network.advertise and that the port is open",
            )  # fmt: skip

    async def _deliver(self, send: Send) -> None:
        if is_client_address(send.address):  # nobody dials a client: it collects its mail
            if send.peer_id is not None:
                box = self._mailbox.setdefault(send.peer_id, deque(maxlen=MAX_CARRIED))
                box.append(wrap_gossip(send.message))
            return
        try:
            reply, _, peer = await self._transport.request(
                send.address,
                wrap_gossip(send.message),
                deadline_s=self.config.probe_interval_s,
                expect_peer=send.peer_id,
            )
        except TransportError as exc:
            log.debug("gossip_undelivered", address=send.address, reason=str(exc))
            if send.address in self._bootstrap and send.address not in self._said_unanswered:
                self._bootstrap_failed(send.address, exc)
            return
        if send.address in self._bootstrap:
            self._said_unanswered.add(send.address)  # it answered: a later silence is a peer's
            self._answered.add(send.address)
        # (a node of our own identity refused the message: one's own word is no news)
        if peer.peer_id == self.membership.self_id:
            if isinstance(reply, ErrorReply) and f"[instance {self._instance}]" in reply.reason:
                self._said_dialled_self(send.address)
            else:
                self._dialled_twins.add(send.address)
                self._said_duplicate(send.address)
            return
        if isinstance(reply, Delivered) and reply.messages:
            self._receive_carried(peer, reply.messages)

    def _bootstrap_failed(self, address: str, exc: TransportError) -> None:
        """Say that a bootstrap address does not answer: a warning once it has not for
        BOOTSTRAP_PATIENCE_S, or at once if it refused us (another swarm, not admitted); before
        that, an info line (the peer may not be up yet)."""
        waited = trio.current_time() - (self._started_at or trio.current_time())
        refused = isinstance(exc, HandshakeError) and exc.definite
        if refused or waited >= BOOTSTRAP_PATIENCE_S:
            self._said_unanswered.add(address)  # a typo'd, dead or foreign bootstrap: say it
            log.warning("bootstrap_unanswered", address=address, reason=str(exc),
                        waited_s=round(waited, 1),
                        hint="check network.bootstrap: is a node listening there, and is it of "
                        "this swarm? (tried again as membership goes on)")  # fmt: skip
        elif address not in self._said_waiting:
            self._said_waiting.add(address)
            log.info("bootstrap_waiting", address=address, reason=str(exc),
                     hint=f"not answering yet; warned about if it still does not in "
                     f"{BOOTSTRAP_PATIENCE_S:g} s")  # fmt: skip

    def _receive_carried(self, peer: PeerInfo, messages: Sequence[Gossip]) -> None:
        """Membership messages that came back with a Delivered (we are a client): from `peer`."""
        for header in messages:
            try:
                sends = self._receive(peer, header)
            except RemoteProtocolError as exc:
                self._refuse(peer, "gossip", str(exc))
                continue
            if self._nursery is not None:
                for send in sends:
                    self._nursery.start_soon(self._deliver, send)
        self._wake.set()

    async def _probe_loop(self) -> None:
        """Measure the links the partner policy looked at but knows too little about."""
        while True:
            await trio.sleep(self.config.probe_interval_s)
            for peer in self._selector.probe_targets(self._links, trio.current_time(), limit=1):
                address = self.address_of(peer)
                if address is not None and not is_client_address(address):
                    await self._probe(peer, address)

    async def _probe(self, peer: str, address: str) -> None:
        started = trio.current_time()
        deadline = self._links.exchange_deadline(peer, PROBE_BYTES, started)
        try:
            reply, _, _ = await self._transport.request(
                address, Probe(), bytes(PROBE_BYTES), deadline_s=deadline, expect_peer=peer
            )
        except TransportError as exc:
            log.debug("probe_failed", peer=peer[:12], reason=str(exc))
            return
        now = trio.current_time()
        # a probe that took no measurable time (a free link on the virtual clock) says nothing
        if isinstance(reply, ProbeReply) and reply.received == PROBE_BYTES and now > started:
            self._links.record_transfer(peer, PROBE_BYTES, now - started, now)

    def arrived_count(self) -> int:
        """Peers that showed up: the live ones, and those that came and said they left (a peer
        of a short run may finish before the last one joins; waiting for it again is waiting
        for nothing)."""
        left = sum(m.state == MemberState.LEFT for m in self.membership.members())
        return self.live_count() + left

    async def wait_for_peers(self, want: int, limit_s: float, stop: trio.Event) -> None:
        """Wait until `want` other peers showed up (arrived_count(); at most `limit_s`, or until
        `stop`).

        Raises:
            IdentityInUse: a node this one dialled runs with its identity, and no other peer
                is live (it would wait out `limit_s` for peers that answer its twin instead).
        """
        if not want:
            return
        log.info("waiting_for_peers", wanted=want, bootstrap=list(self._bootstrap),
                 limit_s=limit_s)  # fmt: skip
        with trio.move_on_after(limit_s):
            while self.arrived_count() < want and not stop.is_set():
                # (only a twin we dialled: membership hearsay of one is said, never fatal)
                if self._dialled_twins and not self.live_count():
                    twin = sorted(self._dialled_twins)[0]
                    raise IdentityInUse(
                        f"identity: the node at {twin} runs with this node's identity (the same "
                        "key file): give one of them a key of its own (geotrain keygen, or "
                        "geotrain node init for a new node folder)")  # fmt: skip
                await trio.sleep(0.05)
            if not stop.is_set():
                log.info("peers_ready", live_peers=self.live_count(), arrived=self.arrived_count())
            return
        log.warning("peers_not_ready", live_peers=self.live_count(), arrived=self.arrived_count(),
                    wanted=want)

    async def leave(self, grace_s: float) -> None:
        """Tell the swarm we leave (best effort, at most `grace_s`)."""
        sends = self.membership.leave(trio.current_time())
        # (at least a second: a busy machine's round trip can take longer than two fast probes)
        with trio.move_on_after(min(grace_s, max(LEAVE_FLOOR_S, 2 * self.config.probe_interval_s))):
            async with trio.open_nursery() as n:
                for send in sends:
                    n.start_soon(self._deliver, send)

    # -- requests from peers --------------------------------------------------------------------
    handles = (Gossip, Ping, Probe)

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        """Answer Gossip, Ping and Probe."""
        if isinstance(header, Ping):
            return Pong(nonce=header.nonce), b""
        if isinstance(header, Probe):
            if len(payload) > MAX_PROBE_BYTES:
                return self._refuse(peer, "probe", f"{len(payload)} bytes > {MAX_PROBE_BYTES}")
            return ProbeReply(received=len(payload)), b""
        assert isinstance(header, Gossip)
        try:
            sends = self._receive(peer, header)
        except RemoteProtocolError as exc:
            ours = peer.peer_id == self.membership.self_id
            mine = f" [instance {self._instance}]" if ours else ""
            return self._refuse(peer, "gossip", str(exc) + mine)
        carried: list[Gossip] = []
        for send in sends:
            if send.peer_id == peer.peer_id and is_client_address(send.address):
                carried.append(wrap_gossip(send.message))  # the answer goes back on this request
            elif self._nursery is not None:
                self._nursery.start_soon(self._deliver, send)
        self._wake.set()
        return Delivered(messages=self._carry(peer.peer_id, carried)), b""

    def _carry(self, peer_id: str, answers: list[Gossip]) -> tuple[Gossip, ...]:
        """What travels back to a client: `answers`, then its mail, within one header's room
        (what does not fit stays in the mailbox for its next message)."""
        box = self._mailbox.pop(peer_id, None)
        if not answers and not box:
            return ()
        queue = deque(answers)
        queue.extend(box or ())
        out: list[Gossip] = []
        room = MAX_GOSSIP_BODY
        while queue and len(out) < MAX_CARRIED and (not out or len(queue[0].body) <= room):
            out.append(queue.popleft())
            room -= len(out[-1].body)
        if queue:
            self._mailbox[peer_id] = deque(queue, maxlen=MAX_CARRIED)
        return tuple(out)

    def _receive(self, peer: PeerInfo, header: Gossip) -> list[Send]:
        """`peer`'s membership message into the table, without (counted) members at an address
        no node has; what to send in return.

        Raises:
            RemoteProtocolError: a message out of bounds, or from such an address.
        """
        message, dropped = _without_bad_addresses(unwrap_gossip(header))
        if dropped:
            self._refuse(peer, "gossip", f"{dropped} member(s) at an address no node has")
        return self.membership.receive(message, peer.peer_id, trio.current_time())

    def _refuse(self, peer: PeerInfo, kind: str, reason: str) -> tuple[Header, bytes]:
        self.rejected[kind] += 1
        log_within_quota("message_rejected", peer=peer.short_id, kind=kind, reason=reason)
        return ErrorReply(code="bad_request", reason=reason[:500]), b""


def _without_bad_addresses(message: object) -> tuple[object, int]:
    """`message` without the members it names at an address no node has, and how many it named:
    a node listens on tcp://HOST:PORT (or is a client, dialled by nobody), and a peer's ipc://
    member was dialled and spread to the swarm (nng dials any URL it knows). One such entry among
    a Ping's news costs the entry, not the Ping (an older node may still hold one).

    Raises:
        RemoteProtocolError: the sender's own address, or a probe's target, is such an address.
    """
    for name in ("sender_address", "target_address"):
        address = getattr(message, name, None)
        if isinstance(address, str) and not _node_address(address):
            raise RemoteProtocolError(f"{name} {address[:100]!r}: a node's address is "
                                      "tcp://HOST:PORT")  # fmt: skip
    dropped = 0
    for name in ("updates", "members"):
        entries = getattr(message, name, None)
        if not entries:
            continue
        kept = tuple(u for u in entries if _node_address(u.address))
        if len(kept) != len(entries):
            dropped += len(entries) - len(kept)
            message = dataclasses.replace(message, **{name: kept})
    return message, dropped


def _node_address(address: str) -> bool:
    return dialable(address) or is_client_address(address)
