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
import torch
import trio

from geotrain import compress
from geotrain.gossip import (
    NesterovOuter,
    RejectedUpdate,
    average,
    check_update,
    fresh_deltas,
    pseudo_gradient,
)

from .._config import check_field
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from ._stream import (
    ChunkPlan,
    ModelAssembly,
    SliceFeedback,
    cached_plan,
    encode_chunk,
    in_window,
    model_chunk,
    plan_refusal,
)


class _Refused(Exception):
    """A partner answered an offer's chunk with something else than a chunk."""

log = structlog.get_logger()


class DeltaOffer(Header, frozen=True, tag="delta_offer"):
    """The payload is chunk `index` of the sender's pseudo-gradient of outer round `round`.

    An offer is `chunks` such requests under one `xid`, cut by the plan whose digest is `plan`
    (chunks of at most `chunk_numel` elements; both ends must agree). Each is answered with the
    same chunk of the responder's latest pseudo-gradient.
    """

    codec: CodecSpec
    round: U63
    xid: U63
    plan: U63
    chunk_numel: U63
    chunks: U63
    index: U63


class DeltaReply(Header, frozen=True, tag="delta_reply"):
    """A chunk of the responder's latest pseudo-gradient (round 0, empty: it has none yet)."""

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
        # our latest update: (round, its chunks encoded with `codec`, codec), and its values
        self.latest: tuple[int, list[bytes], str] = (0, [], "")
        self.latest_delta: Tensors | None = None
        self.inbox: dict[str, tuple[int, Tensors]] = {}
        self.used: dict[str, int] = {}
        self._incoming: dict[str, tuple[int, int, ModelAssembly]] = {}  # peer -> xid, round, ...
        self._plans: dict[int, ChunkPlan] = {}
        self.feedback = SliceFeedback(torch.float16)
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
        residuals = {k[3:]: v for k, v in tensors.items() if k.startswith("ef/") and "@" not in k}
        self.feedback.load_state_dict({k: v.to(device) for k, v in residuals.items()})
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

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (a few cached).

        Raises:
            ValueError: it would have more than MAX_CHUNKS chunks.
        """
        return cached_plan(self._plans, self.ctx.trainer, chunk_numel)

    def _round_end(self, spec: str) -> tuple[Tensors, list[bytes]]:
        """Our update of this round, and its chunks encoded once (error feedback applies once)."""
        delta = self.ctx.trainer.update(lambda live: pseudo_gradient(self.start, live))
        plan = self.plan(self.ctx.chunk_numel)
        feedback = None if spec == "none" else self.feedback
        shapes = dict(plan.shapes)
        chunks = [encode_chunk(model_chunk(delta, plan, i), spec, feedback, seed=self.round + i,
                               shapes=shapes) for i in range(len(plan))]  # fmt: skip
        return delta, chunks

    async def after_step(self, result: StepResult) -> None:
        ctx = self.ctx
        if result.step % ctx.settings.inner_steps:
            return
        round_ = self.round + 1
        live = sorted(ctx.peers.live_peers())
        partners = sorted(ctx.rng.sample(live, min(len(live), ctx.settings.fanout)))
        spec = self._spec(partners)
        delta, chunks = await ctx.to_thread(self._round_end, spec)
        self.latest, self.latest_delta = (round_, chunks, spec), delta
        replies: dict[str, tuple[int, Tensors | None]] = {}  # who answered (with its update)
        if partners:
            now = ctx.now()
            nbytes = sum(len(c) for c in chunks)
            deadline = max(ctx.peers.round_deadline(p, 2 * nbytes, now) for p in partners)
            with trio.move_on_after(deadline):
                async with trio.open_nursery() as nursery:
                    for peer in partners:
                        nursery.start_soon(self._offer, peer, round_, spec, deadline, replies)
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

        await self.ctx.to_thread(lambda: self.ctx.trainer.apply(step))
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

    async def _offer(self, peer, round_, spec, deadline, replies) -> None:
        """Send our update to `peer` chunk by chunk and take its latest one from the replies."""
        ctx = self.ctx
        address = ctx.peers.address_of(peer)
        if address is None:
            return
        plan = self.plan(ctx.chunk_numel)
        chunks = self.latest[1]
        xid = ctx.rng.getrandbits(63)
        theirs = ModelAssembly(plan, spec, ctx.trainer.task_device)
        their_round: list[int] = []
        started, moved = ctx.now(), [0]

        async def one(index: int) -> None:
            header = DeltaOffer(codec=spec, round=round_, xid=xid, plan=plan.digest,
                                chunk_numel=plan.chunk_numel, chunks=len(plan), index=index)
            reply, data, _ = await ctx.network.request(
                address, header, chunks[index], deadline_s=deadline, expect_peer=peer
            )  # fmt: skip
            if not isinstance(reply, DeltaReply):
                raise _Refused(getattr(reply, "reason", "") or type(reply).__name__)
            moved[0] += len(chunks[index]) + len(data)
            if their_round and reply.round != their_round[0]:
                raise _Refused("its update changed during the offer")
            their_round.append(reply.round)
            if reply.round > 0:
                await ctx.to_thread(theirs.add, index, data)

        try:
            await in_window(range(len(plan)), one)
            delta = None
            if their_round and their_round[0] > 0:
                delta = theirs.tensors
                await ctx.to_thread(lambda: check_update(
                    ctx.trainer.params(), delta, max_norm_ratio=ctx.gossip.max_norm_ratio))
        except (TransportError, _Refused) as exc:  # counted as failed when the round ends
            log.info("exchange_failed", partner=peer[:12], reason=str(exc))
            return
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._rejected_now.add(peer)
            self.counters.record_rejected(peer, spec)
            ctx.peers.unreliable(peer, ctx.now())
            log.warning("update_rejected", peer=peer[:12], reason=str(exc))
            return
        now = ctx.now()
        ctx.peers.transferred(peer, moved[0], now - started, now)
        replies[peer] = (their_round[0] if their_round else 0, delta)
        self.counters.record_ok(peer, spec)

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, DeltaOffer)
        ctx = self.ctx
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        plan, why = plan_refusal(self._plans, ctx.trainer, header.chunk_numel,
                                 ctx.max_chunk_numel, header.plan, header.chunks,
                                 header.index)  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        try:
            await self._take(peer.peer_id, header, payload, plan)
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._incoming.pop(peer.peer_id, None)
            self.counters.record_rejected(peer.peer_id, header.codec)
            log.warning("update_rejected", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        round_, chunks, spec = self.latest
        if not chunks or self.latest_delta is None:
            return DeltaReply(round=0), b""
        if spec == header.codec and plan.chunk_numel == ctx.chunk_numel:
            return DeltaReply(round=round_), chunks[header.index]
        delta = self.latest_delta  # another codec or cut: encode this chunk for it (no feedback)
        data = await ctx.to_thread(
            lambda: encode_chunk(model_chunk(delta, plan, header.index), header.codec)
        )
        return DeltaReply(round=round_), data

    async def _take(self, peer: str, header: DeltaOffer, payload: memoryview, plan) -> None:
        """Add one chunk of `peer`'s offer; a complete, checked update goes to the inbox."""
        ctx = self.ctx
        current = self._incoming.get(peer)
        if current is None and peer not in self.inbox and len(self.inbox) + len(
            self._incoming
        ) >= ctx.settings.fanout:  # as many updates held as the memory budget counts
            raise ValueError(f"already holding {ctx.settings.fanout} peers' updates")
        if current is None or current[0] != header.xid:  # a new offer replaces an unfinished one
            assembly = ModelAssembly(plan, header.codec, ctx.trainer.task_device)
            current = self._incoming[peer] = (header.xid, header.round, assembly)
        assembly = current[2]
        if not await ctx.to_thread(assembly.add, header.index, payload):
            return
        del self._incoming[peer]
        delta = assembly.tensors
        await ctx.to_thread(lambda: check_update(
            ctx.trainer.params(), delta, max_norm_ratio=ctx.gossip.max_norm_ratio))
        if header.round > self.inbox.get(peer, (-1, None))[0]:
            self.inbox[peer] = (header.round, delta)
        self.counters.record_ok(peer, header.codec)


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
