# dpsgd: synchronous neighbourhood averaging in rounds of `exchange_every` steps. Invariants: a
# round's model is published before its neighbours are asked, so two nodes in the same round
# never wait on each other; a request for a round this node has not reached waits at most its
# asker's deadline (never over ROUND_WAIT_CAP_S); a reply is used only when it is of the requested
# round or newer; the round ends at its deadline with whoever answered (Metropolis-Hastings
# weights, the rest stays with us); whom to ask and whom to forgive is gossip's RoundAttendance.
# A client-mode peer (behind NAT) is never asked: it sends its round's model with its requests
# (chunk i with the request for chunk i), and the asked node mixes the complete, checked models
# it was sent into its next round (at most `degree` held at once).
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import structlog
import trio

from geotrain import compress
from geotrain.gossip import (
    TRIM_MIN_NEIGHBOURS,
    RejectedUpdate,
    RoundAttendance,
    check_update,
    clipped_neighbourhood_mix,
    metropolis_hastings_weights,
    neighbourhood_mix,
    trim_count,
    trimmed_mean_mix,
)

from .._config import check_field, check_types
from .._log_quota import log_within_quota
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, Name, PeerInfo, TransportError
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from ._stream import (
    ChunkPlan,
    ModelAssembly,
    cached_plan,
    encode_chunk,
    in_window,
    keep_unsent,
    model_chunk,
    plan_refusal,
)


class _Refused(Exception):
    """A neighbour answered a chunk request with something else than the chunk."""

ROUND_WAIT_CAP_S = 30.0  # the most a responder holds a request for a round it has not reached
CATCH_UP_FLOOR_S = 5.0  # a neighbour that reaches our round within this (or 4 rounds) is waited for
KEEP_ROUNDS = 2
log = structlog.get_logger()
Degree = Annotated[int, msgspec.Meta(ge=0, le=4096)]


class RoundRequest(Header, frozen=True, tag="round_request"):
    """Ask a neighbour for chunk `index` of its model at the boundary of round `round`.

    For chunk 0 the neighbour answers RoundReply once it has reached that round with the model it
    had there, or a newer one when that round is gone; it waits for that at most `wait_s` (the
    requester's deadline: after it nobody listens, and a held request ties up one of its inbound
    workers). Chunks 1.. are asked of the round the first reply named, and refused once it is
    gone. `degree` is the requester's neighbour count this round (for Metropolis-Hastings
    weights); `plan` and `chunk_numel` say how the model is cut (both ends must agree).
    """

    algorithm: Name
    codec: CodecSpec
    round: U63
    degree: Degree
    plan: U63
    chunk_numel: U63
    index: U63 = 0
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 30.0


class RoundReply(Header, frozen=True, tag="round_reply"):
    round: U63
    degree: Degree
    chunks: U63


@dataclass(frozen=True)
class DpsgdSettings:
    """[gossip.dpsgd]

    degree: most neighbours per round (all live peers when there are fewer); Metropolis-Hastings
        stays well mixed with a handful.
    round_slack: a late neighbour is waited for up to this many of our own round times on top of
        the link's transfer deadline (covers the neighbours' compute jitter, not a straggler).
    """

    degree: int = 4
    round_slack: float = 1.0

    def __post_init__(self) -> None:
        check_types(self, "gossip.dpsgd")
        check_field(self.degree >= 1, "gossip.dpsgd.degree", self.degree, ">= 1")
        check_field(self.round_slack >= 0, "gossip.dpsgd.round_slack", self.round_slack, ">= 0")


@dataclass(frozen=True)
class DpsgdStatistics:
    rounds: int
    full_rounds: int  # rounds in which every asked neighbour answered
    missed_neighbours: int
    late_replies_ignored: int
    forgiven_misses: int


class Dpsgd(Algorithm):
    """D-PSGD with deadlines: synchronous rounds of `exchange_every` steps.

    At each round boundary the node publishes its model, asks up to `degree` live neighbours
    (all of them in a small swarm; a random subset otherwise, so the weights are then only
    row-stochastic) for theirs and mixes with Metropolis-Hastings weights. The round's deadline
    is the slowest link's transfer deadline plus `round_slack` x our own round time; who misses
    it is left out (its weight stays with us) and skipped for 2, 4, ... 32 rounds.

    Assumes: peers of similar speed that start together (a late joiner or a straggler mostly
    pulls from the others). Trades: training pauses at every round boundary (at most one
    deadline) for the tightest agreement per round; a neighbour slower than the deadline simply
    drops out of the others' rounds, while one that is behind but catching up (a later start) is
    waited for, so a node that started first does not train alone ever further ahead.
    """

    handles = (RoundRequest,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        self.round = -1  # the newest round published
        self._models: dict[int, tuple[Tensors, int]] = {}  # round -> (model, degree)
        # round -> neighbour -> (chunks of it sent, of how many, when the last went)
        self._serving: dict[int, dict[str, tuple[int, int, float]]] = {}
        self._published = trio.Event()
        self._attendance = RoundAttendance()
        self._step_s = 0.0
        self._rejected_now: set[str] = set()  # neighbours whose model this round was refused
        self._plans: dict[int, ChunkPlan] = {}
        self.rounds = self.full_rounds = self.missed = self.late_ignored = 0
        self._said_fallback = False  # the trim -> clip fallback is logged once
        self._pushes: dict[str, tuple[ModelAssembly, int]] = {}  # client -> its model arriving
        # clients' models for our next round: model, degree, codec
        self._pushed: dict[str, tuple[Tensors, int, str]] = {}
        self._pushers = 0  # clients mixed in our last round (counted in our degree)

    def statistics(self) -> DpsgdStatistics:
        return DpsgdStatistics(
            self.rounds, self.full_rounds, self.missed, self.late_ignored,
            self._attendance.forgiven,
        )  # fmt: skip

    def state(self) -> tuple[Tensors, dict]:
        return {}, {"round": self.round}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        self.round = int(meta.get("round", -1))

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (a few cached).

        Raises:
            ValueError: it would have more than MAX_CHUNKS chunks.
        """
        return cached_plan(self._plans, self.ctx.trainer, chunk_numel)

    def _neighbours(self, round_: int) -> list[str]:
        live = sorted(self.ctx.peers.dialable_peers())  # a client-mode peer asks, is not asked
        self._attendance.forget(live)
        degree = self.ctx.settings.degree
        if len(live) > degree:
            live = sorted(self.ctx.rng.sample(live, degree))
        return self._attendance.eligible(live, round_)

    def _release(self, round_: int) -> None:
        """Drop the published models older than `round_` before its snapshot is taken, but the
        newest while a neighbour is still fetching it (chunks sent within ROUND_WAIT_CAP_S, not
        all of them yet): one model held between rounds, two only for a slow fetch."""
        now, newest = self.ctx.now(), max(self._models, default=None)
        for old in [r for r in self._models if r < round_]:
            streams = self._serving.get(old, {}).values()
            fetching = any(sent < total and now - last < ROUND_WAIT_CAP_S
                           for sent, total, last in streams)  # fmt: skip
            if old != newest or not fetching:
                del self._models[old]
        self._serving = {r: v for r, v in self._serving.items() if r in self._models}

    def _served(self, peer: str, round_: int, chunks: int) -> None:
        streams = self._serving.setdefault(round_, {})
        sent = streams.get(peer, (0, chunks, 0.0))[0]
        streams[peer] = (sent + 1, chunks, self.ctx.now())

    def _publish(self, round_: int, model: Tensors, degree: int) -> None:
        self._models[round_] = (model, degree)
        for old in [r for r in self._models if r <= round_ - KEEP_ROUNDS]:
            del self._models[old]
            self._serving.pop(old, None)
        self.round = round_
        self._published.set()
        self._published = trio.Event()

    async def after_step(self, result: StepResult) -> None:
        self._step_s = (
            result.seconds if not self._step_s else 0.9 * self._step_s + 0.1 * result.seconds
        )
        every = self.ctx.gossip.exchange_every
        if result.step % every:
            return
        round_ = result.step // every
        neighbours = self._neighbours(round_)
        self._release(round_)
        sent = await self.ctx.to_thread(self.ctx.trainer.snapshot)
        self._publish(round_, sent, len(neighbours) + self._pushers)
        if neighbours or self._pushed:
            await self._round(round_, sent, neighbours)

    def _spec(self, peer: str | None = None) -> str:
        peers = self.ctx.peers
        if peers.fixed_codec is not None:
            return peers.fixed_codec
        return peers.choose_codec(peer, self.ctx.now()) if peer else "fp16"

    async def _round(self, round_: int, sent: Tensors, neighbours: list[str]) -> None:
        ctx = self.ctx
        nbytes = ctx.peers.payload_nbytes(self._spec())
        slack = ctx.settings.round_slack * ctx.gossip.exchange_every * self._step_s
        now = ctx.now()
        deadline = max((ctx.peers.round_deadline(p, nbytes, now) for p in neighbours), default=0)
        deadline += slack
        started = now
        got: dict[str, tuple[Tensors, int, str]] = {}  # model, degree, codec
        reasons: dict[str, str] = {}  # why a neighbour is missing (for the log)
        with trio.move_on_after(deadline if neighbours else 0):
            async with trio.open_nursery() as nursery:
                for peer in neighbours:
                    nursery.start_soon(
                        self._ask, peer, round_, len(neighbours), deadline, got, reasons
                    )
        rejected = {p for p in reasons if p in self._rejected_now}
        self._rejected_now.clear()
        missing = [p for p in neighbours if p not in got]
        now = ctx.now()
        # "catching up" is judged over a few of our rounds, however long a round takes
        round_s = deadline + ctx.gossip.exchange_every * self._step_s
        self._attendance.catch_up_s = max(CATCH_UP_FLOOR_S, 4 * round_s)
        for peer in neighbours:
            self._attendance.record(peer, round_, peer in got, now)
            ctx.peers.answered(peer, peer in got, now)
            if peer in got:
                self.counters.record_ok(peer, self._spec(peer))
            elif peer not in rejected:  # (rejected ones were counted as such)
                self.counters.record_failed(peer)
        pushed, self._pushed = self._pushed, {}  # clients' models sent with their requests
        for peer in pushed:
            self.counters.record_ok(peer, None)
        got.update({p: v for p, v in pushed.items() if p not in got})
        self._pushers = len(pushed)
        self_w, weights = metropolis_hastings_weights(
            len(neighbours) + len(pushed), {p: d for p, (_, d, _) in got.items()}
        )
        remotes = {p: m for p, (m, _, _) in got.items()}

        def mix() -> None:
            for remote, _, spec in got.values():  # what a sparse codec did not send mixes nothing
                keep_unsent(remote, sent, spec)
            ctx.trainer.apply(self._mixer(sent, remotes, weights))

        await ctx.to_thread(mix)
        self.rounds += 1
        self.full_rounds += not missing
        self.missed += len(missing)
        log.info(
            "round_done",
            round=round_,
            answered=sorted(p[:12] for p in got if p not in pushed),
            clients=sorted(p[:12] for p in pushed),
            missing=sorted(p[:12] for p in missing),
            reasons={p[:12]: r for p, r in reasons.items()},
            self_weight=round(self_w, 4),
            deadline_s=round(deadline, 3),
            waited_s=round(ctx.now() - started, 3),
        )

    def _mixer(self, sent: Tensors, remotes: dict[str, Tensors], weights: dict[str, float]):
        """The round's mixing step for `gossip.robust`: Metropolis-Hastings averaging (none),
        with every difference clipped (clip), or a coordinate-wise trimmed mean (trim; clipping
        when fewer than TRIM_MIN_NEIGHBOURS neighbours answered, said once in the log)."""
        radius = self.ctx.robust
        assert radius is not None
        rule = self.ctx.gossip.robust
        if rule == "trim" and remotes and trim_count(len(remotes) + 1):
            radius.trimmed_rounds += 1
            radius.mixed += 1
            return lambda live: trimmed_mean_mix(live, sent, remotes)
        if rule == "trim" and remotes:
            radius.trim_fallbacks += 1
            if not self._said_fallback:
                self._said_fallback = True
                log.warning("trim_fallback", neighbours=len(remotes), needed=TRIM_MIN_NEIGHBOURS,
                            detail="too few neighbours answered for a trimmed mean: this round "
                            "and others like it are mixed with clipping")  # fmt: skip
        if rule == "none":
            return lambda live: neighbourhood_mix(live, sent, remotes, weights)
        return lambda live: clipped_neighbourhood_mix(live, sent, remotes, weights, radius)

    async def _ask(self, peer, round_, degree, deadline, got, reasons) -> None:
        ctx = self.ctx
        address = ctx.peers.address_of(peer)
        if address is None:
            reasons[peer] = "no address"
            return
        plan = self.plan(ctx.chunk_numel)

        def request(round_asked: int, index: int) -> RoundRequest:
            return RoundRequest(
                algorithm="dpsgd", codec=self._spec(peer), round=round_asked, degree=degree,
                plan=plan.digest, chunk_numel=plan.chunk_numel, index=index,
                wait_s=min(deadline, ROUND_WAIT_CAP_S),  # the responder never holds it longer
            )  # fmt: skip

        first = request(round_, 0)
        assembly = ModelAssembly(plan, first.codec, ctx.trainer.task_device)
        try:
            reply, payload, _ = await ctx.network.request(
                address, first, await self._push(round_, plan, first.codec, 0),
                deadline_s=deadline, expect_peer=peer,
            )  # fmt: skip
            if not isinstance(reply, RoundReply) or reply.chunks != len(plan):
                reasons[peer] = getattr(reply, "reason", type(reply).__name__)[:200]
                return
            self._attendance.heard(peer, reply.round, ctx.now())
            if reply.round < round_:  # an answer for an older round: never mixed into this one
                self.late_ignored += 1
                reasons[peer] = f"reply for round {reply.round}"
                return
            await ctx.coded(assembly.add, 0, payload)
            await self._rest(address, peer, plan, assembly, request(reply.round, 0), deadline,
                             ours=round_)  # fmt: skip
            remote = assembly.tensors
            await ctx.to_thread(lambda: check_update(
                ctx.trainer.params(), remote, max_norm_ratio=ctx.gossip.max_norm_ratio))
        except TransportError as exc:
            reasons[peer] = f"{type(exc).__name__}: {exc}"[:200]
            return
        except _Refused as exc:
            reasons[peer] = str(exc)[:200]
            return
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            reasons[peer] = f"rejected: {exc}"[:200]
            self._rejected_now.add(peer)
            self.counters.record_rejected(peer, first.codec, exc)
            log_within_quota("update_rejected", peer=peer[:12], reason=str(exc))
            return
        got[peer] = (remote, reply.degree, first.codec)

    async def _push(self, round_: int, plan: ChunkPlan, codec: str, index: int) -> bytes:
        """What goes with our request for chunk `index`: nothing, or, when we are a client (nobody
        asks us), chunk `index` of our own model of round `round_`."""
        entry = self._models.get(round_) if self.ctx.peers.client else None
        if entry is None:
            return b""
        model = entry[0]
        return await self.ctx.coded(
            lambda: encode_chunk(model_chunk(model, plan, index), codec, seed=round_)
        )

    async def _rest(self, address, peer, plan, assembly, template, deadline, *, ours) -> None:
        """Chunks 1.. of the round `template` names, CHUNKS_IN_FLIGHT at a time (each with our
        own chunk of round `ours` when we are a client)."""

        async def one(index: int) -> None:
            header = msgspec.structs.replace(template, index=index, wait_s=0.0)
            reply, payload, _ = await self.ctx.network.request(
                address, header, await self._push(ours, plan, header.codec, index),
                deadline_s=deadline, expect_peer=peer,
            )  # fmt: skip
            if not isinstance(reply, RoundReply) or reply.round != template.round:
                raise _Refused(getattr(reply, "reason", "") or f"chunk {index}: no reply")
            await self.ctx.coded(assembly.add, index, payload)

        await in_window(range(1, len(plan)), one)

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        assert isinstance(header, RoundRequest)
        ctx = self.ctx
        if header.algorithm != "dpsgd":
            reason = f"this node runs dpsgd, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        plan, why = plan_refusal(self._plans, ctx.trainer, header.chunk_numel,
                                 ctx.max_chunk_numel, header.plan, None, header.index)  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        if len(payload) and ctx.peers.is_client(peer.peer_id):
            await self._take_push(peer.peer_id, header, payload, plan)
        if header.index > 0:  # the rest of a round already answered: that round or nothing
            if header.round not in self._models:
                return ErrorReply(code="busy", reason=f"round {header.round} is gone"), b""
            round_ = header.round
        else:
            if peer.peer_id in ctx.peers.live_peers():  # its own round (strangers: untracked)
                self._attendance.heard(peer.peer_id, header.round, ctx.now())
            with trio.move_on_after(min(header.wait_s, ROUND_WAIT_CAP_S)):
                while self.round < header.round:
                    await self._published.wait()
            if self.round < header.round:
                return ErrorReply(code="busy", reason=f"round {header.round} not reached"), b""
            round_ = header.round if header.round in self._models else self.round
            if round_ not in self._models:  # (resumed from a checkpoint: nothing published yet)
                return ErrorReply(code="busy", reason=f"round {round_} not published yet"), b""
        model, degree = self._models[round_]
        data = await ctx.coded(  # (our degree counts the clients that send us their model)
            lambda: encode_chunk(model_chunk(model, plan, header.index), header.codec, seed=round_)
        )
        self._served(peer.peer_id, round_, len(plan))
        return RoundReply(round=round_, degree=degree, chunks=len(plan)), data


    async def _take_push(self, peer: str, header: RoundRequest, payload, plan) -> None:
        """Keep chunk `header.index` of a client's model; a complete one, once checked, waits for
        our next round. A client beyond `degree` held models, or a chunk refused, is left out
        (logged and counted); the request is answered either way."""
        ctx = self.ctx
        if header.index == 0:
            self._pushes.pop(peer, None)
            if len(self._pushes) + len(set(self._pushed) - {peer}) >= ctx.settings.degree:
                log.debug("client_model_skipped", peer=peer[:12], reason="degree models held")
                return
            assembly = ModelAssembly(plan, header.codec, ctx.trainer.task_device)
            self._pushes[peer] = (assembly, header.degree)
        entry = self._pushes.get(peer)
        if entry is None or (entry[0].plan.digest, entry[0].spec) != (plan.digest, header.codec):
            return
        try:
            if not await ctx.coded(entry[0].add, header.index, payload):
                return
            del self._pushes[peer]
            remote = entry[0].tensors
            await ctx.to_thread(lambda: check_update(
                ctx.trainer.params(), remote, max_norm_ratio=ctx.gossip.max_norm_ratio))
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._pushes.pop(peer, None)
            self.counters.record_rejected(peer, header.codec, exc)
            log_within_quota("update_rejected", peer=peer[:12], reason=str(exc))
            return
        self._pushed[peer] = (remote, entry[1], header.codec)


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="dpsgd",
        runtime=Dpsgd,
        settings=DpsgdSettings,
        messages=(RoundRequest, RoundReply),
        summary="synchronous rounds with up to `degree` neighbours, stragglers left out",
        # the round's model and the last one while a neighbour fetches it (at most KEEP_ROUNDS),
        # and each neighbour's model during a round
        memory=lambda g, numel: KEEP_ROUNDS + g.settings.degree,
        averages_models=True,
    )
)
