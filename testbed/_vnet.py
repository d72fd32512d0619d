# The virtual-time network: the scenario's links as a fluid model on trio's clock, and a
# transport with the node's `request` signature over it. Invariants: nothing here touches a
# socket or the machine's clock; every wait is a trio sleep, so under MockClock(autojump) a run
# takes the virtual time the links give it, whatever the box is doing; a message is charged what
# it costs on the real wire (the secure channel's frame, nng's framing, TCP/IP headers and the
# ACKs back); the bandwidth of each link (a peer's region link toward a region, its uplink, its
# downlink) is shared max-min fairly by the transfers crossing it at each moment; loss caps a
# transfer's rate at what TCP gets through it (Mathis et al.: MSS / RTT x 1.22 / sqrt(p)), which
# is how retransmissions cost time; a partitioned link (loss 1) delivers nothing, so the asker's
# deadline passes.
from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from geotrain.node.transport import (
    Header,
    HeaderCodec,
    PeerInfo,
    PeerUnreachable,
    RequestTimeout,
    TransportStatistics,
    frame_length,
)

from ._linkspec import LinkMatrix, LinkSpec

Handler = Callable[[PeerInfo, Header, memoryview], Awaitable[tuple[Header, bytes]]]

NNG_FRAMING = 12  # bytes nng's REQ/REP over TCP adds to a message: length (8) + request id (4)
TCP_IP_HEADERS = 52  # IPv4 (20) + TCP with timestamps (32), per segment and per ACK
MATHIS_C = 1.22  # TCP's loss-limited throughput constant (sqrt(3/2))
ADDRESS_BASE_PORT = 20_000  # peer i is tcp://127.0.0.1:(BASE + i): a name only, never dialled


def peer_address(index: int) -> str:
    """The address a virtual peer announces: a tcp:// name the membership accepts, never dialled
    (requests to it are delivered in memory)."""
    return f"tcp://127.0.0.1:{ADDRESS_BASE_PORT + index}"


def wire_bytes(app_bytes: int, mtu: int) -> tuple[int, int]:
    """(bytes the sender puts on the wire, bytes of ACKs the receiver sends back) for a message
    of `app_bytes` (a sealed frame plus nng's framing) over TCP with this MTU."""
    mss = mtu - TCP_IP_HEADERS
    segments = max(1, -(-app_bytes // mss))
    return app_bytes + segments * TCP_IP_HEADERS, -(-segments // 2) * TCP_IP_HEADERS


@dataclass
class _Flow:
    remaining: float  # bytes
    resources: tuple[tuple, ...]
    cap: float  # bytes/s this flow alone may take (its loss limit), inf for none
    done: trio.Event = field(default_factory=trio.Event)
    rate: float = 0.0


class FlowNetwork:
    """Transfers sharing the links' capacities max-min fairly, on trio's clock.

    Args:
        capacity: bytes/s of each resource key (a key missing: unlimited).
    """

    def __init__(self, capacity: Callable[[tuple], float | None]) -> None:
        self._capacity = capacity
        self._flows: list[_Flow] = []
        self._last = 0.0
        self._changed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Move the bytes of every flow until cancelled (one task per network)."""
        self._last = trio.current_time()
        task_status.started()
        while True:
            self._advance()
            self._allocate()
            finish = min((f.remaining / f.rate for f in self._flows if f.rate > 0),
                         default=math.inf)  # fmt: skip
            with trio.move_on_after(finish if finish < math.inf else 3600.0):
                await self._changed.wait()
            self._changed = trio.Event()

    async def transfer(self, nbytes: int, resources: tuple[tuple, ...], cap: float) -> None:
        """Return once `nbytes` have crossed `resources` (at most `cap` bytes/s)."""
        if nbytes <= 0:
            return
        if cap == math.inf and all(self._capacity(key) is None for key in resources):
            return  # (an unshaped path: its bytes take no time)
        self._advance()
        flow = _Flow(float(nbytes), resources, cap)
        self._flows.append(flow)
        self._changed.set()
        try:
            await flow.done.wait()
        finally:
            if flow in self._flows:  # (cancelled mid-way: its bytes stop flowing)
                self._advance()
                self._flows.remove(flow)
                self._changed.set()

    def _advance(self) -> None:
        now = trio.current_time()
        dt, self._last = now - self._last, now
        for flow in list(self._flows):
            flow.remaining -= flow.rate * dt
            # (a float's rounding leaves crumbs: a flow within a byte of its end is done)
            if flow.remaining <= 1.0:
                self._flows.remove(flow)
                flow.done.set()

    def _allocate(self) -> None:
        """Max-min fair rates by progressive filling: the most loaded resource fixes the share
        of its flows, which then leave the problem; a flow's own cap acts as a resource."""
        active = list(self._flows)
        left: dict[tuple, float] = {}
        for flow in active:
            for key in flow.resources:
                if key not in left:
                    cap = self._capacity(key)
                    left[key] = math.inf if cap is None else cap
        while active:
            share, limited = math.inf, None
            for key, cap in left.items():
                users = [f for f in active if key in f.resources]
                if users and cap / len(users) < share:
                    share, limited = cap / len(users), key
            own = min(active, key=lambda f: f.cap)
            if own.cap <= share:
                fixed = [own]
                share = own.cap
            elif limited is None:  # nothing limits them
                fixed, share = active, 1e18
            else:
                fixed = [f for f in active if limited in f.resources]
            for flow in fixed:
                flow.rate = share
                active.remove(flow)
                for key in flow.resources:
                    left[key] = max(0.0, left[key] - share)


@dataclass
class _Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    requests_sent: int = 0
    requests_served: int = 0
    wire_out: int = 0  # IP bytes put on the wire (frames, framing, TCP/IP headers, ACKs)
    peer_bytes: dict[str, list[int]] = field(default_factory=dict)

    def count(self, peer: str, inbound: int, outbound: int) -> None:
        self.bytes_in += inbound
        self.bytes_out += outbound
        entry = self.peer_bytes.setdefault(peer, [0, 0])
        entry[0] += inbound
        entry[1] += outbound


class VirtualNetwork:
    """The scenario's peers and links in memory and virtual time.

    Args:
        matrix: the scenario's links (rates already scaled).
        codec: the header types allowed (the node's).
        rng: draws jitter (seeded: the same run gives the same draws).
        nursery: where responders run (they finish what they started, as a real peer does).
        mtu: the path MTU whose TCP/IP headers are counted (1500: the internet's).
    """

    def __init__(self, matrix: LinkMatrix, codec: HeaderCodec, rng: random.Random,
                 nursery: trio.Nursery, mtu: int = 1500) -> None:  # fmt: skip
        self.matrix = matrix
        self.codec = codec
        self.mtu = mtu
        self._rng = rng
        self._nursery = nursery
        self._handlers: dict[int, tuple[str, Handler]] = {}
        self._by_address: dict[str, int] = {}
        self.counters: dict[int, _Counters] = {}
        self.flows = FlowNetwork(self._capacity)

    # -- peers ------------------------------------------------------------------------------
    def attach(self, index: int, peer_id: str, handler: Handler) -> VirtualTransport:
        """Peer `index` is up as `peer_id`; requests to it go to `handler`."""
        self._handlers[index] = (peer_id, handler)
        self._by_address[peer_address(index)] = index
        self.counters.setdefault(index, _Counters())
        return VirtualTransport(self, index, peer_id)

    def detach(self, index: int, handler: Handler) -> None:
        """Peer `index` is gone (killed, or its process ended): requests to it fail as to a
        machine that is off. Nothing happens when another `handler` answers there by now (a
        restart)."""
        entry = self._handlers.get(index)
        if entry is not None and entry[1] == handler:
            del self._handlers[index]

    def set_matrix(self, matrix: LinkMatrix) -> None:
        """The links change (a fault: partition, degrade, heal) from now on."""
        self.matrix = matrix

    def total_bytes(self) -> int:
        """Bytes every peer has put on the wire (IP bytes, as the testbed's emulator counts)."""
        return sum(c.wire_out for c in self.counters.values())

    # -- links ------------------------------------------------------------------------------
    def _capacity(self, key: tuple) -> float | None:
        kind, a, b = key
        if kind == "link":  # (a: the sending peer, b: the receiving peer's region)
            rate = self.matrix.spec(self.matrix.peer_regions[a], b).rate_mbit
        else:
            access = self.matrix.access_of(a)
            rate = None if access is None else (access.up_mbit if kind == "up"
                                                else access.down_mbit)  # fmt: skip
        return None if rate is None else rate * 1e6 / 8

    def _path(self, src: int, dst: int) -> tuple[LinkSpec, float, tuple[tuple, ...]]:
        """(region link spec, one-way delay s, resources) of src -> dst."""
        spec = self.matrix.peer_spec(src, dst)
        up, down = self.matrix.access_of(src), self.matrix.access_of(dst)
        delay = (spec.delay_ms + (up.delay_ms if up else 0.0)
                 + (down.delay_ms if down else 0.0)) / 1000  # fmt: skip
        # the region link shapes what a peer sends toward a region, as the userspace emulator
        # queues it (per sending peer and destination region), shared by its flows there
        resources: tuple[tuple, ...] = (("link", src, self.matrix.peer_regions[dst]),)
        if up is not None:
            resources += (("up", src, None),)
        if down is not None:
            resources += (("down", dst, None),)
        return spec, delay, resources

    async def carry(self, src: int, dst: int, app_bytes: int) -> bool:
        """Move a message of `app_bytes` from src to dst: its bytes through the shared links,
        then the propagation delay (with jitter). False: the link is partitioned (it never
        arrives)."""
        spec, delay, resources = self._path(src, dst)
        if spec.loss >= 1.0:
            return False
        sent, acks = wire_bytes(app_bytes, self.mtu)
        self.counters[src].wire_out += sent
        self.counters[dst].wire_out += acks
        back_delay = self._path(dst, src)[1]
        rtt = delay + back_delay
        cap = math.inf
        if spec.loss > 0 and rtt > 0:
            cap = (self.mtu - TCP_IP_HEADERS) / rtt * MATHIS_C / math.sqrt(spec.loss)
        await self.flows.transfer(sent, resources, cap)
        if spec.jitter_ms > 0:
            delay = max(0.0, delay + self._rng.uniform(-spec.jitter_ms, spec.jitter_ms) / 1000)
        await trio.sleep(delay)
        return True

    def handler_at(self, address: str) -> tuple[int, str, Handler] | None:
        index = self._by_address.get(address)
        if index is None or index not in self._handlers:
            return None
        peer_id, handler = self._handlers[index]
        return index, peer_id, handler


class VirtualTransport:
    """One peer's end of a VirtualNetwork, with the transport's `request` and `statistics`."""

    def __init__(self, network: VirtualNetwork, index: int, peer_id: str) -> None:
        self.network = network
        self.index = index
        self.peer_id = peer_id
        self.address = peer_address(index)

    async def request(
        self,
        address: str,
        header: Header,
        payload: bytes | bytearray | memoryview = b"",
        *,
        deadline_s: float,
        expect_peer: str | None = None,
    ) -> tuple[Header, bytearray, PeerInfo]:
        """Send one request and wait for its reply, as Transport.request does.

        Raises:
            PeerUnreachable: nobody at `address`. RequestTimeout: no reply within `deadline_s`.
        """
        net = self.network
        target = net.handler_at(address)
        if target is None:
            raise PeerUnreachable(f"nobody at {address}")
        dst, peer_id, handler = target
        if expect_peer is not None and peer_id != expect_peer:
            raise PeerUnreachable(f"peer ID mismatch: expected {expect_peer}, got {peer_id}")
        wire = net.codec.encode(header)
        data = bytes(payload)
        done = trio.Event()
        reply: list[tuple[Header, bytearray]] = []
        me = PeerInfo(self.peer_id, b"", self.address, "inbound")
        src = self.index
        size = frame_length(len(wire), len(data)) + NNG_FRAMING
        net.counters[src].requests_sent += 1
        net.counters[src].count(peer_id, 0, size)
        net.counters[dst].count(self.peer_id, size, 0)

        mine = net.handler_at(self.address)

        def gone(at: str, was) -> bool:  # (killed, or restarted: the connection died with it)
            now = net.handler_at(at)
            return now is None or was is None or now[2] is not was[2]

        async def serve() -> None:
            if not await net.carry(src, dst, size) or gone(address, target):
                return
            net.counters[dst].requests_served += 1
            answer, answer_payload = await handler(me, net.codec.decode(wire), memoryview(data))
            reply_wire, reply_data = net.codec.encode(answer), bytearray(answer_payload)
            back = frame_length(len(reply_wire), len(reply_data)) + NNG_FRAMING
            net.counters[dst].count(self.peer_id, 0, back)
            net.counters[src].count(peer_id, back, 0)
            if not await net.carry(dst, src, back) or gone(self.address, mine):
                return
            reply.append((net.codec.decode(reply_wire), reply_data))
            done.set()

        net._nursery.start_soon(serve)
        with trio.move_on_after(deadline_s):
            await done.wait()
        if not reply:
            raise RequestTimeout(f"no reply from {address} within {deadline_s} s")
        answer, answer_payload = reply[0]
        return answer, answer_payload, PeerInfo(peer_id, b"", address, "outbound")

    def statistics(self) -> TransportStatistics:
        """Counters since the peer attached (application bytes: frames with nng's framing)."""
        c = self.network.counters[self.index]
        return TransportStatistics(
            bytes_in=c.bytes_in, bytes_out=c.bytes_out, requests_sent=c.requests_sent,
            requests_served=c.requests_served, handshakes_ok=len(c.peer_bytes),
            handshakes_failed={}, frames_rejected={},
            peer_bytes={p: (i, o) for p, (i, o) in c.peer_bytes.items()},
            inbound_handshakes_ok=len(c.peer_bytes),
        )  # fmt: skip
