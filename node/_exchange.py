# AD-PSGD exchanges, both sides. Invariants: training never waits for an exchange (the event loop
# runs them beside the training thread; at most one exchange is started by this node at a time, and
# at most MAX_RESPONSES are answered at once, later ones get "busy"); every exchange has a deadline
# derived from the partner's link estimate; a peer's model is decoded within a size budget and
# checked before it is mixed; heavy work (encode, decode, mix) runs in worker threads.
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import trio

import compress
from gossip._averaging import RejectedUpdate

from ._config import GossipConfig
from ._messages import ErrorReply, Header
from ._protocol import Exchange, ExchangeReply, StateReply, StateRequest
from ._trainer import Trainer
from ._transport import PeerInfo, TransportError

MAX_RESPONSES = 2
# What adpsgd may send: dense codecs only. A sparse codec of a whole model (not of a change) would
# zero most weights; sparse codecs belong to algorithms that send changes (choco, diloco).
ADPSGD_LADDER = ("none", "fp16", "int8", "int4")


def acceptable_codecs(config: GossipConfig) -> frozenset[str]:
    """Codec specs a peer may ask this node to encode with: its fixed codec or the dense ladder
    (any other spec would cost us work we never agreed to). Shared by every algorithm."""
    return frozenset({*ADPSGD_LADDER, config.codec} - {"auto"})


def decode_model(
    payload: bytes | memoryview, spec: str, max_numel: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Decode a peer's tensors made with `spec`: only that codec family, within the model's size
    budget (compress.DecodeError when bad). Shared by every algorithm."""
    pairs = compress.decode_named(
        payload,
        max_numel=max_numel,
        device=device,
        allowed=compress.codec_family(compress.get_codec(spec)),
    )
    return dict(pairs)


log = structlog.get_logger()


@dataclass
class PeerExchangeStats:
    ok: int = 0
    failed: int = 0
    rejected: int = 0
    codec: str | None = None


class ExchangeService:
    """This node's side of pairwise model averaging.

    Args:
        trainer: the local model (mixed in place).
        config: the gossip section of the node config.
        links: gossip's LinkTable (estimates read, transfers and failures recorded).
        choose_partner: `(now) -> peer ID or None`, the configured partner policy.
        choose_codec: `(peer ID, now) -> codec spec` for a link.
        address_of: peer ID -> address, from membership.
        request: the transport's request function.
        record_outcome: tells the partner policy how an exchange with a peer went.
        record_busy: tells the partner policy that a peer declined because it is busy.
    """

    def __init__(
        self,
        trainer: Trainer,
        config: GossipConfig,
        links,
        choose_partner: Callable[[float], str | None],
        choose_codec: Callable[[str, float], str],
        address_of: Callable[[str], str | None],
        request,
        record_outcome: Callable[[str, bool, float], None],
        record_busy: Callable[[str, float], None],
    ) -> None:
        self.trainer = trainer
        self.config = config
        self.links = links
        self._choose_partner = choose_partner
        self._choose_codec = choose_codec
        self._address_of = address_of
        self._request = request
        self._record_outcome = record_outcome
        self._record_busy = record_busy
        self.feedback = compress.ErrorFeedback(compress.get_codec("none"))
        self._feedback_lock = threading.Lock()
        self.numel = sum(t.numel() for t in trainer.params().values())
        self.peers: dict[str, PeerExchangeStats] = {}
        self._responding = 0
        self.ok = self.failed = self.rejected = 0
        self._seed = 0

    def feedback_state(self) -> dict[str, torch.Tensor]:
        """A copy of the error-feedback residuals (for checkpoints); thread-safe."""
        with self._feedback_lock:
            return self.feedback.state_dict()

    def stats(self, peer: str) -> PeerExchangeStats:
        return self.peers.setdefault(peer, PeerExchangeStats())

    # -- encoding (worker threads) --------------------------------------------------------------
    def _encode(self, params: dict[str, torch.Tensor], spec: str) -> bytes:
        codec = compress.get_codec(spec)
        with self._feedback_lock:
            self._seed += 1
            return compress.encode_named(
                sorted(params.items()), codec, error_feedback=self.feedback, seed=self._seed
            )

    def _decode(self, payload, spec: str) -> dict[str, torch.Tensor]:
        """Decode a peer's model, accepting only the codecs of the agreed `spec`."""
        return decode_model(payload, spec, self.numel, self.trainer.task_device)

    def _mix(self, snapshot, payload, spec: str) -> float:
        remote = self._decode(payload, spec)
        return self.trainer.mix(
            snapshot,
            remote,
            clip=self.config.clip,
            max_norm_ratio=self.config.max_norm_ratio,
        )

    # -- initiator ------------------------------------------------------------------------------
    async def exchange_once(self) -> bool:
        """Pick a partner and average with it. Returns True when models were mixed."""
        now = trio.current_time()
        partner = self._choose_partner(now)
        address = partner and self._address_of(partner)
        if partner is None or address is None:
            return False
        return await self._exchange_with(partner, address, now)

    async def _exchange_with(self, partner: str, address: str, started: float) -> bool:
        spec = self._choose_codec(partner, started)
        stats = self.stats(partner)
        stats.codec = spec
        snapshot = await trio.to_thread.run_sync(self.trainer.snapshot)
        try:
            payload = await trio.to_thread.run_sync(self._encode, snapshot, spec)
        except ValueError as exc:  # e.g. our own model went NaN: nothing sensible to send
            log.warning("exchange_skipped", partner=partner[:12], reason=str(exc))
            return False
        deadline = self.links.exchange_deadline(partner, len(payload), started)
        header = Exchange(algorithm=self.config.algorithm, codec=spec, step=self.trainer.step)
        try:
            reply, reply_payload, _ = await self._request(
                address, header, payload, deadline_s=deadline, expect_peer=partner
            )
        except TransportError as exc:
            return self._failed(partner, started, f"{type(exc).__name__}: {exc}", deadline)
        if isinstance(reply, ErrorReply):
            if reply.code == "busy":
                self._record_busy(partner, trio.current_time())
                log.debug("exchange_declined", partner=partner[:12], reason=reply.reason)
                return False
            return self._failed(partner, started, f"{reply.code}: {reply.reason}", deadline)
        if not isinstance(reply, ExchangeReply):
            return self._failed(partner, started, f"unexpected {type(reply).__name__}", deadline)
        try:
            distance = await trio.to_thread.run_sync(self._mix, snapshot, reply_payload, spec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            return self._rejected(partner, str(exc))
        elapsed = trio.current_time() - started
        now = trio.current_time()
        self.links.record_transfer(partner, len(payload) + len(reply_payload), elapsed, now)
        self._record_outcome(partner, True, now)
        self.ok += 1
        stats.ok += 1
        log.debug(
            "exchange_done",
            partner=partner[:12],
            codec=spec,
            bytes=len(payload),
            seconds=round(elapsed, 4),
            distance=round(distance, 5),
        )
        return True

    def _failed(self, partner: str, started: float, reason: str, deadline: float) -> bool:
        now = trio.current_time()
        self.links.record_failure(partner, now)
        self._record_outcome(partner, False, now)
        self.failed += 1
        self.stats(partner).failed += 1
        log.info(
            "exchange_failed",
            partner=partner[:12],
            reason=reason,
            deadline_s=round(deadline, 3),
            waited_s=round(now - started, 3),
        )
        return False

    def _rejected(self, peer: str, reason: str) -> bool:
        self._record_outcome(peer, False, trio.current_time())
        self.rejected += 1
        self.stats(peer).rejected += 1
        log.warning("update_rejected", peer=peer[:12], reason=reason)
        return False

    # -- responder ------------------------------------------------------------------------------
    async def handle_exchange(
        self, peer: PeerInfo, header: Exchange, payload: memoryview
    ) -> tuple[Header, bytes]:
        if header.algorithm != self.config.algorithm:
            reason = f"this node runs {self.config.algorithm}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        acceptable = acceptable_codecs(self.config)
        if header.codec not in acceptable:
            reason = f"codec {header.codec!r} not among {sorted(acceptable)}"
            return ErrorReply(code="bad_request", reason=reason[:500]), b""
        if self._responding >= MAX_RESPONSES:
            return ErrorReply(code="busy", reason="already averaging with others"), b""
        self._responding += 1
        try:
            data = bytes(payload)  # the view is only valid during this call; threads outlive it
            snapshot = await trio.to_thread.run_sync(self.trainer.snapshot)
            try:
                reply = await trio.to_thread.run_sync(self._encode, snapshot, header.codec)
            except ValueError as exc:
                log.warning("exchange_refused", peer=peer.short_id, reason=str(exc))
                return ErrorReply(code="internal", reason=f"cannot encode: {exc}"[:500]), b""
            try:
                await trio.to_thread.run_sync(self._mix, snapshot, data, header.codec)
            except (RejectedUpdate, compress.DecodeError) as exc:
                self._rejected(peer.peer_id, str(exc))
                return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
            self.stats(peer.peer_id).codec = header.codec
            self.stats(peer.peer_id).ok += 1
            return ExchangeReply(step=self.trainer.step), reply
        finally:
            self._responding -= 1

    # -- state sync -----------------------------------------------------------------------------
    async def handle_state_request(self, header: StateRequest) -> tuple[Header, bytes]:
        if header.algorithm != self.config.algorithm:
            reason = f"this node runs {self.config.algorithm}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        snapshot = await trio.to_thread.run_sync(self.trainer.snapshot)
        codec = compress.get_codec("none")
        payload = await trio.to_thread.run_sync(
            lambda: compress.encode_named(sorted(snapshot.items()), codec)
        )
        return StateReply(step=self.trainer.step), payload

    async def sync_state(self, peer: str, address: str, deadline_s: float) -> int | None:
        """Replace our model with `peer`'s. Returns the peer's step, or None when it failed."""
        try:
            reply, payload, _ = await self._request(
                address,
                StateRequest(algorithm=self.config.algorithm),
                b"",
                deadline_s=deadline_s,
                expect_peer=peer,
            )
            if not isinstance(reply, StateReply):
                raise TransportError(f"answered {type(reply).__name__}")
            remote = await trio.to_thread.run_sync(self._decode, payload, "none")
            await trio.to_thread.run_sync(
                lambda: self.trainer.load_params(remote, max_norm_ratio=float("inf"))
            )
        except (TransportError, RejectedUpdate, compress.DecodeError) as exc:
            log.info("state_sync_failed", peer=peer[:12], reason=str(exc))
            return None
        return reply.step
