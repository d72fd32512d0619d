# A node's network-facing parts (membership with its link probes, the algorithm) on a transport
# that is not a socket: what the testbed's virtual-time run puts on its simulated network. The
# parts are the daemon's own classes, wired as Node wires them; only the transport, the clock that
# times tensor work and the thread hop (inline) differ. Invariants: requests are routed by header
# type to the part that handles it, as the node's router does; nothing here starts a thread.
from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from geotrain.gossip import Candidates, LinkTable, PartnerSelector, client_address

from .._config import NodeConfig
from .._membership_service import MembershipService
from .._peer_choice import PeerChoice, model_dtype
from .._protocol import node_header_codec
from ..algorithms import Algorithm, AlgorithmContext, get_algorithm, inline
from ..training import LoopTrainer
from ..transport import ErrorReply, Header, HeaderCodec, PeerInfo


@dataclass
class PeerParts:
    """One peer's membership service and algorithm on a transport of the caller's.

    Attributes:
        membership: who is live (SWIM, the daemon's), with its link probes.
        algorithm: the configured algorithm's runtime.
        links: the peer's link estimates (fed by probes and exchanges).
    """

    membership: MembershipService
    algorithm: Algorithm
    links: LinkTable

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview):
        """Answer a request as the node's router does: by its type's owner."""
        for part in (self.membership, self.algorithm):
            if isinstance(header, part.handles):
                return await part.handle(peer, header, payload)
        return ErrorReply(code="bad_request", reason=f"unexpected {type(header).__name__}"), b""


class FixedPartners(PartnerSelector):
    """Chooses uniformly among a fixed set of partners only (those of them live): the oracle a
    virtual run measures partner policies against, its set computed offline from the links."""

    def __init__(self, partners: Collection[str], self_id: str, rng: random.Random) -> None:
        super().__init__("uniform", self_id, rng=rng)
        self.partners = frozenset(partners)

    def choose(self, candidates: Candidates | Sequence[str], links, payload_nbytes_for, now):
        ids = candidates.ids if isinstance(candidates, Candidates) else candidates
        return super().choose(tuple(p for p in ids if p in self.partners), links,
                              payload_nbytes_for, now)  # fmt: skip


def header_codec() -> HeaderCodec:
    """The node's header codec: every message type a node sends, the algorithms' included."""
    return node_header_codec()


def peer_parts(
    config: NodeConfig,
    peer_id: str,
    address: str,
    transport,
    trainer: LoopTrainer,
    start_soon: Callable[..., None],
    *,
    rng: random.Random,
    step_interval_s: Callable[[], float | None],
    clock: Callable[[], float],
    incarnation: int | None = None,
    partners: Collection[str] | None = None,
) -> PeerParts:
    """Membership and algorithm of one peer, wired as the daemon wires them.

    Args:
        config: the peer's node config (gossip, network.reachable, chunk sizes).
        peer_id, address: who it is and the address it announces (a client-mode peer
            announces its client address instead, as the daemon does).
        transport: has `request(...)` and `statistics()` as the node's transport.
        trainer: its model.
        start_soon: where background exchanges start.
        rng: its seeded Random; step_interval_s: seconds between its steps lately (the codec
            choice reads it); clock: what times tensor work (a virtual run's stands still);
            incarnation: what its membership announces (None: the wall clock's seconds; a
            restart must announce more than its last life did); partners: a fixed set to choose
            from (FixedPartners) instead of the configured policy (None).
    """
    links = LinkTable()
    selector = (PartnerSelector(config.gossip.policy, peer_id, rng=rng) if partners is None
                else FixedPartners(partners, peer_id, rng))  # fmt: skip
    announced = address if config.network.reachable else client_address(peer_id)
    membership = MembershipService(
        peer_id, announced, list(config.network.bootstrap), config.gossip.probe_interval_s,
        transport, links, selector, rng, incarnation,
    )  # fmt: skip
    params = trainer.params()
    shapes = [(n, tuple(p.shape)) for n, p in params.items()]
    choice = PeerChoice(
        config.gossip, membership, links, selector, shapes, step_interval_s,
        client=not config.network.reachable,
        model_dtype=model_dtype(p.dtype for p in params.values()),
    )  # fmt: skip
    ctx = AlgorithmContext(
        trainer=trainer, gossip=config.gossip, settings=config.gossip.settings, peers=choice,
        network=transport, rng=rng, start_soon=start_soon, to_thread=inline, clock=clock,
        chunk_numel=config.network.chunk_numel, max_chunk_numel=config.network.max_chunk_numel,
    )  # fmt: skip
    algorithm = get_algorithm(config.gossip.algorithm).runtime(ctx)
    return PeerParts(membership, algorithm, links)
