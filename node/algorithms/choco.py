# choco: CHOCO-SGD over pairwise exchanges. Invariants: the per-link estimates and counts are
# gossip's ChocoLinks (sans-I/O); both ends apply exactly the decoded q that went over the wire;
# estimates start at the swarm's common initial model (same training.seed; its digest travels in
# every request); a link is used by one exchange at a time (a second one gets "busy"); counts
# that differ mean an exchange was lost half-way: the responder answers ChocoResync and both ends
# restart that link.
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import structlog
import torch

from geotrain import compress
from geotrain.gossip import ChocoLink, ChocoLinks, RejectedUpdate, choco_difference

from .._config import check_field
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm

log = structlog.get_logger()


class ChocoExchange(Header, frozen=True, tag="choco_exchange"):
    """The payload is q = C(x - x_hat) for the sender's estimate kept for this link.

    `seq` counts the exchanges completed on this link as the sender saw them; a responder whose
    count differs answers ChocoResync and both ends restart the link's estimates at the initial
    model, which both hold (same training.seed: `base` must match).
    """

    codec: CodecSpec
    seq: U63
    base: U63  # digest of the initial model the estimates start from (same seed everywhere)


class ChocoReply(Header, frozen=True, tag="choco_reply"):
    seq: U63


class ChocoResync(Header, frozen=True, tag="choco_resync"):
    """The link's counts differed (`seq` is the responder's); it restarted the link: so must we."""

    seq: U63


@dataclass(frozen=True)
class ChocoSettings:
    """[gossip.choco]

    gamma: the consensus step size (0 < gamma <= 1); smaller is safer for harsher compression
        (topk:0.01, digits-mlp, 4 peers: 0.03-0.1 agree best, 1.0 diverges).
    max_peers: neighbours whose estimates are kept (least recently used dropped first); each
        costs two model copies.
    """

    gamma: float = 0.05
    max_peers: int = 16

    def __post_init__(self) -> None:
        check_field(0 < self.gamma <= 1, "gossip.choco.gamma", self.gamma, "0 < gamma <= 1")
        check_field(self.max_peers >= 1, "gossip.choco.max_peers", self.max_peers, ">= 1")


@dataclass(frozen=True)
class ChocoStatistics:
    resyncs: int
    tracked_peers: int = field(metadata={"gauge": True})  # a level, not a count (metrics: a gauge)


def model_digest(params: Tensors) -> int:
    """A 63-bit digest of the parameters' names and bytes."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


class Choco(Algorithm):
    """CHOCO-SGD over pairwise exchanges, every `exchange_every` steps with one partner.

    Per link, both ends hold x_hat (ours) and x_hat_j (the peer's); an exchange sends
    q = C(x - x_hat) each way, both ends add the decoded q's to their copies and mix
    x += gamma / 2 * (x_hat_j - x_hat).

    Assumes: every node starts from the same model (same training.seed; checked) and a codec
    that is a contraction (top-k, quantizers). Trades: two model copies per tracked neighbour
    (at most `max_peers`) and a gamma-limited agreement speed for sending only what the codec
    keeps (topk:0.01 sends ~1% of the values); a lost exchange restarts that link.
    """

    handles = (ChocoExchange,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        base = ctx.trainer.snapshot()  # built before any restore: the seed's initial model
        self.base_digest = model_digest(base)
        self.links = ChocoLinks(base, ctx.settings.max_peers)
        self._running = False
        self._seed = 0
        self.resyncs = 0

    def statistics(self) -> ChocoStatistics:
        return ChocoStatistics(self.resyncs, len(self.links))

    def busy(self) -> bool:
        return self._running

    def state(self) -> tuple[Tensors, dict]:
        tensors, seqs = self.links.state_dict()
        return tensors, {"seq": seqs}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        seqs = {str(p): int(s) for p, s in dict(meta.get("seq", {})).items()}
        self.links.load_state_dict(tensors, seqs, self.ctx.trainer.task_device)

    def _link(self, peer: str) -> ChocoLink:
        return self.links.link(peer, self.ctx.peers.live_peers())

    # -- the tensor work (worker threads) -------------------------------------------------------
    def _compress(self, link: ChocoLink, spec: str) -> tuple[bytes, Tensors]:
        """q = C(x - x_hat) as bytes, and decoded exactly as the peer will see it."""
        self._seed += 1
        diff = self.ctx.trainer.update(lambda live: choco_difference(live, link.mine))
        payload = self.ctx.encode(diff, spec, seed=self._seed)
        return payload, self.ctx.decode(payload, spec)

    def _apply(self, link: ChocoLink, q_mine: Tensors, q_theirs: Tensors) -> float:
        gamma = self.ctx.settings.gamma
        radius = self.ctx.robust if self.ctx.gossip.robust != "none" else None
        return self.ctx.trainer.apply(
            lambda live: link.apply(live, q_mine, q_theirs, gamma, radius)
        )

    def _decode_q(self, payload: bytes, spec: str) -> Tensors:
        # a difference, not a model: its norm is bounded by the model's (ratio + 1), names/shapes
        # and finiteness as for a model
        return self.ctx.decode_checked(payload, spec)

    # -- initiator ------------------------------------------------------------------------------
    async def after_step(self, result: StepResult) -> None:
        if result.step % self.ctx.gossip.exchange_every or self._running:
            return
        partner = self.ctx.peers.choose_partner(self.ctx.now())
        if partner is not None and self.ctx.peers.address_of(partner) is not None:
            self._running = True
            self.ctx.start_soon(self._exchange, partner)

    async def _exchange(self, partner: str) -> None:
        try:
            link = self._link(partner)
            if link.busy:
                return
            link.busy = True
            try:
                await self._exchange_on(partner, link)
            finally:
                link.busy = False
        finally:
            self._running = False

    async def _exchange_on(self, partner: str, link: ChocoLink) -> None:
        ctx = self.ctx
        started = ctx.now()
        spec = ctx.peers.choose_codec(partner, started)
        payload, q_mine = await ctx.to_thread(self._compress, link, spec)
        deadline = ctx.peers.exchange_deadline(partner, len(payload), started)
        address = ctx.peers.address_of(partner)
        if address is None:
            return
        header = ChocoExchange(codec=spec, seq=link.seq, base=self.base_digest)
        try:
            reply, data, _ = await ctx.network.request(
                address, header, payload, deadline_s=deadline, expect_peer=partner
            )
        except TransportError as exc:
            return self._failed(partner, spec, f"{type(exc).__name__}: {exc}")
        if isinstance(reply, ChocoResync):
            await ctx.to_thread(link.reset, self.links.base)
            self.resyncs += 1
            log.info("choco_resync", partner=partner[:12], ours=link.seq, theirs=reply.seq)
            return
        if isinstance(reply, ErrorReply) and reply.code == "busy":
            ctx.peers.busy(partner, ctx.now())
            return
        if isinstance(reply, ErrorReply):
            return self._failed(partner, spec, f"{reply.code}: {reply.reason}")
        if not isinstance(reply, ChocoReply) or reply.seq != link.seq + 1:
            return self._failed(partner, spec, f"unexpected {type(reply).__name__}")
        try:
            q_theirs = await ctx.to_thread(self._decode_q, bytes(data), spec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            # the peer applied its side: the counts now differ and the next exchange resyncs
            self.counters.record_rejected(partner, spec, exc)
            ctx.peers.unreliable(partner, ctx.now())
            log.warning("update_rejected", peer=partner[:12], reason=str(exc))
            return
        distance = await ctx.to_thread(self._apply, link, q_mine, q_theirs)
        now = ctx.now()
        ctx.peers.succeeded(partner, len(payload) + len(data), now - started, now)
        self.counters.record_ok(partner, spec)
        log.debug(
            "exchange_done",
            partner=partner[:12],
            codec=spec,
            bytes=len(payload),
            distance=round(distance, 5),
        )

    def _failed(self, partner: str, spec: str, reason: str) -> None:
        self.ctx.peers.failed(partner, self.ctx.now())
        self.counters.record_failed(partner, spec)
        log.info("exchange_failed", partner=partner[:12], reason=reason)

    # -- responder ------------------------------------------------------------------------------
    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, ChocoExchange)
        ctx = self.ctx
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        if header.base != self.base_digest:
            reason = "initial models differ: every node of a swarm needs the same training.seed"
            return ErrorReply(code="bad_request", reason=reason), b""
        link = self._link(peer.peer_id)
        verdict = link.judge(header.seq)
        if verdict == "busy":
            return ErrorReply(code="busy", reason="an exchange on this link is running"), b""
        if verdict == "resync":
            ours = link.seq
            await ctx.to_thread(link.reset, self.links.base)
            self.resyncs += 1
            log.info("choco_resync", peer=peer.short_id, ours=ours, theirs=header.seq)
            return ChocoResync(seq=ours), b""
        link.busy = True
        try:
            data = bytes(payload)
            try:
                q_theirs = await ctx.to_thread(self._decode_q, data, header.codec)
            except (RejectedUpdate, compress.DecodeError) as exc:
                self.counters.record_rejected(peer.peer_id, header.codec, exc)
                log.warning("update_rejected", peer=peer.short_id, reason=str(exc))
                return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
            reply, q_mine = await ctx.to_thread(self._compress, link, header.codec)
            await ctx.to_thread(self._apply, link, q_mine, q_theirs)
            self.counters.record_ok(peer.peer_id, header.codec)
            return ChocoReply(seq=link.seq), reply
        finally:
            link.busy = False


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="choco",
        runtime=Choco,
        settings=ChocoSettings,
        messages=(ChocoExchange, ChocoReply, ChocoResync),
        summary="CHOCO-SGD: compressed differences against per-neighbour public estimates",
        # the initial model, two estimates per tracked neighbour, and one difference in flight
        memory=lambda g: 2.0 + 2 * g.settings.max_peers,
    )
)
