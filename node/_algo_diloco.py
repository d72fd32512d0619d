# diloco: local SGD with an outer Nesterov step on gossip-averaged pseudo-gradients.
# Invariants: the model moves by the outer step only at round ends (every diloco_inner_steps
# steps), from the round's starting parameters; a round end waits at most the partners' link
# deadlines (late or missing partners are left out, never waited for beyond that); each peer's
# pseudo-gradient of a round is used at most once and only if at most diloco_max_staleness rounds
# old; pseudo-gradients from peers are decoded within the model's size budget and checked first.
from __future__ import annotations

import structlog
import trio

import compress
from gossip._algorithms import NesterovOuter, average, fresh_deltas, pseudo_gradient
from gossip._averaging import RejectedUpdate

from ._algorithm import AlgorithmContext, Tensors
from ._messages import ErrorReply, Header
from ._protocol import DeltaOffer, DeltaReply
from ._trainer import StepResult
from ._transport import PeerInfo, TransportError

log = structlog.get_logger()


class DilocoRuntime:
    """DiLoCo-style local SGD: H inner steps, then an outer Nesterov step on averaged updates.

    At a round end the pseudo-gradient (round start minus now) is encoded once (error feedback
    keeps what the codec dropped), offered to up to `diloco_fanout` live peers, and averaged with
    the peers' pseudo-gradients that arrived (replies, or offers pushed to us) within the
    deadline and at most `diloco_max_staleness` rounds old; the outer optimizer then moves the
    round's start and the model restarts there.

    Assumes: a small, well-connected group whose models start equal (same seed): only updates
    are averaged, never models, so models drift apart when nodes average different sets.
    Trades: agreement for H-fold fewer, compressible messages; a round end waits at most one
    deadline, and late partners are left out.
    """

    headers = (DeltaOffer,)

    def __init__(self, ctx: AlgorithmContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.outer = NesterovOuter(cfg.diloco_outer_lr, cfg.diloco_outer_momentum)
        self.start = ctx.trainer.snapshot()  # the parameters this outer round started from
        self.round = 0  # outer rounds completed
        self.latest: tuple[int, bytes | None, str] = (0, None, "")  # (round, payload, codec)
        self.latest_delta: Tensors | None = None
        self.inbox: dict[str, tuple[int, Tensors]] = {}
        self.used: dict[str, int] = {}
        self.feedback = compress.ErrorFeedback(compress.get_codec("none"))
        self.outer_steps = self.peer_deltas_used = self.missing = 0

    def statistics(self) -> dict[str, float | int]:
        return {
            "outer_steps": self.outer_steps,
            "peer_deltas_used": self.peer_deltas_used,
            "partners_missing": self.missing,
        }

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
        if self.ctx.config.codec != "auto":
            return self.ctx.config.codec
        now = self.ctx.now()
        specs = {self.ctx.choose_codec(p, now) for p in partners} or {"fp16"}
        shapes = [(n, tuple(t.shape)) for n, t in sorted(self.start.items())]
        return min(
            specs, key=lambda s: compress.expected_nbytes_named(shapes, compress.get_codec(s))
        )

    def _round_end(self, spec: str) -> tuple[Tensors, bytes]:
        delta = self.ctx.trainer.update(lambda live: pseudo_gradient(self.start, live))
        codec = compress.get_codec(spec)
        payload = compress.encode_named(
            sorted(delta.items()), codec, error_feedback=self.feedback, seed=self.round
        )
        return delta, payload

    async def after_step(self, result: StepResult) -> None:
        if result.step % self.ctx.config.diloco_inner_steps:
            return
        ctx = self.ctx
        round_ = self.round + 1
        live = sorted(ctx.live_peers())
        partners = sorted(ctx.rng.sample(live, min(len(live), ctx.config.diloco_fanout)))
        spec = self._spec(partners)
        delta, payload = await trio.to_thread.run_sync(self._round_end, spec)
        self.latest, self.latest_delta = (round_, payload, spec), delta
        replies: dict[str, tuple[int, Tensors]] = {}
        if partners:
            deadline = max(ctx.round_deadline(p, len(payload)) for p in partners)
            with trio.move_on_after(deadline):
                async with trio.open_nursery() as nursery:
                    for peer in partners:
                        nursery.start_soon(
                            self._offer, peer, round_, spec, payload, deadline, replies
                        )
        await self._outer_step(round_, delta, replies, partners)

    async def _outer_step(self, round_, delta, replies, partners) -> None:
        offered = {**self.inbox}
        for peer, (r, d) in replies.items():
            if r > offered.get(peer, (-1, None))[0]:
                offered[peer] = (r, d)
        use = fresh_deltas(
            round_,
            {p: r for p, (r, _) in offered.items()},
            self.used,
            max_staleness=self.ctx.config.diloco_max_staleness,
        )
        deltas = [delta] + [offered[p][1] for p in use]

        def step(live: Tensors) -> None:
            self.outer.step(self.start, average(deltas))
            for name, tensor in live.items():
                tensor.copy_(self.start[name])

        await trio.to_thread.run_sync(lambda: self.ctx.trainer.update(step))
        for peer in use:
            self.used[peer] = offered[peer][0]
        self.inbox.clear()
        live = set(self.ctx.live_peers())
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
        address = ctx.address_of(peer)
        if address is None:
            return
        started = ctx.now()
        try:
            reply, data, _ = await ctx.request(
                address,
                DeltaOffer(codec=spec, round=round_),
                payload,
                deadline_s=deadline,
                expect_peer=peer,
            )
        except TransportError as exc:
            ctx.links.record_failure(peer, ctx.now())
            log.info("exchange_failed", partner=peer[:12], reason=str(exc))
            return
        if not isinstance(reply, DeltaReply):
            log.info("exchange_failed", partner=peer[:12], reason=getattr(reply, "reason", ""))
            return
        now = ctx.now()
        ctx.links.record_transfer(peer, len(payload) + len(data), now - started, now)
        if not data:
            return
        try:
            replies[peer] = (
                reply.round,
                await trio.to_thread.run_sync(self._check, bytes(data), spec),
            )
        except (RejectedUpdate, compress.DecodeError) as exc:
            log.warning("update_rejected", peer=peer[:12], reason=str(exc))

    def _check(self, data: bytes, spec: str) -> Tensors:
        return self.ctx.decode_checked(data, spec)

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        assert isinstance(header, DeltaOffer)
        if not self.ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        data = bytes(payload)
        try:
            delta = await trio.to_thread.run_sync(self._check, data, header.codec)
        except (RejectedUpdate, compress.DecodeError) as exc:
            log.warning("update_rejected", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        if header.round > self.inbox.get(peer.peer_id, (-1, None))[0]:
            self.inbox[peer.peer_id] = (header.round, delta)
        round_, latest, spec = self.latest
        if latest is None:
            return DeltaReply(round=0), b""
        if spec != header.codec and self.latest_delta is not None:
            try:
                latest = await trio.to_thread.run_sync(
                    self.ctx.encode, self.latest_delta, header.codec
                )
            except ValueError as exc:
                return ErrorReply(code="bad_request", reason=f"codec: {exc}"[:500]), b""
        return DeltaReply(round=round_), latest
