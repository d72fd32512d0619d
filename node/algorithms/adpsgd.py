# adpsgd: asynchronous pairwise averaging (AD-PSGD), both sides, streamed in chunks. Invariants:
# training never waits for an exchange (it runs beside the training thread); a node takes part in
# at most one exchange at a time, started or answered (others are told "busy"), which bounds its
# extra memory to one model-sized mix buffer (plus half a model of error feedback for lossy
# codecs); every chunk request has a deadline from the partner's link estimate and the chunk's
# size; a peer's chunks are decoded within their size and checked, and the mix is applied only
# when the whole model arrived and passed: a rejected, timed-out or abandoned exchange leaves the
# model exactly as it was (x += w (x_peer - x_sent) keeps the local progress made meanwhile).
from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import RejectedUpdate

from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, Name, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from ._stream import CHUNKS_IN_FLIGHT, ChunkPlan, PairwiseMix

MAX_CHUNKS = 2**32
log = structlog.get_logger()


class Exchange(Header, frozen=True, tag="exchange"):
    """Start a pairwise exchange; the payload is the sender's chunk 0, encoded with `codec`.

    `plan` is the digest of the chunk plan (the model's names and shapes cut into `chunks` chunks
    of at most `chunk_numel` elements); the responder must come to the same plan. It answers
    ExchangeReply with its own chunk 0; chunks 1.. follow as ExchangeChunk requests, each answered
    with the responder's chunk of the same index. `algorithm` must match the responder's.
    """

    algorithm: Name
    codec: CodecSpec
    step: U63
    xid: U63  # the initiator's id for this exchange
    plan: U63
    chunk_numel: U63
    chunks: U63


class ExchangeReply(Header, frozen=True, tag="exchange_reply"):
    step: U63
    xid: U63


class ExchangeChunk(Header, frozen=True, tag="exchange_chunk"):
    """Chunk `index` of exchange `xid` (the sender's); answered with ExchangeChunkReply."""

    xid: U63
    index: U63


class ExchangeChunkReply(Header, frozen=True, tag="exchange_chunk_reply"):
    xid: U63
    index: U63


class ExchangeAbort(Header, frozen=True, tag="exchange_abort"):
    """The initiator gave exchange `xid` up: the responder drops it now (answered Delivered-like
    ExchangeChunkReply with index 0, or an error when there is no such exchange)."""

    xid: U63


OnMixed = Callable[[], Awaitable[None]]


@dataclass
class _Session:
    """An exchange this node answers: whose, its mix, and until when it may idle."""

    peer: str
    xid: int
    mix: PairwiseMix
    expires_at: float
    idle_s: float


class _Abort(Exception):
    """An exchange this node started cannot go on: `kind` is failed, rejected or busy."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class Adpsgd(Algorithm):
    """AD-PSGD: every `exchange_every` steps, average with one partner chosen by the policy.

    Assumes nothing about the peers' speed. Trades a slower agreement (one partner at a time)
    for never waiting: a partner that misses the link's deadline is skipped and chosen less.
    """

    handles = (Exchange, ExchangeChunk, ExchangeAbort)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        # Residuals of lossy codecs in half precision: half a model's bytes (the memory budget).
        self.feedback = compress.ErrorFeedback(compress.get_codec("none"), dtype=torch.float16)
        self._plans: dict[int, ChunkPlan] = {}
        self._session: _Session | None = None  # the exchange we answer, if any
        self._running = False  # an exchange we started runs
        self._seed = 0
        self.on_answered_mix: OnMixed | None = None  # awaited after we mixed as the responder
        self._chunk_s = 0.0  # our own seconds of tensor work per chunk (encode + decode), smoothed

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> tuple[Tensors, dict]:
        return {f"ef/{k}": v for k, v in self.feedback.state_dict().items()}, {}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        residuals: Tensors = {}
        plan = self.plan(self.ctx.chunk_numel)
        for key, tensor in tensors.items():
            if not key.startswith("ef/"):
                continue
            name = key[3:]
            if "@" in name:
                residuals[name] = tensor
                continue
            flat = tensor.reshape(-1)  # a whole tensor's residual (before chunks): cut it up
            for chunk in plan.chunks:
                for s in chunk:
                    if s.name == name and s.stop <= flat.numel():
                        residuals[s.label] = flat[s.start : s.stop].clone()
        self.feedback.load_state_dict(residuals)

    def busy(self) -> bool:
        return self._running

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (cached)."""
        plan = self._plans.get(chunk_numel)
        if plan is None:
            shapes = [(n, tuple(t.shape)) for n, t in self.ctx.trainer.params().items()]
            plan = self._plans[chunk_numel] = ChunkPlan.build(shapes, chunk_numel)
        return plan

    def _free(self) -> bool:
        """Whether this node can take part in another exchange now (one at a time)."""
        if self._session is not None and self.ctx.now() > self._session.expires_at:
            log.info("exchange_abandoned", peer=self._session.peer[:12], reason="peer went quiet")
            self.counters.record_failed(self._session.peer, self._session.mix.spec)
            self._session = None
        return self._session is None and not self._running

    def _mix(self, plan: ChunkPlan, spec: str) -> PairwiseMix:
        cfg = self.ctx.gossip
        self._seed += len(plan)
        lossless = spec == "none"
        return PairwiseMix(
            self.ctx.trainer, plan, spec, None if lossless else self.feedback, weight=0.5,
            max_norm_ratio=cfg.max_norm_ratio, clip=cfg.clip, seed=self._seed,
        )  # fmt: skip

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
        if not self._free() or not self.ctx.peers.live_peers():
            return False
        self._running = True
        self.ctx.start_soon(self._run_exchange, on_mixed)
        return True

    async def _run_exchange(self, on_mixed: OnMixed | None) -> None:
        try:
            if await self._exchange_once() and on_mixed is not None:
                await on_mixed()
        finally:
            self._running = False

    async def exchange_once(self) -> bool:
        """Pick a partner and average with it now. Returns True when our model was mixed."""
        if not self._free():
            return False
        self._running = True
        try:
            return await self._exchange_once()
        finally:
            self._running = False

    async def _exchange_once(self) -> bool:
        peers = self.ctx.peers
        now = self.ctx.now()
        partner = peers.choose_partner(now)
        address = partner and peers.address_of(partner)
        if partner is None or address is None:
            return False
        spec = peers.choose_codec(partner, now)
        mix = self._mix(self.plan(self.ctx.chunk_numel), spec)
        moved = [0]
        xid = self.ctx.rng.getrandbits(63)
        try:
            await self._stream(partner, address, mix, xid, moved)
            distance = await self.ctx.to_thread(mix.commit)
        except (_Abort, RejectedUpdate, compress.DecodeError) as exc:
            if not isinstance(exc, _Abort):
                exc = _Abort("rejected", str(exc))
            if exc.kind in ("failed", "rejected") and len(mix.plan) > 1:
                self.ctx.start_soon(self._tell_abort, partner, address, xid)
            return self._aborted(partner, spec, exc, now)
        done = self.ctx.now()
        peers.succeeded(partner, moved[0], done - now, done)
        self.counters.record_ok(partner, spec)
        log.debug("exchange_done", partner=partner[:12], codec=spec, bytes=moved[0],
                  chunks=len(mix.plan), seconds=round(done - now, 4),
                  distance=round(distance, 5))  # fmt: skip
        return True

    async def _tell_abort(self, partner: str, address: str, xid: int) -> None:
        """Best effort: let the partner drop the exchange now rather than when it idles out."""
        with contextlib.suppress(TransportError):
            await self.ctx.network.request(
                address, ExchangeAbort(xid=xid), b"", deadline_s=2.0, expect_peer=partner
            )

    def chunk_deadline(self, peer: str, nbytes: int) -> float:
        """Seconds a chunk request of `nbytes` each way may take: the link's deadline for the
        bytes of a whole window (the chunk may queue behind CHUNKS_IN_FLIGHT - 1 others), plus
        the tensor work of a window on both ends (as long as ours, measured)."""
        window = CHUNKS_IN_FLIGHT * 2 * nbytes
        compute = 2 * CHUNKS_IN_FLIGHT * self._chunk_s
        return self.ctx.peers.exchange_deadline(peer, window, self.ctx.now()) + 2 * compute

    def _timed(self, seconds: float) -> None:
        self._chunk_s = seconds if not self._chunk_s else 0.8 * self._chunk_s + 0.2 * seconds

    async def _stream(self, partner: str, address: str, mix: PairwiseMix, xid: int,
                      moved: list) -> None:  # fmt: skip
        """Send our chunks and take the partner's, CHUNKS_IN_FLIGHT at a time.

        Raises:
            _Abort: the partner declined, failed, or sent something we refuse.
        """
        ctx, plan = self.ctx, mix.plan
        opening = Exchange(
            algorithm=ctx.gossip.algorithm, codec=mix.spec, step=ctx.trainer.step, xid=xid,
            plan=plan.digest, chunk_numel=plan.chunk_numel, chunks=len(plan),
        )  # fmt: skip
        await self._chunk(partner, address, mix, 0, opening, ExchangeReply, moved)
        failure: list[_Abort] = []
        limit = trio.Semaphore(CHUNKS_IN_FLIGHT)

        async def one(index: int) -> None:
            try:
                header = ExchangeChunk(xid=xid, index=index)
                await self._chunk(partner, address, mix, index, header, ExchangeChunkReply, moved)
            except _Abort as exc:
                failure.append(exc)
                nursery.cancel_scope.cancel()
            finally:
                limit.release()

        async with trio.open_nursery() as nursery:
            for index in range(1, len(plan)):
                await limit.acquire()
                if failure:
                    break
                nursery.start_soon(one, index)
        if failure:
            raise failure[0]

    async def _chunk(self, partner, address, mix: PairwiseMix, index: int, header: Header,
                     expect: type, moved: list) -> None:  # fmt: skip
        ctx = self.ctx
        started = ctx.clock()
        try:
            payload = await ctx.to_thread(mix.send, index)
        except ValueError as exc:  # e.g. our own model went NaN: nothing sensible to send
            raise _Abort("skipped", f"cannot encode: {exc}") from None
        encoded = ctx.clock()
        deadline = self.chunk_deadline(partner, len(payload))
        try:
            reply, data, _ = await ctx.network.request(
                address, header, payload, deadline_s=deadline, expect_peer=partner
            )
        except TransportError as exc:
            raise _Abort("failed", f"chunk {index}: {type(exc).__name__}: {exc}") from None
        if isinstance(reply, ErrorReply):
            kind = "busy" if reply.code == "busy" else "failed"
            raise _Abort(kind, f"chunk {index}: {reply.code}: {reply.reason}")
        if not isinstance(reply, expect) or getattr(reply, "xid", None) != header.xid:
            raise _Abort("failed", f"chunk {index}: unexpected {type(reply).__name__}")
        moved[0] += len(payload) + len(data)
        received = ctx.clock()
        try:
            await ctx.to_thread(mix.receive, index, data)
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            raise _Abort("rejected", str(exc)) from None
        self._timed((encoded - started) + (ctx.clock() - received))

    def _aborted(self, partner: str, spec: str, exc: _Abort, started: float) -> bool:
        now = self.ctx.now()
        if exc.kind == "busy":
            self.ctx.peers.busy(partner, now)
            log.debug("exchange_declined", partner=partner[:12], reason=str(exc))
        elif exc.kind == "rejected":
            self.ctx.peers.unreliable(partner, now)
            self.counters.record_rejected(partner, spec)
            log.warning("update_rejected", peer=partner[:12], reason=str(exc))
        elif exc.kind == "skipped":
            log.warning("exchange_skipped", partner=partner[:12], reason=str(exc))
        else:
            self.ctx.peers.failed(partner, now)
            self.counters.record_failed(partner, spec)
            log.info("exchange_failed", partner=partner[:12], reason=str(exc),
                     waited_s=round(now - started, 3))  # fmt: skip
        return False

    # -- responder ------------------------------------------------------------------------------
    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        if isinstance(header, Exchange):
            refusal = self._refuse_opening(peer, header)
            if refusal is not None:
                return refusal
            plan = self.plan(header.chunk_numel)
            idle = 2 * self.chunk_deadline(peer.peer_id, 4 * plan.chunk_numel + 2**16)
            mix = self._mix(plan, header.codec)
            self._session = _Session(peer.peer_id, header.xid, mix, self.ctx.now() + idle, idle)
            return await self._answer(self._session, 0, payload, ExchangeReply(
                step=self.ctx.trainer.step, xid=header.xid))  # fmt: skip
        if isinstance(header, ExchangeAbort):
            session = self._session
            if session is None or session.peer != peer.peer_id or session.xid != header.xid:
                return ErrorReply(code="bad_request", reason=f"no exchange {header.xid}"), b""
            self._end(session)
            self.counters.record_failed(session.peer, session.mix.spec)
            log.info("exchange_abandoned", peer=session.peer[:12], reason="the initiator gave up")
            return ExchangeChunkReply(xid=header.xid, index=0), b""
        assert isinstance(header, ExchangeChunk)
        session = self._session
        if session is None or session.peer != peer.peer_id or session.xid != header.xid:
            reason = f"no exchange {header.xid} open with you (ended, or never started)"
            return ErrorReply(code="bad_request", reason=reason), b""
        reply = ExchangeChunkReply(xid=header.xid, index=header.index)
        return await self._answer(session, header.index, payload, reply)

    def _refuse_opening(self, peer: PeerInfo, header: Exchange) -> Reply | None:
        ctx = self.ctx
        if header.algorithm != ctx.gossip.algorithm:
            reason = f"this node runs {ctx.gossip.algorithm}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        if not 1 <= header.chunk_numel <= ctx.max_chunk_numel or header.chunks > MAX_CHUNKS:
            reason = f"chunks of {header.chunk_numel} elements: expected 1..{ctx.max_chunk_numel}"
            return ErrorReply(code="bad_request", reason=reason), b""
        plan = self.plan(header.chunk_numel)
        if header.plan != plan.digest or header.chunks != len(plan):
            reason = "models differ: other parameter names or shapes (or a wrong chunk count)"
            return ErrorReply(code="bad_request", reason=reason), b""
        if not self._free():
            return ErrorReply(code="busy", reason="already in an exchange"), b""
        return None

    async def _answer(
        self, session: _Session, index: int, data: memoryview, reply: Header
    ) -> Reply:
        # `data` is the transport's buffer, valid until we return: the worker threads that read
        # it are awaited here (a cancelled wait still waits for its thread), so no copy is made.
        ctx, mix = self.ctx, session.mix
        session.expires_at = ctx.now() + session.idle_s
        try:
            started = ctx.clock()
            ours = await ctx.to_thread(mix.send, index)
            completed = await ctx.to_thread(mix.receive, index, data)
            self._timed(ctx.clock() - started)
            distance = await ctx.to_thread(mix.commit) if completed else None
        except (RejectedUpdate, compress.DecodeError) as exc:
            self._end(session)
            self.counters.record_rejected(session.peer, mix.spec)
            log.warning("update_rejected", peer=session.peer[:12], reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        except ValueError as exc:  # a chunk out of the plan, twice, or our model is not finite
            self._end(session)
            self.counters.record_failed(session.peer, mix.spec)
            log.warning("exchange_refused", peer=session.peer[:12], reason=str(exc))
            return ErrorReply(code="bad_request", reason=str(exc)[:500]), b""
        if distance is not None:
            self._end(session)
            self.counters.record_ok(session.peer, mix.spec)
            if self.on_answered_mix is not None:
                await self.on_answered_mix()
        return reply, ours

    def _end(self, session: _Session) -> None:
        if self._session is session:
            self._session = None


def adpsgd_copies(codec: str) -> float:
    """Model copies adpsgd keeps beyond a plain loop: the mix buffer of the one exchange it takes
    part in (1), and half-precision error feedback when a lossy codec may be used (0.5)."""
    return 1.0 if codec == "none" else 1.5


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="adpsgd",
        runtime=Adpsgd,
        settings=None,
        messages=(Exchange, ExchangeReply, ExchangeChunk, ExchangeChunkReply, ExchangeAbort),
        summary="asynchronous pairwise averaging every exchange_every steps (default)",
        memory=lambda g: adpsgd_copies(g.codec),
    )
)
