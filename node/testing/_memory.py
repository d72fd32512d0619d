# An in-memory network for testing the node's parts without processes or sockets. Invariants:
# a request travels as it would on the wire (its header encoded and decoded by the node's
# HeaderCodec, its payload copied), so a message that cannot be sent for real cannot be sent here;
# the responder runs in the network's own nursery and finishes what it started even after the
# asker stopped waiting (as a real peer does); every wait is on trio's clock, so under
# trio.testing.MockClock(autojump_threshold=0) delays and deadlines take exact virtual times.
from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from geotrain.gossip import LinkTable, PartnerSelector

from .._config import GossipConfig
from .._peer_choice import PeerChoice, model_dtype
from .._protocol import node_header_codec
from ..algorithms import Algorithm, AlgorithmContext, ExchangeCounters, get_algorithm, inline
from ..training import Trainer
from ..transport import (
    HandshakeError,
    Header,
    HeaderCodec,
    PeerInfo,
    PeerUnreachable,
    RequestTimeout,
)

Handler = Callable[[PeerInfo, Header, memoryview], Awaitable[tuple[Header, bytes]]]


@dataclass
class _Link:
    delay_s: float = 0.0  # one way
    cut: bool = False
    lose_replies: int = 0  # the next n replies on this link never arrive


@dataclass
class MemoryNetwork:
    """Peers that reach each other through memory. Made by `open_memory_network()`.

    Addresses are `mem://<peer id>`. Links are directed (a -> b) and start perfect.
    """

    codec: HeaderCodec
    _nursery: trio.Nursery
    _handlers: dict[str, tuple[str, Handler]] = field(default_factory=dict)
    _links: dict[tuple[str, str], _Link] = field(default_factory=dict)
    bytes_sent: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, peer_id: str, handler: Handler) -> MemoryTransport:
        """A transport for `peer_id`, whose requests from others go to `handler`."""
        address = f"mem://{peer_id}"
        self._handlers[address] = (peer_id, handler)
        return MemoryTransport(self, peer_id, address)

    def set_handler(self, peer_id: str, handler: Handler) -> None:
        self._handlers[f"mem://{peer_id}"] = (peer_id, handler)

    def remove(self, peer_id: str) -> None:
        """`peer_id` is gone: requests to it fail as to a machine that is off."""
        self._handlers.pop(f"mem://{peer_id}", None)

    def link(self, a: str, b: str) -> _Link:
        return self._links.setdefault((a, b), _Link())

    def set_delay(self, a: str, b: str, seconds: float, *, both_ways: bool = True) -> None:
        """One-way delay of a -> b (and b -> a)."""
        self.link(a, b).delay_s = seconds
        if both_ways:
            self.link(b, a).delay_s = seconds

    def cut(self, a: str, b: str) -> None:
        """Nothing gets through between a and b (both ways) until `heal`: requests time out."""
        self.link(a, b).cut = self.link(b, a).cut = True

    def heal(self, a: str, b: str) -> None:
        self.link(a, b).cut = self.link(b, a).cut = False

    def lose_next_reply(self, a: str, b: str) -> None:
        """The next reply b sends to a's request is lost (b acted on the request; a times out)."""
        self.link(a, b).lose_replies += 1

    def _count(self, a: str, b: str, nbytes: int) -> None:
        self.bytes_sent[(a, b)] = self.bytes_sent.get((a, b), 0) + nbytes


@dataclass
class MemoryTransport:
    """One peer's end of a MemoryNetwork; has the transport's `request` signature."""

    network: MemoryNetwork
    peer_id: str
    address: str

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
            PeerUnreachable: nobody at `address`. HandshakeError: someone else than
            `expect_peer` is. RequestTimeout: no reply within `deadline_s`.
        """
        net = self.network
        target = net._handlers.get(address)
        if target is None:
            raise PeerUnreachable(f"nobody at {address}")
        peer_id, handler = target
        if expect_peer is not None and peer_id != expect_peer:
            raise HandshakeError(f"peer ID mismatch: expected {expect_peer}, proved {peer_id}")
        wire = net.codec.encode(header)
        data = bytes(payload)
        done = trio.Event()
        reply: list[tuple[Header, bytearray]] = []
        me = PeerInfo(self.peer_id, b"", self.address, "inbound")

        async def serve() -> None:
            there, back = net.link(self.peer_id, peer_id), net.link(peer_id, self.peer_id)
            await trio.sleep(there.delay_s)
            if there.cut or address not in net._handlers:  # cut (or gone) while on the way
                return
            net._count(self.peer_id, peer_id, len(wire) + len(data))
            answer, answer_payload = await handler(me, net.codec.decode(wire), memoryview(data))
            reply_wire, reply_data = net.codec.encode(answer), bytearray(answer_payload)
            if there.lose_replies:
                there.lose_replies -= 1
                return
            await trio.sleep(back.delay_s)
            if back.cut or net._handlers.get(self.address) is None:
                return
            net._count(peer_id, self.peer_id, len(reply_wire) + len(reply_data))
            reply.append((net.codec.decode(reply_wire), reply_data))
            done.set()

        net._nursery.start_soon(serve)
        with trio.move_on_after(deadline_s):
            await done.wait()
        if not reply:
            raise RequestTimeout(f"no reply from {address} within {deadline_s} s")
        answer, answer_payload = reply[0]
        return answer, answer_payload, PeerInfo(peer_id, b"", address, "outbound")


@asynccontextmanager
async def open_memory_network(codec: HeaderCodec | None = None) -> AsyncIterator[MemoryNetwork]:
    """A MemoryNetwork whose responders run in a nursery that ends with the block.

    Args:
        codec: the header types allowed on it (default: the node's, every algorithm included).
    """
    async with trio.open_nursery() as nursery:
        yield MemoryNetwork(codec or node_header_codec(), nursery)
        nursery.cancel_scope.cancel()


@dataclass
class StaticMembership:
    """A membership view with a fixed (but changeable) set of live peers at mem:// addresses."""

    peers: list[str]

    def live_peers(self) -> tuple[str, ...]:
        return tuple(self.peers)

    def address_of(self, peer_id: str) -> str | None:
        return f"mem://{peer_id}" if peer_id in self.peers else None


def algorithm_on(
    network: MemoryNetwork,
    peer_id: str,
    trainer: Trainer,
    gossip: GossipConfig,
    peers: Sequence[str],
    start_soon: Callable[..., None],
    *,
    seed: int = 0,
    chunk_numel: int | None = None,
) -> Algorithm:
    """The runtime of `gossip.algorithm` for `peer_id` on `network`, with tensor work inline.

    Its requests go through the network; requests to it reach its `handle`. The partner policy is
    `gossip.policy` over `peers` (a StaticMembership the caller may change through
    `algorithm.ctx.peers`).

    Args:
        network: the in-memory network; peer_id: who it is; trainer: its model.
        gossip: the gossip section (algorithm, codec, exchange_every, settings).
        peers: the other peers it sees live.
        start_soon: where it starts background exchanges (a nursery's start_soon).
        seed: seeds its Random.
        chunk_numel: elements per chunk of the model streams it starts (default: the node's).
    """
    rng = random.Random(seed)
    membership = StaticMembership(list(peers))
    params = trainer.params()
    choice = PeerChoice(
        gossip, membership, LinkTable(), PartnerSelector(gossip.policy, peer_id, rng=rng),
        [(n, tuple(t.shape)) for n, t in params.items()], lambda: 0.01,
        model_dtype=model_dtype(t.dtype for t in params.values()),
    )  # fmt: skip
    transport = network.add(peer_id, _unset)
    ctx = AlgorithmContext(
        trainer=trainer, gossip=gossip, settings=gossip.settings, peers=choice,
        network=transport, rng=rng, start_soon=start_soon, to_thread=inline,
        counters=ExchangeCounters(), clock=trio.current_time,
    )  # fmt: skip
    if chunk_numel is not None:
        ctx.chunk_numel = chunk_numel
    algorithm = get_algorithm(gossip.algorithm).runtime(ctx)
    network.set_handler(peer_id, algorithm.handle)
    return algorithm


async def _unset(peer, header, payload):  # replaced by the algorithm's handle at once
    raise RuntimeError("no handler yet")

