# choco: CHOCO-SGD over pairwise exchanges. Invariants: each link (this node, peer) has its own
# pair of public estimates (ours as the peer knows it, the peer's) and a count of completed
# exchanges; both ends apply exactly the decoded q that went over the wire, so their copies stay
# equal; estimates start at the swarm's common initial model (same training.seed; its digest
# travels in every request); a link is used by one exchange at a time (a second one gets "busy");
# counts that differ mean an exchange was lost half-way, and both ends restart that link;
# estimates of peers that are no longer live, or beyond choco_max_peers, are dropped.
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog
import torch
import trio

import compress
from gossip._algorithms import choco_consensus, choco_difference, choco_update_estimate
from gossip._averaging import RejectedUpdate

from ._algorithm import AlgorithmContext, Tensors
from ._messages import ErrorReply, Header
from ._protocol import ChocoExchange, ChocoReply
from ._trainer import StepResult
from ._transport import PeerInfo, TransportError

RESYNC = "resync"
log = structlog.get_logger()


@dataclass
class _Link:
    seq: int = 0
    mine: Tensors = field(default_factory=dict)  # our public estimate, as this peer holds it
    theirs: Tensors = field(default_factory=dict)  # the peer's public estimate
    busy: bool = False

    def reset(self, base: Tensors) -> None:
        self.seq = 0
        self.mine = {n: t.clone() for n, t in base.items()}
        self.theirs = {n: t.clone() for n, t in base.items()}


def model_digest(params: Tensors) -> int:
    """A 63-bit digest of the parameters' names and bytes."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


class ChocoRuntime:
    """CHOCO-SGD over pairwise exchanges, every `exchange_every` steps with one partner.

    Per link, both ends hold x_hat (ours) and x_hat_j (the peer's); an exchange sends
    q = C(x - x_hat) each way, both ends add the decoded q's to their copies and mix
    x += gamma / 2 * (x_hat_j - x_hat).

    Assumes: every node starts from the same model (same training.seed; checked) and a codec
    that is a contraction (top-k, quantizers). Trades: two model copies per tracked neighbour
    (at most `choco_max_peers`) and a gamma-limited agreement speed for sending only what the
    codec keeps (topk:0.01 sends ~1% of the values); a lost exchange restarts that link.
    """

    headers = (ChocoExchange,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        self.ctx = ctx
        self.links: OrderedDict[str, _Link] = OrderedDict()
        self.base = ctx.trainer.snapshot()  # built before any restore: the seed's initial model
        self.base_digest = model_digest(self.base)
        self._running = False
        self._seed = 0
        self.ok = self.failed = self.resyncs = self.rejected = 0

    def statistics(self) -> dict[str, float | int]:
        return {
            "exchanges_ok": self.ok,
            "exchanges_failed": self.failed,
            "resyncs": self.resyncs,
            "tracked_peers": len(self.links),
        }

    def model_replaced(self) -> None:
        pass  # x - x_hat carries the jump to the neighbours like any other change

    # -- links ----------------------------------------------------------------------------------
    def _link(self, peer: str) -> _Link:
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = _Link()
            link.reset(self.base)
        self.links.move_to_end(peer)
        live = set(self.ctx.live_peers()) | {peer}
        for other in [p for p, x in self.links.items() if p not in live and not x.busy]:
            del self.links[other]
        while len(self.links) > self.ctx.config.choco_max_peers:
            oldest = next(p for p, x in self.links.items() if not x.busy or p == peer)
            del self.links[oldest]
        return link

    def state(self) -> tuple[Tensors, dict]:
        tensors: Tensors = {}
        seqs = {}
        for peer, link in list(self.links.items()):
            if link.busy:
                continue  # half-way: the count check restarts it after a resume anyway
            seqs[peer] = link.seq
            tensors.update({f"{peer}/mine/{n}": t.clone() for n, t in link.mine.items()})
            tensors.update({f"{peer}/theirs/{n}": t.clone() for n, t in link.theirs.items()})
        return tensors, {"seq": seqs}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        device = self.ctx.trainer.task_device
        for peer, seq in dict(meta.get("seq", {})).items():
            link = _Link(seq=int(seq))
            for name in self.ctx.trainer.params():
                link.mine[name] = tensors[f"{peer}/mine/{name}"].to(device)
                link.theirs[name] = tensors[f"{peer}/theirs/{name}"].to(device)
            self.links[peer] = link

    # -- the tensor work (worker threads) -------------------------------------------------------
    def _compress(self, link: _Link, spec: str) -> tuple[bytes, Tensors]:
        """q = C(x - x_hat) as bytes, and decoded exactly as the peer will see it."""
        self._seed += 1
        diff = self.ctx.trainer.update(lambda live: choco_difference(live, link.mine))
        payload = self.ctx.encode(diff, spec, seed=self._seed)
        return payload, self.ctx.decode(payload, spec)

    def _apply(self, link: _Link, q_mine: Tensors, q_theirs: Tensors) -> float:
        def rule(live: Tensors) -> float:
            choco_update_estimate(link.mine, q_mine)
            choco_update_estimate(link.theirs, q_theirs)
            gamma = self.ctx.config.choco_gamma
            return choco_consensus(live, link.mine, link.theirs, gamma=gamma)

        link.seq += 1
        return self.ctx.trainer.update(rule)

    def _decode_q(self, payload: bytes, spec: str) -> Tensors:
        # a difference, not a model: its norm is bounded by the model's (ratio + 1), names/shapes
        # and finiteness as for a model
        return self.ctx.decode_checked(payload, spec)

    # -- initiator ------------------------------------------------------------------------------
    async def after_step(self, result: StepResult) -> None:
        if result.step % self.ctx.config.exchange_every or self._running:
            return
        partner = self.ctx.choose_partner(self.ctx.now())
        if partner is not None and self.ctx.address_of(partner) is not None:
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

    async def _exchange_on(self, partner: str, link: _Link) -> None:
        ctx = self.ctx
        started = ctx.now()
        spec = ctx.choose_codec(partner, started)
        payload, q_mine = await trio.to_thread.run_sync(self._compress, link, spec)
        deadline = ctx.links.exchange_deadline(partner, len(payload), started)
        address = ctx.address_of(partner)
        try:
            reply, data, _ = await ctx.request(
                address,
                ChocoExchange(codec=spec, seq=link.seq, base=self.base_digest),
                payload,
                deadline_s=deadline,
                expect_peer=partner,
            )
        except TransportError as exc:
            return self._failed(partner, f"{type(exc).__name__}: {exc}")
        if isinstance(reply, ErrorReply):
            if reply.code == "busy":
                ctx.record_busy(partner, ctx.now())
            elif reply.reason.startswith(RESYNC):
                await trio.to_thread.run_sync(link.reset, self.base)
                self.resyncs += 1
                log.info("choco_resync", partner=partner[:12], reason=reply.reason)
            else:
                self._failed(partner, f"{reply.code}: {reply.reason}")
            return
        if not isinstance(reply, ChocoReply) or reply.seq != link.seq + 1:
            return self._failed(partner, f"unexpected {type(reply).__name__}")
        try:
            q_theirs = await trio.to_thread.run_sync(self._decode_q, bytes(data), spec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            self.rejected += 1
            log.warning("update_rejected", peer=partner[:12], reason=str(exc))
            return self._failed(partner, f"rejected: {exc}")  # the peer moved on: next is resync
        distance = await trio.to_thread.run_sync(self._apply, link, q_mine, q_theirs)
        now = ctx.now()
        ctx.links.record_transfer(partner, len(payload) + len(data), now - started, now)
        ctx.record_outcome(partner, True, now)
        self.ok += 1
        log.debug(
            "exchange_done",
            partner=partner[:12],
            codec=spec,
            bytes=len(payload),
            distance=round(distance, 5),
        )

    def _failed(self, partner: str, reason: str) -> None:
        now = self.ctx.now()
        self.ctx.links.record_failure(partner, now)
        self.ctx.record_outcome(partner, False, now)
        self.failed += 1
        log.info("exchange_failed", partner=partner[:12], reason=reason)

    # -- responder ------------------------------------------------------------------------------
    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        assert isinstance(header, ChocoExchange)
        if not self.ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        if header.base != self.base_digest:
            reason = "initial models differ: every node of a swarm needs the same training.seed"
            return ErrorReply(code="bad_request", reason=reason), b""
        link = self._link(peer.peer_id)
        if link.busy:
            return ErrorReply(code="busy", reason="an exchange on this link is running"), b""
        if header.seq != link.seq:
            reason = f"{RESYNC}: link count {link.seq}, peer sent {header.seq}"
            await trio.to_thread.run_sync(link.reset, self.base)
            self.resyncs += 1
            return ErrorReply(code="bad_request", reason=reason), b""
        link.busy = True
        try:
            data = bytes(payload)
            try:
                q_theirs = await trio.to_thread.run_sync(self._decode_q, data, header.codec)
            except (RejectedUpdate, compress.DecodeError) as exc:
                self.rejected += 1
                log.warning("update_rejected", peer=peer.short_id, reason=str(exc))
                return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
            reply, q_mine = await trio.to_thread.run_sync(self._compress, link, header.codec)
            await trio.to_thread.run_sync(self._apply, link, q_mine, q_theirs)
            return ChocoReply(seq=link.seq), reply
        finally:
            link.busy = False
