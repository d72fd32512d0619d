# choco: CHOCO-SGD over pairwise exchanges, streamed in chunks. Invariants: the per-link estimates
# and counts are gossip's ChocoLinks (sans-I/O); both ends apply exactly the decoded q that went
# over the wire; estimates start at the swarm's common initial model (same training.seed; its
# digest travels in every request), or at zero on a link whose two ends started from different
# models (both ends agree through ChocoResync); a link is used by one exchange at a time (a
# second one gets "busy"); q is made, sent and added to the estimates a chunk at a time (no
# whole-model difference or payload is ever held), and the consensus step is taken once every
# chunk is in; an exchange left unfinished on either end (or counts that differ) restarts that
# link on both ends: the responder answers ChocoResync.
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import ChocoLink, ChocoLinks, RejectedUpdate, check_norm_ratio, params_norm

from .._config import GossipConfig, check_field, check_types
from .._log_quota import log_within_quota
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from ._stream import (
    ChunkPlan,
    ChunkTimer,
    cached_plan,
    decode_chunk,
    encode_chunk,
    in_window,
    plan_refusal,
)
from .adpsgd import make_pacer, paced

log = structlog.get_logger()
STALE_STREAM_S = 120.0  # a neighbour's exchange silent this long is given up (the link restarts)


class ChocoExchange(Header, frozen=True, tag="choco_exchange"):
    """The payload is chunk `index` of q = C(x - x_hat) for the sender's estimate kept for this
    link, of exchange `xid`, cut by the plan with digest `plan` (`chunks` chunks of at most
    `chunk_numel` elements); answered with the same chunk of the responder's q.

    `seq` counts the exchanges completed on this link as the sender saw them; a responder whose
    count differs, or that holds another exchange of this link unfinished, answers ChocoResync
    and both ends restart the link's estimates at its start: the initial model, which both hold
    when `base` is the responder's digest too (same training.seed), else zero.
    """

    codec: CodecSpec
    seq: U63
    base: U63  # digest of the model the link's estimates start from; 0: they start at zero
    xid: U63 = 0
    plan: U63 = 0
    chunk_numel: U63 = 1
    chunks: U63 = 1
    index: U63 = 0


class ChocoReply(Header, frozen=True, tag="choco_reply"):
    seq: U63


class ChocoResync(Header, frozen=True, tag="choco_resync"):
    """The link's counts or starts differed (`seq` is the responder's); it restarted the link:
    so must we, at zero when `zero` (the two ends' initial models differ)."""

    seq: U63
    zero: bool = False


@dataclass(frozen=True)
class ChocoSettings:
    """[gossip.choco]

    gamma: the consensus step size (0 < gamma <= 1); smaller is safer for harsher compression
        (topk:0.01, digits-mlp, 4 peers: 0.03-0.1 agree best, 1.0 diverges).
    max_peers: neighbours whose estimates are kept (least recently used dropped first); each
        costs two model copies, so a node lowers it to what fits limits.memory_gb (or the
        machine's memory when that is unset) and says so.
    """

    gamma: float = 0.05
    max_peers: int = 16

    def __post_init__(self) -> None:
        check_types(self, "gossip.choco")
        check_field(0 < self.gamma <= 1, "gossip.choco.gamma", self.gamma, "0 < gamma <= 1")
        check_field(self.max_peers >= 1, "gossip.choco.max_peers", self.max_peers, ">= 1")


@dataclass(frozen=True)
class ChocoStatistics:
    resyncs: int
    tracked_peers: int = field(metadata={"gauge": True})  # a level, not a count (metrics: a gauge)
    # steps between two exchanges this node starts now (gossip.comm_fraction adapts it)
    exchange_interval: int = field(default=0, metadata={"gauge": True})


INITIAL_MODELS_DIFFER = (
    "initial models differ: the estimates of links to such peers start at zero, CHOCO's own "
    "start, and their first exchanges move the models less (with top-k, far less) than from a "
    "common start; give every node the same weights (a task: the same training.seed; a model "
    "of your own: torch.manual_seed(the same seed) before building it)"
)


def model_digest(params: Tensors) -> int:
    """A 63-bit digest of the parameters' names and bytes."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        flat = params[name].detach().cpu().reshape(-1).contiguous()  # 1-D: a 0-dim one too
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


class Choco(Algorithm):
    """CHOCO-SGD over pairwise exchanges, every `exchange_every` steps with one partner.

    Per link, both ends hold x_hat (ours) and x_hat_j (the peer's); an exchange sends
    q = C(x - x_hat) each way, both ends add the decoded q's to their copies and mix
    x += gamma / 2 * (x_hat_j - x_hat).

    Assumes: a codec that is a contraction (top-k, quantizers). Nodes that start from the same
    model (same training.seed; checked by digest) start their links' estimates there; a link
    between nodes whose initial models differ starts them at zero (slower at first). Trades:
    two model copies per tracked neighbour (at most `max_peers`) and a gamma-limited agreement
    speed for sending only what the codec keeps (topk:0.01 sends ~1% of the values); a lost
    exchange restarts that link.
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
        self._plans: dict[int, ChunkPlan] = {}
        self.pacer = make_pacer(ctx)
        self.chunk_timer = ChunkTimer()  # our own tensor work per chunk: chunk deadlines
        self._said_base = False  # the warning that a peer's initial model differs: said once

    def statistics(self) -> ChocoStatistics:
        return ChocoStatistics(self.resyncs, len(self.links), self.pacer.interval)

    def busy(self) -> bool:
        return self._running

    def _in_flight(self) -> bool:
        # Every chunk reads the live model (x - x_hat), and a checkpoint leaves out a link an
        # exchange is half-way through (its count and estimates: a restart resyncs that link
        # from its start): the checkpoint's quiet waits for ours, and for a neighbour's unless
        # it went silent for STALE_STREAM_S (its initiator restarts the link when it comes back)
        return self._running or any(link.stream is not None and not self._silent(link)
                                    for link in self.links.values())  # fmt: skip

    def _silent(self, link: ChocoLink) -> bool:
        """Whether the neighbour's stream on `link` sent no chunk for STALE_STREAM_S."""
        return self.ctx.now() - link.seen > STALE_STREAM_S

    def state(self) -> tuple[Tensors, dict]:
        # (no copies: a checkpoint is written apart from every change of the estimates: _add,
        # _finish and _restart hold the trainer's lock for changes)
        tensors, seqs = self.links.state_dict(copy=False)
        return tensors, {"seq": seqs, "zero": self.links.zero_peers()}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        seqs = {str(p): int(s) for p, s in dict(meta.get("seq", {})).items()}
        zero = [str(p) for p in meta.get("zero", [])]
        self.links.load_state_dict(tensors, seqs, self.ctx.trainer.task_device, zero)

    def _start_of(self, link: ChocoLink) -> int:
        """The `base` an exchange on `link` carries: our initial model's digest, or 0 (zero)."""
        return 0 if link.zero else self.base_digest

    def _link(self, peer: str) -> ChocoLink:
        return self.links.link(peer, self.ctx.peers.live_peers())

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (a few cached)."""
        return cached_plan(self._plans, self.ctx.trainer, chunk_numel)

    def peer_disconnected(self, peer_id: str) -> None:
        """An exchange `peer_id` was running with us will not be finished: restart the link."""
        link = self.links[peer_id] if peer_id in self.links else None
        if link is not None and link.stream is not None:  # (in a worker: it clones the model)
            try:
                self.ctx.start_soon(self.ctx.to_thread, self._restart, link, peer_id,
                                    "connection lost during its exchange")  # fmt: skip
            except RuntimeError:  # the node is stopping: its checkpoint skips the busy link
                pass

    def _restart(self, link: ChocoLink, peer: str, why: str, *, zero: bool | None = None,
                 **fields) -> None:  # fmt: skip
        """Both estimates back to the link's start (the initial model, or zero: `zero` changes
        which), count 0 (a worker thread: it makes two model copies; under the trainer's lock,
        see `_add`)."""

        def reset(_) -> None:
            if zero is not None:
                link.zero = zero
            link.reset(self.links.base)

        self.ctx.trainer.update(reset)
        link.busy = False
        self.resyncs += 1
        log.info("choco_resync", peer=peer[:12], reason=why, zero=link.zero, **fields)

    # -- the tensor work (worker threads) -------------------------------------------------------
    def _our_chunk(self, link: ChocoLink, plan: ChunkPlan, index: int, spec: str,
                   seed: int) -> tuple[bytes, list[tuple[str, int, torch.Tensor]]]:  # fmt: skip
        """Chunk `index` of q = C(x - x_hat) as bytes, and decoded exactly as the peer will see
        it: (name, first flat index, values) per slice."""
        slices = plan.chunks[index]

        def differences(live: Tensors) -> list:
            mine = link.mine
            return [(s, live[s.name].reshape(-1)[s.start : s.stop]
                     - mine[s.name].reshape(-1)[s.start : s.stop]) for s in slices]  # fmt: skip

        payload = encode_chunk(self.ctx.trainer.read(differences), spec, seed=seed)
        # (our own: decoded without the checks a peer's gets, as the peer decodes it; a peer
        # refuses it when it is not finite)
        pairs = compress.decode_named(payload, max_numel=plan.chunk_numel_of(index),
                                      device=self.ctx.trainer.task_device)  # fmt: skip
        return payload, [(s.name, s.start, t.reshape(-1).float())
                         for s, (_, t) in zip(slices, pairs, strict=True)]  # fmt: skip

    def _their_chunk(self, plan: ChunkPlan, index: int, spec: str,
                     payload: bytes | bytearray | memoryview) -> list:  # fmt: skip
        """A peer's chunk of its q: the plan's slices, finite, and a difference, not a model:
        its norm at most max_norm_ratio x our model's slices' + 1.

        Raises:
            RejectedUpdate, compress.DecodeError: we must not use it.
        """
        slices = plan.chunks[index]
        values = decode_chunk(payload, spec, plan, index, self.ctx.trainer.task_device)
        norm = params_norm({s.label: v for s, v in zip(slices, values, strict=True)})
        ours = self.ctx.trainer.read(lambda live: params_norm(
            {s.label: live[s.name].reshape(-1)[s.start : s.stop] for s in slices}))
        check_norm_ratio(norm, ours, max_norm_ratio=self.ctx.gossip.max_norm_ratio,
                         what=f"model difference (chunk {index})",
                         against=f"our model's chunk {index}")
        return [(s.name, s.start, v) for s, v in zip(slices, values, strict=True)]

    def _add(self, link: ChocoLink, q_mine: list, q_theirs: list, stream=None) -> bool:
        """One chunk of both q's into the link's estimates, apart from the model's changes and
        reads (so a checkpoint sees each estimate whole, a restart of the link never meets a
        chunk half-added, and a chunk's difference reads each estimate whole) but not waiting
        for a step's passes. With `stream`: only while the link still runs that exchange;
        returns whether the chunk was added."""

        def add() -> bool:
            if stream is not None and link.stream is not stream:
                return False
            link.add_slices(q_mine, q_theirs)
            return True

        return self.ctx.trainer.update_beside(add)

    def _finish(self, link: ChocoLink) -> float:
        gamma = self.ctx.settings.gamma
        radius = self.ctx.robust if self.ctx.gossip.robust != "none" else None
        return self.ctx.trainer.apply(lambda live: link.finish(live, gamma, radius))

    # -- initiator ------------------------------------------------------------------------------
    async def after_step(self, result: StepResult) -> None:
        self.pacer.observe_step(result.seconds)
        if not self.pacer.due(result.step) or self._running or self._quiet:
            return
        partner = self.ctx.peers.choose_partner(self.ctx.now())
        if partner is not None and self.ctx.peers.address_of(partner) is not None:
            self._running = True
            self.pacer.mark(result.step)
            self.ctx.start_soon(self._exchange, partner)

    async def _exchange(self, partner: str) -> None:
        try:
            link = self._link(partner)
            if link.stream is not None and self._silent(link):
                await self.ctx.to_thread(self._restart, link, partner, "its exchange went silent")
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
        address = ctx.peers.address_of(partner)
        if address is None:
            return
        plan = self.plan(ctx.chunk_numel)
        seq, xid, seed = link.seq, ctx.rng.getrandbits(63), self._seed
        self._seed += len(plan)
        moved, refused = [0], []  # bytes both ways; a reply that ends the exchange
        timer = self.chunk_timer
        # The whole stream is bounded too (a partner that answers each chunk just in time must
        # not hold the link for the sum of the chunks' deadlines): the link's deadline for all
        # of its bytes plus the tensor work of every chunk on both ends, extended as ours is
        # measured (at the first exchange nothing is known of it yet)
        whole = ctx.peers.exchange_deadline(partner, 2 * ctx.peers.payload_nbytes(spec), started)

        def work_s() -> float:  # (both ends, every chunk, each as long as ours)
            return 2 * 2 * len(plan) * timer.seconds

        limit = trio.CancelScope(deadline=started + whole + work_s())

        def bound() -> None:
            limit.deadline = max(limit.deadline, started + whole + work_s())

        async def one(index: int) -> None:
            # each request's deadline covers the link's time for a window of chunks and the
            # tensor work on both ends (measured: ours before the first request goes)
            begun = ctx.clock()
            payload, q_mine = await ctx.to_thread(self._our_chunk, link, plan, index, spec,
                                                  seed + index)  # fmt: skip
            work = ctx.clock() - begun
            if not timer.seconds:
                timer.observe(work)
                bound()
            header = ChocoExchange(codec=spec, seq=seq, base=self._start_of(link), xid=xid,
                                   plan=plan.digest, chunk_numel=plan.chunk_numel,
                                   chunks=len(plan), index=index)  # fmt: skip
            deadline = timer.deadline(ctx.peers, partner, len(payload), ctx.now(), len(plan))
            reply, data, _ = await ctx.network.request(
                address, header, payload, deadline_s=deadline, expect_peer=partner)
            if not isinstance(reply, ChocoReply) or reply.seq != seq + 1:
                refused.append(reply)
                raise _Ended()
            moved[0] += len(payload) + len(data)
            received = ctx.clock()
            q_theirs = await ctx.to_thread(self._their_chunk, plan, index, spec, data)
            await ctx.to_thread(self._add, link, q_mine, q_theirs)
            timer.observe(work + ctx.clock() - received)
            bound()

        try:
            with limit:
                await one(0)  # (alone: it opens the exchange on the partner's side)
                await in_window(range(1, len(plan)), one)
            if limit.cancelled_caught:
                raise trio.TooSlowError(f"the whole exchange took over "
                                        f"{limit.deadline - started:.1f} s")  # fmt: skip
        except (TransportError, trio.TooSlowError) as exc:
            paced(self.pacer, ctx.now() - started)  # (the link's time went into it)
            return await self._failed(partner, spec, link, f"{type(exc).__name__}: {exc}")
        except _Ended:
            return await self._ended(partner, spec, link, refused[0])
        except (RejectedUpdate, compress.DecodeError) as exc:
            # the peer applied that chunk: the next exchange finds out and restarts the link
            self.counters.record_rejected(partner, spec, exc)
            ctx.peers.unreliable(partner, ctx.now())
            log_within_quota("update_rejected", peer=partner[:12], reason=str(exc))
            return await self._failed(partner, spec, link, None)
        distance = await ctx.to_thread(self._finish, link)
        now = ctx.now()
        ctx.peers.succeeded(partner, moved[0], now - started, now)
        paced(self.pacer, now - started)
        self.counters.record_ok(partner, spec, now - started)
        log.debug("exchange_done", partner=partner[:12], codec=spec, bytes=moved[0],
                  chunks=len(plan), seconds=round(now - started, 4),
                  distance=round(distance, 5))  # fmt: skip

    async def _ended(self, partner: str, spec: str, link: ChocoLink, reply: Header) -> None:
        """The partner answered a chunk with something else than its chunk."""
        ctx = self.ctx
        if isinstance(reply, ChocoResync):
            counts = {"ours": link.seq, "theirs": reply.seq, "zero": reply.zero}
            why = "the partner restarted the link"
            await ctx.to_thread(lambda: self._restart(link, partner, why, **counts))
            return
        if isinstance(reply, ErrorReply) and reply.code == "busy" and not link.partial:
            ctx.peers.busy(partner, ctx.now())
            log.debug("exchange_declined", partner=partner[:12], reason=reply.reason)
            return
        reason = (f"{reply.code}: {reply.reason}" if isinstance(reply, ErrorReply)
                  else f"unexpected {type(reply).__name__}")  # fmt: skip
        await self._failed(partner, spec, link, reason)

    async def _failed(self, partner: str, spec: str, link: ChocoLink, reason: str | None) -> None:
        """Count a failed exchange; one that had changed the estimates restarts the link here
        (the partner restarts it when it sees our next exchange)."""
        if link.partial:
            await self.ctx.to_thread(self._restart, link, partner, "our exchange broke half-way")
        if reason is None:  # (counted as rejected)
            return
        self.ctx.peers.failed(partner, self.ctx.now())
        self.counters.record_failed(partner, spec)
        log.info("exchange_failed", partner=partner[:12], reason=reason)

    # -- responder ------------------------------------------------------------------------------
    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, ChocoExchange)
        ctx = self.ctx
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        plan, why = plan_refusal(self._plans, ctx.trainer, header.chunk_numel,
                                 ctx.max_chunk_numel, header.plan, header.chunks,
                                 header.index)  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        link = self._link(peer.peer_id)
        if self._quiet and (link.stream is None or link.stream[0] != header.xid):
            # (a new exchange, or a restart of the link: both work under the model's lock)
            return ErrorReply(code="busy", reason="writing a checkpoint"), b""
        if header.base != self._start_of(link):  # the two ends start this link differently
            return await self._agree_start(peer.peer_id, link, header.base)
        stream = link.stream
        if stream is not None and stream[0] != header.xid:  # it left one unfinished: restart
            ours = link.seq
            await ctx.to_thread(self._restart, link, peer.peer_id, "an exchange left unfinished")
            return ChocoResync(seq=ours, zero=link.zero), b""
        if stream is None:
            if header.index != 0:
                return ErrorReply(code="bad_request", reason=f"no exchange {header.xid}"), b""
            verdict = link.judge(header.seq)
            if verdict == "busy":
                return ErrorReply(code="busy", reason="an exchange on this link is running"), b""
            if verdict == "resync":
                ours = link.seq
                counts = {"ours": ours, "theirs": header.seq}
                await ctx.to_thread(lambda: self._restart(link, peer.peer_id, "the counts differ",
                                                          **counts))  # fmt: skip
                return ChocoResync(seq=ours, zero=link.zero), b""
            link.busy = True
            stream = link.stream = (header.xid, set(), ctx.now(), set())
        if header.index in stream[1]:
            return ErrorReply(code="bad_request", reason=f"chunk {header.index} twice"), b""
        stream[1].add(header.index)
        link.seen = ctx.now()
        try:
            q_theirs = await ctx.to_thread(self._their_chunk, plan, header.index, header.codec,
                                           payload)  # fmt: skip
        except (RejectedUpdate, compress.DecodeError) as exc:
            self.counters.record_rejected(peer.peer_id, header.codec, exc)
            log_within_quota("update_rejected", peer=peer.short_id, reason=str(exc))
            await ctx.to_thread(self._restart, link, peer.peer_id, "its difference was rejected")
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        reply, q_mine = await ctx.to_thread(self._our_chunk, link, plan, header.index,
                                            header.codec, header.xid + header.index)  # fmt: skip
        if not await ctx.to_thread(self._add, link, q_mine, q_theirs, stream):
            # restarted meanwhile (another chunk was rejected, the connection was lost)
            return ErrorReply(code="bad_request", reason="the exchange was restarted"), b""
        seq = link.seq + 1
        stream[3].add(header.index)
        if len(stream[3]) == len(plan):
            await ctx.to_thread(self._finish, link)
            link.busy = False
            self.counters.record_ok(peer.peer_id, header.codec)
        return ChocoReply(seq=seq), reply

    async def _agree_start(self, peer: str, link: ChocoLink, theirs: int) -> Reply:
        """The peer's exchange starts the link elsewhere than ours: restart it at the start
        both can hold (the initial model when both started from it, else zero) and tell it."""
        if link.busy:  # our own exchange runs on it: the peer tries again later
            return ErrorReply(code="busy", reason="an exchange on this link is running"), b""
        zero = theirs != self.base_digest
        if zero and theirs != 0 and not self._said_base:
            self._said_base = True
            log.warning("choco_initial_models_differ", peer=peer[:12], why=INITIAL_MODELS_DIFFER)
        ours = link.seq
        await self.ctx.to_thread(lambda: self._restart(
            link, peer, "the link's start differs", zero=zero, ours=ours))  # fmt: skip
        return ChocoResync(seq=ours, zero=zero), b""


class _Ended(Exception):
    """A chunk was answered with something else than the partner's chunk."""


def choco_copies(max_peers: int) -> float:
    """Model copies choco keeps beyond a plain loop: the initial model and two estimates per
    neighbour tracked."""
    return 1.0 + 2 * max_peers


def fit_max_peers(gossip: GossipConfig, copies: float, numel: int = 0) -> GossipConfig | None:
    """`gossip` with max_peers lowered to what `copies` model copies hold (None: not even one
    neighbour fits; the model's size does not change what a neighbour costs in copies)."""
    most = int((copies - choco_copies(0)) // 2)
    if most < 1:
        return None
    settings = gossip.settings
    if settings.max_peers <= most:
        return gossip
    fitted = dataclasses.replace(settings, max_peers=most)
    return dataclasses.replace(gossip, algorithm_settings={**gossip.algorithm_settings,
                                                           "choco": fitted})  # fmt: skip


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="choco",
        runtime=Choco,
        settings=ChocoSettings,
        messages=(ChocoExchange, ChocoReply, ChocoResync),
        summary="CHOCO-SGD: compressed differences against per-neighbour public estimates",
        # the initial model and two estimates per tracked neighbour (q travels in chunks)
        memory=lambda g, numel: choco_copies(g.settings.max_peers),
        fit=fit_max_peers,
    )
)
