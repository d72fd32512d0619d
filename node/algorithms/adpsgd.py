# adpsgd: asynchronous pairwise averaging (AD-PSGD), both sides. Invariants: training never waits
# for an exchange (the node runs it beside the training thread; at most one exchange is started
# by this node at a time, and at most MAX_RESPONSES are answered at once, later ones get "busy");
# every exchange has a deadline derived from the partner's link estimate; a peer's model is
# decoded within the model's size budget and checked before it is mixed; a mix keeps the local
# progress made since the snapshot that was sent (x += w (x_peer - x_snapshot)).
from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import structlog

from geotrain import compress
from geotrain.gossip import RejectedUpdate

from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, Name, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm

MAX_RESPONSES = 2
log = structlog.get_logger()


class Exchange(Header, frozen=True, tag="exchange"):
    """Start a pairwise exchange: the payload is the sender's model, encoded with `codec`.

    The responder answers ExchangeReply with its own model encoded with the same codec, and both
    mix. `algorithm` must match the responder's; `step` is informational.
    """

    algorithm: Name
    codec: CodecSpec
    step: U63


class ExchangeReply(Header, frozen=True, tag="exchange_reply"):
    step: U63


OnMixed = Callable[[], Awaitable[None]]


class Adpsgd(Algorithm):
    """AD-PSGD: every `exchange_every` steps, average with one partner chosen by the policy.

    Assumes nothing about the peers' speed. Trades a slower agreement (one partner at a time)
    for never waiting: a partner that misses the link's deadline is skipped and chosen less.
    """

    handles = (Exchange,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        self.feedback = compress.ErrorFeedback(compress.get_codec("none"))
        self._feedback_lock = threading.Lock()
        self._responding = 0
        self._running = False
        self._seed = 0

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> tuple[Tensors, dict]:
        with self._feedback_lock:
            return {f"ef/{k}": v for k, v in self.feedback.state_dict().items()}, {}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        ef = {k[3:]: v for k, v in tensors.items() if k.startswith("ef/")}
        with self._feedback_lock:
            self.feedback.load_state_dict(ef)

    def busy(self) -> bool:
        return self._running

    # -- tensor work (worker threads) -----------------------------------------------------------
    def _encode(self, params: Tensors, spec: str) -> bytes:
        codec = compress.get_codec(spec)
        with self._feedback_lock:
            self._seed += 1
            return compress.encode_named(
                sorted(params.items()), codec, error_feedback=self.feedback, seed=self._seed
            )

    def _mix(self, snapshot: Tensors, payload, spec: str) -> float:
        remote = self.ctx.decode(payload, spec)
        cfg = self.ctx.gossip
        return self.ctx.trainer.mix(
            snapshot, remote, clip=cfg.clip, max_norm_ratio=cfg.max_norm_ratio
        )

    # -- initiator ------------------------------------------------------------------------------
    async def after_step(self, result: StepResult) -> None:
        if result.step % self.ctx.gossip.exchange_every == 0:
            self.start_exchange()

    def start_exchange(self, on_mixed: OnMixed | None = None) -> bool:
        """Start one exchange in the background unless one is running or nobody is live.

        Args:
            on_mixed: awaited after our model was mixed (selsync resets its reference there).

        Returns:
            Whether an exchange was started.
        """
        if self._running or not self.ctx.peers.live_peers():
            return False
        self._running = True
        self.ctx.start_soon(self._run_exchange, on_mixed)
        return True

    async def _run_exchange(self, on_mixed: OnMixed | None) -> None:
        try:
            if await self.exchange_once() and on_mixed is not None:
                await on_mixed()
        finally:
            self._running = False

    async def exchange_once(self) -> bool:
        """Pick a partner and average with it. Returns True when our model was mixed."""
        peers = self.ctx.peers
        now = self.ctx.now()
        partner = peers.choose_partner(now)
        address = partner and peers.address_of(partner)
        if partner is None or address is None:
            return False
        return await self._exchange_with(partner, address, now)

    async def _exchange_with(self, partner: str, address: str, started: float) -> bool:
        ctx = self.ctx
        spec = ctx.peers.choose_codec(partner, started)
        snapshot = await ctx.to_thread(ctx.trainer.snapshot)
        try:
            payload = await ctx.to_thread(self._encode, snapshot, spec)
        except ValueError as exc:  # e.g. our own model went NaN: nothing sensible to send
            log.warning("exchange_skipped", partner=partner[:12], reason=str(exc))
            return False
        deadline = ctx.peers.exchange_deadline(partner, len(payload), started)
        header = Exchange(algorithm=ctx.gossip.algorithm, codec=spec, step=ctx.trainer.step)
        try:
            reply, reply_payload, _ = await ctx.network.request(
                address, header, payload, deadline_s=deadline, expect_peer=partner
            )
        except TransportError as exc:
            return self._failed(partner, spec, started, f"{type(exc).__name__}: {exc}", deadline)
        if isinstance(reply, ErrorReply) and reply.code == "busy":
            ctx.peers.busy(partner, ctx.now())
            log.debug("exchange_declined", partner=partner[:12], reason=reply.reason)
            return False
        if isinstance(reply, ErrorReply):
            return self._failed(partner, spec, started, f"{reply.code}: {reply.reason}", deadline)
        if not isinstance(reply, ExchangeReply):
            reason = f"unexpected {type(reply).__name__}"
            return self._failed(partner, spec, started, reason, deadline)
        try:
            distance = await ctx.to_thread(self._mix, snapshot, reply_payload, spec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            self._rejected(partner, spec, str(exc))
            return False
        now = ctx.now()
        ctx.peers.succeeded(partner, len(payload) + len(reply_payload), now - started, now)
        self.counters.record_ok(partner, spec)
        log.debug(
            "exchange_done",
            partner=partner[:12],
            codec=spec,
            bytes=len(payload),
            seconds=round(now - started, 4),
            distance=round(distance, 5),
        )
        return True

    def _failed(
        self, partner: str, spec: str, started: float, reason: str, deadline: float
    ) -> bool:
        now = self.ctx.now()
        self.ctx.peers.failed(partner, now)
        self.counters.record_failed(partner, spec)
        log.info(
            "exchange_failed",
            partner=partner[:12],
            reason=reason,
            deadline_s=round(deadline, 3),
            waited_s=round(now - started, 3),
        )
        return False

    def _rejected(self, peer: str, spec: str, reason: str) -> None:
        self.ctx.peers.unreliable(peer, self.ctx.now())
        self.counters.record_rejected(peer, spec)
        log.warning("update_rejected", peer=peer[:12], reason=reason)

    # -- responder ------------------------------------------------------------------------------
    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, Exchange)
        ctx = self.ctx
        if header.algorithm != ctx.gossip.algorithm:
            reason = f"this node runs {ctx.gossip.algorithm}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        if self._responding >= MAX_RESPONSES:
            return ErrorReply(code="busy", reason="already averaging with others"), b""
        self._responding += 1
        try:
            data = bytes(payload)  # the view is only valid during this call; threads outlive it
            snapshot = await ctx.to_thread(ctx.trainer.snapshot)
            try:
                reply = await ctx.to_thread(self._encode, snapshot, header.codec)
            except ValueError as exc:
                log.warning("exchange_refused", peer=peer.short_id, reason=str(exc))
                return ErrorReply(code="internal", reason=f"cannot encode: {exc}"[:500]), b""
            try:
                await ctx.to_thread(self._mix, snapshot, data, header.codec)
            except (RejectedUpdate, compress.DecodeError) as exc:
                self._rejected(peer.peer_id, header.codec, str(exc))
                return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
            self.counters.record_ok(peer.peer_id, header.codec)
            return ExchangeReply(step=ctx.trainer.step), reply
        finally:
            self._responding -= 1


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="adpsgd",
        runtime=Adpsgd,
        settings=None,
        messages=(Exchange, ExchangeReply),
        summary="asynchronous pairwise averaging every exchange_every steps (default)",
    )
)
