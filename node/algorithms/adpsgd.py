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
from dataclasses import dataclass, field

import structlog
import torch

from geotrain import compress
from geotrain.gossip import ExchangePacer, RejectedUpdate

from .._log_quota import log_within_quota
from ..training import LoopClosed, StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, Name, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from ._stream import (
    CHUNKS_IN_FLIGHT,
    MAX_CHUNKS,
    PEER_CHUNK_HINT,
    ChunkPlan,
    ChunkTimer,
    PairwiseMix,
    SliceFeedback,
    SpareBuffers,
    cached_plan,
    in_window,
    models_differ,
)

SMALL_EXCHANGES_BYTES = 64 * 2**20  # mix buffers of concurrent exchanges a small model may hold
# A peer that left an exchange it opened unfinished (it went quiet until the deadline, or opened
# another over it) is told "busy" for its idle deadline, doubled for each more in a row (up to
# this), until one of its exchanges completes: three identities re-opening every second held a
# node's three exchange slots for as long as they went on (each opening reset the deadlines).
HOLD_OFF_MAX_S = 60.0
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


@dataclass(frozen=True)
class PacingStatistics:
    # steps between two exchanges this node starts now (gossip.comm_fraction adapts it)
    exchange_interval: int = field(metadata={"gauge": True})


def make_pacer(ctx: AlgorithmContext) -> ExchangePacer:
    """The cadence of the exchanges a node starts, from its [gossip] settings."""
    g = ctx.gossip
    return ExchangePacer(g.exchange_every, g.comm_fraction, g.max_exchange_every)


def paced(pacer: ExchangePacer, seconds: float) -> None:
    """An exchange we started took `seconds`: the pacer sets the next interval (logged when its
    moving average moved by more than a quarter)."""
    pacer.finished(seconds)
    if pacer.moved():
        log.info("exchange_interval", typical_steps=round(pacer.typical, 1), steps=pacer.interval,
                 exchange_s=round(seconds, 3), step_s=round(pacer.step_s or 0.0, 4))  # fmt: skip


@dataclass
class _Session:
    """An exchange this node answers: whose, its mix, until when it may idle, and until when it
    may last at all (a peer that trickles chunks cannot hold our one exchange slot for ever)."""

    peer: str
    xid: int
    mix: PairwiseMix
    expires_at: float
    idle_s: float
    ends_at: float
    committing: bool = False


@dataclass
class _HoldOff:
    """A peer's exchanges left unfinished in a row, and until when its openings are declined."""

    strikes: int = 0
    until: float = 0.0


class _Abort(Exception):
    """An exchange this node started cannot go on: `kind` is failed, rejected or busy."""

    def __init__(self, kind: str, reason: str, cause: BaseException | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.cause = cause  # for a rejection: the check that failed (its reason is counted)


class Adpsgd(Algorithm):
    """AD-PSGD: every `exchange_every` steps, average with one partner chosen by the policy.

    Assumes nothing about the peers' speed. Trades a slower agreement (one partner at a time)
    for never waiting: a partner that misses the link's deadline is skipped and chosen less.
    """

    handles = (Exchange, ExchangeChunk, ExchangeAbort)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        # Residuals of lossy codecs in half precision: half a model's bytes (the memory budget).
        self.feedback = SliceFeedback(torch.float16)  # half a model, lossy codecs only
        # only where the memory estimate counts it: a node set to codec none (or a sparse one)
        # answers a peer's exchange in int8 without (adpsgd_copies)
        own = ctx.gossip.codec
        self._feedback_counted = own == "auto" or keeps_feedback(own)
        self._plans: dict[int, ChunkPlan] = {}
        self._sessions: dict[str, _Session] = {}  # the exchanges we answer, by peer
        self._held_off: dict[str, _HoldOff] = {}  # peers that left exchanges unfinished
        model_bytes = 4 * ctx.peers.numel
        # One exchange at a time keeps a big model's memory to one mix buffer; a small model
        # affords three at once (one started, two answered), which keeps a busy swarm mixing
        # instead of declining: nodes that all start exchanges would otherwise mostly collide.
        self.max_exchanges = 3 if 3 * model_bytes <= SMALL_EXCHANGES_BYTES else 1
        self._running = False  # an exchange we started runs
        self._running_with: str | None = None  # ... with this partner
        self._seed = 0
        self.on_answered_mix: OnMixed | None = None  # awaited after we mixed as the responder
        self.chunk_timer = ChunkTimer()  # our own tensor work per chunk: chunk deadlines
        # A small model keeps its last mix buffer for the next exchange (no page faults on the
        # training core); a big one gives it back, so that it is held only during an exchange:
        # kept, it would raise a 100M-parameter node's peak by ~0.2 model copies (bench.memory).
        self._spare = SpareBuffers() if self.max_exchanges > 1 else None
        self.pacer = make_pacer(ctx)

    def statistics(self) -> PacingStatistics:
        return PacingStatistics(self.pacer.interval)

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> tuple[Tensors, dict]:
        return {f"ef/{k}": v for k, v in self.feedback.state_dict().items()}, {}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        # one residual per tensor, named as the model's (any chunk size uses them)
        shapes = {n: tuple(t.shape) for n, t in self.ctx.trainer.params().items()}
        residuals = {k[3:]: t for k, t in tensors.items()
                     if k.startswith("ef/") and shapes.get(k[3:]) == tuple(t.shape)}  # fmt: skip
        self.feedback.load_state_dict(
            {n: t.to(self.ctx.trainer.task_device) for n, t in residuals.items()}
        )

    def model_replaced(self) -> None:
        # an exchange answered for the old model must not be mixed into the new one
        self._sessions.clear()
        self.feedback.reset()

    def busy(self) -> bool:
        return self._running

    def _in_flight(self) -> bool:
        # (quiet: openings are told "busy" and after_step starts none meanwhile; _free drops a
        # session its peer left to idle out: nothing else would, now)
        if self._sessions:
            self._free()
        return self._running or bool(self._sessions)

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (a few cached).

        Raises:
            ValueError: it would have more than MAX_CHUNKS chunks.
        """
        return cached_plan(self._plans, self.ctx.trainer, chunk_numel)

    def _free(self) -> bool:
        """Whether this node can take part in another exchange now (max_exchanges at a time)."""
        now = self.ctx.now()
        for session in list(self._sessions.values()):
            if not session.committing and (now > session.expires_at or now > session.ends_at):
                late = "peer went quiet" if now > session.expires_at else "exchange took too long"
                log.info("exchange_abandoned", peer=session.peer[:12], reason=late)
                self.counters.record_failed(session.peer, session.mix.spec)
                self._end(session)
                self._hold_off(session, min(session.expires_at, session.ends_at))
        return len(self._sessions) + self._running < self.max_exchanges

    def peer_disconnected(self, peer_id: str) -> None:
        """An exchange `peer_id` was driving ends now, not when it idles out: its requests
        cannot come any more (a new connection starts with a new opening)."""
        session = self._sessions.get(peer_id)
        if session is not None and not session.committing:
            log.info("exchange_abandoned", peer=peer_id[:12], reason="connection lost")
            self.counters.record_failed(peer_id, session.mix.spec)
            self._end(session)

    def _session(self, peer: str, xid: int) -> _Session | None:
        session = self._sessions.get(peer)
        return session if session is not None and session.xid == xid else None

    def _mix(self, plan: ChunkPlan, spec: str) -> PairwiseMix:
        cfg = self.ctx.gossip
        self._seed += len(plan)
        return PairwiseMix(
            self.ctx.trainer, plan, spec,
            self.feedback if self._feedback_counted and keeps_feedback(spec) else None,
            weight=0.5,
            max_norm_ratio=cfg.max_norm_ratio, clip=cfg.clip, seed=self._seed,
            radius=self.ctx.robust, spare=self._spare,
        )  # fmt: skip

    # -- initiator ------------------------------------------------------------------------------
    async def after_step(self, result: StepResult) -> None:
        self.pacer.observe_step(result.seconds)
        if self.pacer.due(result.step):
            self.start_exchange(result.step)

    def start_exchange(self, step: int, on_mixed: OnMixed | None = None) -> bool:
        """Start one exchange in the background unless one is running or nobody is live.

        Args:
            step: the local step it follows (the pacer counts from it).
            on_mixed: awaited after our model was mixed (selsync resets its reference there).

        Returns:
            Whether an exchange was started.
        """
        if (self._running or self._quiet or not self._free()
                or not self.ctx.peers.dialable_peers()):  # fmt: skip
            return False
        self._running = True
        self.pacer.mark(step)
        self.ctx.start_soon(self._run_exchange, on_mixed)
        return True

    async def _run_exchange(self, on_mixed: OnMixed | None) -> None:
        try:
            if await self._exchange_once() and on_mixed is not None:
                await on_mixed()
        except LoopClosed:  # the user's loop ended while our mix waited for its next step
            log.debug("exchange_dropped", reason="the training loop was closed")
        except Exception as exc:  # a bug must cost this exchange, not the node
            log.error("exchange_crashed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
        finally:
            self._running = False

    async def exchange_once(self) -> bool:
        """Pick a partner and average with it now. Returns True when our model was mixed."""
        if self._running or not self._free():
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
        if partner in self._sessions:  # we answer its exchange: one at a time per pair
            return False
        self._running_with = partner
        try:
            return await self._exchange_with(partner, address, now)
        finally:
            self._running_with = None

    async def _exchange_with(self, partner: str, address: str, now: float) -> bool:
        peers = self.ctx.peers
        spec = peers.choose_codec(partner, now)
        mix = self._mix(self.plan(self.ctx.chunk_numel), spec)
        moved = [0]
        xid = self.ctx.rng.getrandbits(63)
        try:
            await self._stream(partner, address, mix, xid, moved)
            distance = await self.ctx.to_thread(mix.commit)
        except (_Abort, RejectedUpdate, compress.DecodeError) as exc:
            if not isinstance(exc, _Abort):
                exc = _Abort("rejected", str(exc), exc)
            if exc.kind in ("failed", "rejected") and len(mix.plan) > 1:
                self.ctx.start_soon(self._tell_abort, partner, address, xid)
            return self._aborted(partner, spec, exc, now)
        done = self.ctx.now()
        peers.succeeded(partner, moved[0], done - now, done)
        paced(self.pacer, done - now)
        self.counters.record_ok(partner, spec, done - now)
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

    def chunk_deadline(self, peer: str, nbytes: int, chunks: int | None = None) -> float:
        """Seconds a chunk request of `nbytes` each way, of a stream of `chunks`, may take (see
        ChunkTimer)."""
        return self.chunk_timer.deadline(self.ctx.peers, peer, nbytes, self.ctx.now(), chunks)

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

        async def one(index: int) -> None:
            header = ExchangeChunk(xid=xid, index=index)
            await self._chunk(partner, address, mix, index, header, ExchangeChunkReply, moved)

        width = self.chunk_timer.width(ctx.peers, partner, 4 * plan.chunk_numel, ctx.now(),
                                       len(plan))  # fmt: skip
        await in_window(range(1, len(plan)), one, catch=_Abort, width=width)

    async def _chunk(self, partner, address, mix: PairwiseMix, index: int, header: Header,
                     expect: type, moved: list) -> None:  # fmt: skip
        ctx = self.ctx
        try:
            async with ctx.coding:  # (a wait for a slot is not our tensor work: not timed)
                started = ctx.clock()
                payload = await ctx.to_thread(mix.send, index)
                encoded = ctx.clock()
        except ValueError as exc:  # e.g. our own model went NaN: nothing sensible to send
            raise _Abort("skipped", f"cannot encode: {exc}") from None
        if not self.chunk_timer.seconds:  # (the first chunks: our encoding is all we know yet)
            self.chunk_timer.observe(encoded - started)
        deadline = self.chunk_deadline(partner, len(payload), len(mix.plan))
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
        try:
            async with ctx.coding:
                received = ctx.clock()
                await ctx.to_thread(mix.receive, index, data)
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            raise _Abort("rejected", str(exc), exc) from None
        self.chunk_timer.observe((encoded - started) + (ctx.clock() - received))

    def _aborted(self, partner: str, spec: str, exc: _Abort, started: float) -> bool:
        now = self.ctx.now()
        if exc.kind in ("failed", "rejected"):  # (the link's time went into it)
            paced(self.pacer, now - started)
        if exc.kind == "busy":
            self.ctx.peers.busy(partner, now)
            log.debug("exchange_declined", partner=partner[:12], reason=str(exc))
        elif exc.kind == "rejected":
            self.ctx.peers.unreliable(partner, now)
            self.counters.record_rejected(partner, spec, exc.cause)
            log_within_quota("update_rejected", peer=partner[:12], reason=str(exc))
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
            idle = 2 * self.chunk_deadline(peer.peer_id, 4 * plan.chunk_numel + 2**16,
                                       len(plan))
            rounds = -(-len(plan) // CHUNKS_IN_FLIGHT)
            now = self.ctx.now()
            mix = self._mix(plan, header.codec)
            session = self._sessions[peer.peer_id] = _Session(
                peer.peer_id, header.xid, mix, now + idle, idle, now + idle * (rounds + 1)
            )
            return await self._answer(session, 0, payload, ExchangeReply(
                step=self.ctx.trainer.step, xid=header.xid))  # fmt: skip
        if isinstance(header, ExchangeAbort):
            session = self._session(peer.peer_id, header.xid)
            if session is None:
                return ErrorReply(code="bad_request", reason=f"no exchange {header.xid}"), b""
            if not session.committing:  # (a mix already being applied is finished)
                self._end(session)
                self.counters.record_failed(session.peer, session.mix.spec)
                log.info("exchange_abandoned", peer=session.peer[:12], reason="initiator gave up")
            return ExchangeChunkReply(xid=header.xid, index=0), b""
        assert isinstance(header, ExchangeChunk)
        session = self._session(peer.peer_id, header.xid)
        if session is None:
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
            reason = (f"chunks of {header.chunk_numel} elements: expected "
                      f"1..{ctx.max_chunk_numel} ({PEER_CHUNK_HINT})")
            return ErrorReply(code="bad_request", reason=reason), b""
        try:
            plan = self.plan(header.chunk_numel)
        except ValueError as exc:  # cut too finely: MAX_CHUNKS
            return ErrorReply(code="bad_request", reason=str(exc)[:500]), b""
        if header.plan != plan.digest or header.chunks != len(plan):
            return ErrorReply(code="bad_request", reason=models_differ(ctx.trainer)), b""
        old = self._sessions.get(peer.peer_id)
        now = ctx.now()
        if old is not None and not old.committing:  # the peer started anew: its old one is over
            self.counters.record_failed(old.peer, old.mix.spec)
            self._end(old)
            self._hold_off(old, now)
        held = self._held_off.get(peer.peer_id)
        if held is not None and now < held.until:
            reason = (f"your last {held.strikes} exchange(s) with this node were left unfinished: "
                      f"try again in {held.until - now:.0f} s")  # fmt: skip
            return ErrorReply(code="busy", reason=reason), b""
        if self._quiet:
            return ErrorReply(code="busy", reason="writing a checkpoint"), b""
        if peer.peer_id in self._sessions:
            return ErrorReply(code="busy", reason="already in an exchange with you"), b""
        # Two exchanges of one pair at once (each started its own) would each move both models
        # by half the difference: a swap, not an average. The node of the smaller id keeps its
        # own and declines; the other answers, and its own is declined.
        if self._running_with == peer.peer_id and ctx.peers.selector.self_id < peer.peer_id:
            return ErrorReply(code="busy", reason="our own exchange with you runs"), b""
        if not self._free():
            reason = (f"already in {self.max_exchanges} exchange(s), the most it runs at once "
                      "for a model of this size")  # fmt: skip
            return ErrorReply(code="busy", reason=reason), b""
        return None

    def _hold_off(self, session: _Session, since: float) -> None:
        """`session`'s peer left it unfinished at `since` (it opened another, or a deadline
        passed): decline its openings for a while (_HoldOff)."""
        now = self.ctx.now()
        if len(self._held_off) >= 4096:  # (identities are cheap in an open swarm)
            self._held_off = {p: h for p, h in self._held_off.items() if h.until > now}
        held = self._held_off.setdefault(session.peer, _HoldOff())
        if now - held.until > HOLD_OFF_MAX_S:  # (long since its last: a fresh start)
            held.strikes = 0
        held.strikes += 1
        held.until = since + min(HOLD_OFF_MAX_S,
                                 max(1.0, session.idle_s) * 2 ** (held.strikes - 1))  # fmt: skip
        (log.warning if held.strikes == 3 else log.debug)(
            "exchange_peer_held_off", peer=session.peer[:12], unfinished=held.strikes,
            seconds=round(max(0.0, held.until - now), 1),
            reason="it left its exchanges unfinished (went quiet, or opened another)")  # fmt: skip

    async def _answer(
        self, session: _Session, index: int, data: memoryview, reply: Header
    ) -> Reply:
        # `data` is the transport's buffer, valid until we return: the worker threads that read
        # it are awaited here (a cancelled wait still waits for its thread), so no copy is made.
        ctx, mix = self.ctx, session.mix
        session.expires_at = ctx.now() + session.idle_s
        try:
            async with ctx.coding:
                started = ctx.clock()
                ours = await ctx.to_thread(mix.send, index)
                completed = await ctx.to_thread(mix.receive, index, data)
            self.chunk_timer.observe(ctx.clock() - started)
        except (RejectedUpdate, compress.DecodeError) as exc:
            self._end(session)
            self.counters.record_rejected(session.peer, mix.spec, exc)
            log_within_quota("update_rejected", peer=session.peer[:12], reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        except ValueError as exc:  # a chunk out of the plan, twice, or our model is not finite
            self._end(session)
            self.counters.record_failed(session.peer, mix.spec)
            log_within_quota("exchange_refused", peer=session.peer[:12], reason=str(exc))
            return ErrorReply(code="bad_request", reason=str(exc)[:500]), b""
        if completed:  # the reply goes now; the mix (a wait for the model lock) right after it
            session.committing = True
            try:
                ctx.start_soon(self._commit, session)
            except RuntimeError:  # the node is stopping (its nursery takes no new task): the
                self._end(session)  # peer gets no last reply, so neither side mixes
                return ErrorReply(code="busy", reason="this node is stopping"), b""
        return reply, ours

    async def _commit(self, session: _Session) -> None:
        """Apply a completed exchange we answered (its last reply is already on its way)."""
        try:
            await self.ctx.to_thread(session.mix.commit)
        except (RejectedUpdate, ValueError) as exc:
            self.counters.record_rejected(session.peer, session.mix.spec, exc)
            log_within_quota("update_rejected", peer=session.peer[:12], reason=str(exc))
            return
        except LoopClosed:  # the user's loop ended before our mix could join it
            return
        finally:
            self._end(session)
        self.counters.record_ok(session.peer, session.mix.spec)
        self._held_off.pop(session.peer, None)  # (it finishes what it starts: a clean slate)
        if self.on_answered_mix is not None:
            await self.on_answered_mix()

    def _end(self, session: _Session) -> None:
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]


def keeps_feedback(spec: str) -> bool:
    """Whether whole models sent with `spec` take error feedback: lossy codecs that carry every
    value (int8, sign, ...) do; none needs none, and a sparse one (top-k, random-k) takes none
    because a model is not an increment: the residual of what a send left out is the model's
    own value, which the next send would add again: with it, training diverges
    (`python -m geotrain.node.bench.codecs`)."""
    return spec != "none" and not compress.get_codec(spec).sparse


def adpsgd_copies(codec: str) -> float:
    """Model copies adpsgd keeps beyond a plain loop: the mix buffer of the one exchange it takes
    part in (1), and half-precision error feedback when a lossy codec may be used (0.5). A big
    model's exchanges in a fine codec take a bfloat16 buffer (half a copy: mixes_in_half), but a
    peer may open one in another codec (none, int4) while the residuals are held: 1.5 then."""
    return 1.0 if codec != "auto" and not keeps_feedback(codec) else 1.5


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="adpsgd",
        runtime=Adpsgd,
        settings=None,
        messages=(Exchange, ExchangeReply, ExchangeChunk, ExchangeChunkReply, ExchangeAbort),
        summary="asynchronous pairwise averaging every exchange_every steps (default)",
        memory=lambda g, numel: adpsgd_copies(g.codec),
        averages_models=True,
    )
)
