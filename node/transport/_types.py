# The transport's public types: errors, settings, the proven peer, counters. Invariants: nothing
# here touches pynng or the network; `_transport` (the only pynng module) builds on these, and
# callers may import them without pulling in any socket code.
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from geotrain.gossip import tcp_host_port

from ..identity import short_id
from ._messages import Header
from ._noise import frame_length


class TransportError(Exception):
    """Base of every error the transport raises."""


class PeerUnreachable(TransportError):
    """No connection to the peer could be made, or it was lost mid-request."""


class RequestTimeout(TransportError):
    """The request's deadline passed before the reply arrived."""


class HandshakeError(TransportError):
    """The secure handshake failed: wrong peer, refused admission, wrong swarm, or deadline.

    `definite` is True where the peer answered and the two cannot work together as configured
    (another swarm, not admitted, another peer than expected): trying again will not help.
    """

    def __init__(self, message: str, *, definite: bool = False) -> None:
        super().__init__(message)
        self.definite = definite


class RemoteTransportError(TransportError):
    """The peer sent something invalid (bad frame, bad header); the connection was dropped."""


class LocalTransportError(TransportError):
    """We were asked to do something invalid (a bug of the caller), e.g. an oversized message."""


class ListenError(TransportError):
    """The listen address cannot be taken (in use, not ours, malformed)."""


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one transport.

    Attributes:
        listen: nng URL to listen on; port 0 picks a free port (see Transport.address).
        max_message_bytes: the largest payload sent or accepted; frames above it are refused by
            nng before allocation. 320 MiB: a 256 MiB model update plus headroom.
        max_header_bytes: the largest encoded header.
        handshake_timeout_s: a handshake not finished by then is abandoned (both sides).
        io_timeout_s: nng-level backstop for any single send/receive; callers' deadlines are
            normally much shorter.
        max_inbound_requests: requests served at once (one nng context each).
        max_pending_handshakes: inbound connections allowed to be mid-handshake at once; a new
            one beyond closes the oldest, so strangers can neither pile up handshake state nor
            lock newcomers out.
        replay_window: how far out of order a frame may arrive and still be accepted.
        offload_bytes: payloads at least this big are sealed/opened in a worker thread, so the
            event loop is never blocked for long (cryptography releases the GIL).
        part_bytes: requests with a bigger payload are sent as parts of about this size, several
            in flight at once, so that encrypting, sending and decrypting overlap instead of
            running one after the other.
        parts_in_flight: parts of one request on the wire at once.
        connections_per_peer: the most connections (each its own TCP connection and session)
            this node dials to one peer. A further one is dialled only when every open one
            carries requests_per_connection requests: a model stream with many chunks in flight
            spreads over several, a ping uses one. 4, because one TCP connection may not fill a
            long fat link (its window and slow start, a loss halving it), and iperf3 -P 4 is
            the measure of what several get (python -m geotrain.testbed.bench_goodput).
        requests_per_connection: requests in flight on one connection before another is
            dialled; 2, the multi-part requests one connection carries at once.
        max_reassembly_bytes: the most bytes the requests being reassembled from parts may hold
            at once, over every connection (each is allocated whole at its first part); a part
            that would start one beyond it is refused and its connection dropped, and one peer's
            new message beyond half of it drops that peer's oldest. 0: twice max_message_bytes.
    """

    listen: str = "tcp://127.0.0.1:0"
    max_message_bytes: int = 320 * 2**20
    max_header_bytes: int = 64 * 1024
    handshake_timeout_s: float = 10.0
    io_timeout_s: float = 600.0
    max_inbound_requests: int = 16
    # (each may hold a part-sized frame, ~4 MiB, before its handshake: 256 of them let one
    # stranger pin 1 GB of a node's memory; an honest handshake takes milliseconds)
    max_pending_handshakes: int = 64
    replay_window: int = 1024
    offload_bytes: int = 2**20
    part_bytes: int = 4 * 2**20
    parts_in_flight: int = 4
    max_reassembly_bytes: int = 0
    connections_per_peer: int = 4
    requests_per_connection: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.listen, str) or "://" not in self.listen:
            raise ValueError(f"listen: {self.listen!r}, expected an nng URL like tcp://host:port")
        if not 0 < self.max_message_bytes <= 2**40:
            raise ValueError(f"max_message_bytes: {self.max_message_bytes}, expected 1..2**40")
        if not 0 < self.max_header_bytes <= 2**24:
            raise ValueError(f"max_header_bytes: {self.max_header_bytes}, expected 1..2**24")
        for name in ("handshake_timeout_s", "io_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: {value!r}, expected a finite number > 0")
        if not 1 <= self.max_inbound_requests <= 4096:
            raise ValueError(f"max_inbound_requests: {self.max_inbound_requests}, expected 1..4096")
        if not 1 <= self.max_pending_handshakes <= 65536:
            raise ValueError(
                f"max_pending_handshakes: {self.max_pending_handshakes}, expected 1..65536"
            )
        if not 1 <= self.replay_window <= 65536:
            raise ValueError(f"replay_window: {self.replay_window}, expected 1..65536")
        if self.offload_bytes < 0:
            raise ValueError(f"offload_bytes: {self.offload_bytes}, expected >= 0")
        if self.part_bytes < 64 * 1024:
            raise ValueError(f"part_bytes: {self.part_bytes}, expected >= 65536")
        if not 1 <= self.parts_in_flight <= 64:
            raise ValueError(f"parts_in_flight: {self.parts_in_flight}, expected 1..64")
        if not 1 <= self.connections_per_peer <= 64:
            raise ValueError(f"connections_per_peer: {self.connections_per_peer}, expected 1..64")
        if not 1 <= self.requests_per_connection <= 4096:
            raise ValueError(f"requests_per_connection: {self.requests_per_connection}, "
                             "expected 1..4096")  # fmt: skip
        if not 0 <= self.max_reassembly_bytes <= 2**42:
            raise ValueError(f"max_reassembly_bytes: {self.max_reassembly_bytes}, expected "
                             "0..2**42 (0: twice max_message_bytes)")  # fmt: skip

    @property
    def reassembly_budget(self) -> int:
        """max_reassembly_bytes, or twice max_message_bytes when it is 0."""
        return self.max_reassembly_bytes or 2 * self.max_message_bytes

    @property
    def recv_max_size(self) -> int:
        """The largest frame nng may take in: a part (a payload above part_bytes travels in
        parts), not a whole message, so a stranger who has not even started a handshake cannot
        make a node hold max_message_bytes per connection (it could: 256 MiB each, measured)."""
        payload = min(self.part_bytes, self.max_message_bytes)
        return frame_length(self.max_header_bytes, payload, part=True)


@dataclass(frozen=True)
class PeerInfo:
    """A peer whose identity the handshake proved.

    Attributes:
        admitted_until: POSIX time its admission ends (certificate expiry; inf for allow-list and
            open swarms). The session is cut then, and a new handshake must pass admission again.
    """

    peer_id: str
    public_key: bytes = field(repr=False)
    address: str
    direction: Literal["inbound", "outbound"]
    admitted_until: float = math.inf

    @property
    def short_id(self) -> str:
        return short_id(self.peer_id)


@dataclass(frozen=True)
class TransportStatistics:
    """Counters since the transport opened."""

    bytes_in: int
    bytes_out: int
    requests_sent: int
    requests_served: int
    handshakes_ok: int
    handshakes_failed: Mapping[str, int]
    frames_rejected: Mapping[str, int]
    peer_bytes: Mapping[str, tuple[int, int]]  # peer ID -> (bytes in, bytes out)
    inbound_handshakes_ok: int = 0  # of handshakes_ok, those of connections peers dialled to us


Handler = Callable[[PeerInfo, Header, memoryview], Awaitable[tuple[Header, bytes]]]


class _Counters:
    def __init__(self) -> None:
        self.bytes_in = self.bytes_out = self.requests_sent = self.requests_served = 0
        self.handshakes_ok = self.inbound_handshakes_ok = 0
        self.handshakes_failed: Counter[str] = Counter()
        self.frames_rejected: Counter[str] = Counter()
        self.peer_in: Counter[str] = Counter()
        self.peer_out: Counter[str] = Counter()

    def moved(self, peer: PeerInfo | None, n_in: int, n_out: int) -> None:
        self.bytes_in += n_in
        self.bytes_out += n_out
        if peer is not None:
            self.peer_in[peer.peer_id] += n_in
            self.peer_out[peer.peer_id] += n_out

    def snapshot(self) -> TransportStatistics:
        peers = set(self.peer_in) | set(self.peer_out)
        return TransportStatistics(
            self.bytes_in,
            self.bytes_out,
            self.requests_sent,
            self.requests_served,
            self.handshakes_ok,
            MappingProxyType(dict(self.handshakes_failed)),
            MappingProxyType(dict(self.frames_rejected)),
            MappingProxyType({p: (self.peer_in[p], self.peer_out[p]) for p in peers}),
            self.inbound_handshakes_ok,
        )


def dialable(address: str) -> bool:
    """Whether `address` is one a node may dial: tcp://HOST:PORT (port 1..65535), the only kind
    a node listens on. nng dials any URL it knows (ipc://, inproc://, ws://, ...): an address a
    peer gossips is dialled only if it is this. (tcp://0.0.0.0:PORT passes: a node listening on
    every interface without network.advertise announces it, and it reaches only this host.)"""
    parsed = tcp_host_port(address)
    return parsed is not None and parsed[1] >= 1
