# diloco: local SGD with an outer Nesterov step on gossip-averaged pseudo-gradients.
# Invariants: the model moves by the outer step only at round ends (every inner_steps steps), from
# the round's starting parameters; a round end waits at most the partners' link deadlines (late
# or missing partners are left out, never waited for beyond that); each peer's pseudo-gradient of
# a round is used at most once and only if at most max_staleness rounds old (gossip's
# fresh_deltas); pseudo-gradients from peers are decoded within the model's size budget and
# checked first.
from __future__ import annotations

from dataclasses import dataclass

import structlog
import trio

from geotrain import compress
from geotrain.gossip import (
    NesterovOuter,
    RejectedUpdate,
    average,
    fresh_deltas,
    pseudo_gradient,
)

from .._config import check_field
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm

log = structlog.get_logger()


class DeltaOffer(Header, frozen=True, tag="delta_offer"):
    """The payload is the sender's pseudo-gradient of outer round `round`."""

    codec: CodecSpec
    round: U63


class DeltaReply(Header, frozen=True, tag="delta_reply"):
    """The responder's latest pseudo-gradient (empty payload when it has none yet)."""

    round: U63


@dataclass(frozen=True)
class DilocoSettings:
    """[gossip.diloco]

    inner_steps: H, local steps per outer round.
    outer_lr / outer_momentum: the outer Nesterov SGD (DiLoCo's published 0.7 / 0.9).
    fanout: most peers a pseudo-gradient is sent to per outer round.
    max_staleness: a peer's pseudo-gradient at most this many rounds older than ours is used (a
        slower peer's updates still count).
    """

    inner_steps: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fanout: int = 8
    max_staleness: int = 4

    def __post_init__(self) -> None:
        check_field(self.inner_steps >= 1, "gossip.diloco.inner_steps", self.inner_steps, ">= 1")
        check_field(self.outer_lr > 0, "gossip.diloco.outer_lr", self.outer_lr, "> 0")
        check_field(0 <= self.outer_momentum < 1, "gossip.diloco.outer_momentum",
                    self.outer_momentum, "0 <= momentum < 1")  # fmt: skip
        check_field(self.fanout >= 1, "gossip.diloco.fanout", self.fanout, ">= 1")
        check_field(self.max_staleness >= 0, "gossip.diloco.max_staleness", self.max_staleness,
                    ">= 0")  # fmt: skip


@dataclass(frozen=True)
class DilocoStatistics:
    outer_steps: int
    peer_deltas_used: int
    partners_missing: int


class Diloco(Algorithm):
    """DiLoCo-style local SGD: H inner steps, then an outer Nesterov step on averaged updates.

    At a round end the pseudo-gradient (round start minus now) is encoded once (error feedback
    keeps what the codec dropped), offered to up to `fanout` live peers, and averaged with the
    peers' pseudo-gradients that arrived (replies, or offers pushed to us) within the deadline and
    at most `max_staleness` rounds old; the outer optimizer then moves the round's start and the
    model restarts there.

    Assumes: a small, well-connected group whose models start equal (same seed): only updates
    are averaged, never models, so models drift apart when nodes average different sets.
    Trades: agreement for H-fold fewer, compressible messages; a round end waits at most one
    deadline, and late partners are left out.
    """

    handles = (DeltaOffer,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        cfg = ctx.settings
        self.outer = NesterovOuter(cfg.outer_lr, cfg.outer_momentum)
        self.start = ctx.trainer.snapshot()  # the parameters this outer round started from
        self.round = 0  # outer rounds completed
        self.latest: tuple[int, bytes | None, str] = (0, None, "")  # (round, payload, codec)
        self.latest_delta: Tensors | None = None
        self.inbox: dict[str, tuple[int, Tensors]] = {}
        self.used: dict[str, int] = {}
        self.feedback = compress.ErrorFeedback(compress.get_codec("none"))
        self._rejected_now: set[str] = set()  # partners whose update this round was refused
        self.outer_steps = self.peer_deltas_used = self.missing = 0

    def statistics(self) -> DilocoStatistics:
        return DilocoStatistics(self.outer_steps, self.peer_deltas_used, self.missing)

    def state(self) -> tuple[Tensors, dict]:
        tensors = {f"start/{n}": t.clone() for n, t in self.start.items()}
        tensors.update({f"momentum/{n}": t.clone() for n, t in self.outer.buffers.items()})
        tensors.update({f"ef/{n}": t for n, t in self.feedback.state_dict().items()})
        return tensors, {"round": self.round}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        device = self.ctx.trainer.task_device
        for prefix, target in (("start/", self.start), ("momentum/", self.outer.buffers)):
            for key, t in tensors.items():
                if key.startswith(prefix):
                    target[key[len(prefix) :]] = t.to(device)
        self.feedback.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("ef/")})
        self.round = int(meta.get("round", 0))

    def model_replaced(self) -> None:
        self.start = self.ctx.trainer.snapshot()

    def _spec(self, partners: list[str]) -> str:
        peers = self.ctx.peers
        if peers.fixed_codec is not None:
            return peers.fixed_codec
        now = self.ctx.now()
        specs = {peers.choose_codec(p, now) for p in partners} or {"fp16"}
        return min(specs, key=peers.payload_nbytes)

    def _round_end(self, spec: str) -> tuple[Tensors, bytes]:
        delta = self.ctx.trainer.update(lambda live: pseudo_gradient(self.start, live))
        codec = compress.get_codec(spec)
        payload = compress.encode_named(
            sorted(delta.items()), codec, error_feedback=self.feedback, seed=self.round
        )
        return delta, payload

    async def after_step(self, result: StepResult) -> None:
        ctx = self.ctx
        if result.step % ctx.settings.inner_steps:
            return
        round_ = self.round + 1
        live = sorted(ctx.peers.live_peers())
        partners = sorted(ctx.rng.sample(live, min(len(live), ctx.settings.fanout)))
        spec = self._spec(partners)
        delta, payload = await ctx.to_thread(self._round_end, spec)
        self.latest, self.latest_delta = (round_, payload, spec), delta
        replies: dict[str, tuple[int, Tensors | None]] = {}  # who answered (with its update)
        if partners:
            now = ctx.now()
            deadline = max(ctx.peers.round_deadline(p, len(payload), now) for p in partners)
            with trio.move_on_after(deadline):
                async with trio.open_nursery() as nursery:
                    for peer in partners:
                        nursery.start_soon(
                            self._offer, peer, round_, spec, payload, deadline, replies
                        )
        now = ctx.now()
        for peer in partners:  # an offer cut off by the deadline raised nothing: count it here
            if peer not in replies and peer not in self._rejected_now:
                ctx.peers.failed(peer, now)
                self.counters.record_failed(peer, spec)
        self._rejected_now.clear()
        await self._outer_step(round_, delta, replies, partners)

    async def _outer_step(self, round_, delta, replies, partners) -> None:
        offered = {**self.inbox}
        for peer, (r, d) in replies.items():
            if d is not None and r > offered.get(peer, (-1, None))[0]:
                offered[peer] = (r, d)
        use = fresh_deltas(
            round_,
            {p: r for p, (r, _) in offered.items()},
            self.used,
            max_staleness=self.ctx.settings.max_staleness,
        )
        deltas = [delta] + [offered[p][1] for p in use]

        def step(live: Tensors) -> None:
            self.outer.step(self.start, average(deltas))
            for name, tensor in live.items():
                tensor.copy_(self.start[name])

        await self.ctx.to_thread(lambda: self.ctx.trainer.update(step))
        for peer in use:
            self.used[peer] = offered[peer][0]
        self.inbox.clear()
        live = set(self.ctx.peers.live_peers())
        self.used = {p: r for p, r in self.used.items() if p in live}
        self.round = round_
        self.outer_steps += 1
        self.peer_deltas_used += len(use)
        missing = [p for p in partners if p not in replies]
        self.missing += len(missing)
        log.info(
            "outer_step",
            round=round_,
            used=[p[:12] for p in use],
            missing=[p[:12] for p in missing],
        )

    async def _offer(self, peer, round_, spec, payload, deadline, replies) -> None:
        ctx = self.ctx
        address = ctx.peers.address_of(peer)
        if address is None:
            return
        started = ctx.now()
        try:
            reply, data, _ = await ctx.network.request(
                address,
                DeltaOffer(codec=spec, round=round_),
                payload,
                deadline_s=deadline,
                expect_peer=peer,
            )
        except TransportError as exc:  # counted as failed when the round ends
            log.info("exchange_failed", partner=peer[:12], reason=str(exc))
            return
        if not isinstance(reply, DeltaReply):
            log.info("exchange_failed", partner=peer[:12], reason=getattr(reply, "reason", ""))
            return
        now = ctx.now()
        ctx.peers.transferred(peer, len(payload) + len(data), now - started, now)
        delta = None
        if data:
            try:
                delta = await ctx.to_thread(ctx.decode_checked, bytes(data), spec)
            except (RejectedUpdate, compress.DecodeError) as exc:
                self._rejected_now.add(peer)
                self.counters.record_rejected(peer, spec)
                ctx.peers.unreliable(peer, now)
                log.warning("update_rejected", peer=peer[:12], reason=str(exc))
                return
        replies[peer] = (reply.round, delta)
        self.counters.record_ok(peer, spec)

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, DeltaOffer)
        ctx = self.ctx
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        data = bytes(payload)
        try:
            delta = await ctx.to_thread(ctx.decode_checked, data, header.codec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            self.counters.record_rejected(peer.peer_id, header.codec)
            log.warning("update_rejected", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        if header.round > self.inbox.get(peer.peer_id, (-1, None))[0]:
            self.inbox[peer.peer_id] = (header.round, delta)
        self.counters.record_ok(peer.peer_id, header.codec)
        round_, latest, spec = self.latest
        if latest is None:
            return DeltaReply(round=0), b""
        if spec != header.codec and self.latest_delta is not None:
            try:
                latest = await ctx.to_thread(ctx.encode, self.latest_delta, header.codec)
            except ValueError as exc:
                return ErrorReply(code="bad_request", reason=f"codec: {exc}"[:500]), b""
        return DeltaReply(round=round_), latest


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="diloco",
        runtime=Diloco,
        settings=DilocoSettings,
        messages=(DeltaOffer, DeltaReply),
        summary="local SGD: inner_steps local steps, then an outer step on averaged updates",
        # round start, outer momentum, error feedback, our update (and its payload), and up to
        # fanout updates from peers offered to us plus fanout replies
        memory=lambda g: 5.0 + 2 * g.settings.fanout,
    )
)
