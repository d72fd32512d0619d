# selsync: selective synchronization on top of the pairwise (AD-PSGD) exchange. Invariants: the
# threshold is checked every exchange_every steps against the model as it was after this node's
# last exchange (started or answered), kept whole when it fits reference_mb and as an evenly
# spread sample otherwise; an exchange is started only when the relative change passes the
# threshold and none is running; the exchange itself is adpsgd's, unchanged.
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

from geotrain.gossip import ModelSample

from .._config import check_field, check_types
from ..training import StepResult
from ..transport import Header, PeerInfo
from ._base import Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._registry import register_algorithm
from .adpsgd import (
    Adpsgd,
    Exchange,
    ExchangeAbort,
    ExchangeChunk,
    ExchangeChunkReply,
    ExchangeReply,
    adpsgd_copies,
)


@dataclass(frozen=True)
class SelsyncSettings:
    """[gossip.selsync]

    threshold: relative model change ||w - w_last|| / ||w|| since the last exchange that
        triggers the next one (1% by default: on digits-mlp about a third of the checks pass
        early in training, far fewer later).
    reference_mb: the most memory the model as of the last exchange may take, in float32. A
        model that fits is kept whole and its change measured exactly; a bigger one keeps an
        evenly spread sample of that size (every tensor of more than 4096 elements strided from
        a random offset, smaller ones whole) and estimates the change from it: 16 MB is 4M
        values, 1/25 of a 10^8-parameter model (0.04 copies, where a whole half-precision
        copy was 0.5). The estimate is unbiased in its square; a change confined to a few
        values of a large tensor can be missed until it spreads.
    """

    threshold: float = 0.01
    reference_mb: float = 16.0

    def __post_init__(self) -> None:
        check_types(self, "gossip.selsync")
        check_field(self.threshold > 0, "gossip.selsync.threshold", self.threshold, "> 0")
        check_field(self.reference_mb > 0, "gossip.selsync.reference_mb", self.reference_mb,
                    "> 0 (MB of float32)")  # fmt: skip

    @property
    def reference_numel(self) -> int:
        return max(1, int(self.reference_mb * 2**20) // 4)


@dataclass(frozen=True)
class SelsyncStatistics:
    steps: int
    communicated_steps: int
    comm_fraction: float = field(metadata={"gauge": True})  # communicated_steps / steps
    last_relative_change: float = field(metadata={"gauge": True})
    # steps between two checks now (gossip.comm_fraction adapts it)
    exchange_interval: int = field(default=0, metadata={"gauge": True})


class Selsync(Algorithm):
    """Selective synchronization: an adpsgd exchange only when the model changed enough.

    Every `exchange_every` steps the relative change since the last exchange (started or
    answered) is compared with the threshold; above it, a pairwise exchange starts.

    Assumes: that small updates can wait (late training, flat regions). Trades: agreement between
    peers for fewer exchanges; with a high threshold the peers drift as if training alone.
    """

    handles = Adpsgd.handles

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        self.pairwise = Adpsgd(ctx)  # shares ctx, so its exchanges fill the same counters
        self.pairwise.on_answered_mix = self._reset_after_mix  # our progress was shared
        shapes = {n: tuple(t.shape) for n, t in ctx.trainer.params().items()}
        # (its own generator: the offsets do not shift the node's other random choices)
        self.reference = ModelSample(shapes, ctx.settings.reference_numel,
                                     random.Random(ctx.rng.getrandbits(64)))  # fmt: skip
        self._reset_reference()
        self.steps = self.communicated = 0
        self.last_change = 0.0

    def statistics(self) -> SelsyncStatistics:
        fraction = self.communicated / self.steps if self.steps else 0.0
        return SelsyncStatistics(self.steps, self.communicated, fraction, self.last_change,
                                 self.pairwise.pacer.interval)  # fmt: skip

    def state(self) -> tuple[Tensors, dict]:
        tensors, _ = self.pairwise.state()
        values, layout = self.reference.state()
        tensors.update({f"reference/{n}": t for n, t in values.items()})
        return tensors, {"steps": self.steps, "communicated": self.communicated,
                         "reference_layout": layout}  # fmt: skip

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        self.pairwise.load_state(tensors, meta)
        saved = {k[len("reference/") :]: t for k, t in tensors.items()
                 if k.startswith("reference/")}  # fmt: skip
        # (a checkpoint of an older version holds the reference whole, in half precision)
        self.reference.load(saved, meta.get("reference_layout"))
        self.steps = int(meta.get("steps", 0))
        self.communicated = int(meta.get("communicated", 0))

    def model_replaced(self) -> None:
        self.pairwise.model_replaced()  # (its exchanges answered for the old model are over)
        self._reset_reference()

    def busy(self) -> bool:
        return self.pairwise.busy()

    def peer_disconnected(self, peer_id: str) -> None:
        self.pairwise.peer_disconnected(peer_id)

    def quiet(self, wait_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        return self.pairwise.quiet(wait_s)

    def _reset_reference(self) -> None:
        """The live model becomes the reference, written into the reference's own buffers (a new
        copy beside the old one was a whole model more at every exchange's end)."""
        self.ctx.trainer.update(self.reference.take)

    async def _reset_after_mix(self) -> None:
        await self.ctx.to_thread(self._reset_reference)

    async def after_step(self, result: StepResult) -> None:
        self.steps += 1
        pacer = self.pairwise.pacer
        pacer.observe_step(result.seconds)
        if not pacer.due(result.step):
            return
        pacer.mark(result.step)  # (checked: the next check is an interval later)
        trainer = self.ctx.trainer
        change = await self.ctx.to_thread(trainer.update, self.reference.relative_change)
        self.last_change = change
        if change <= self.ctx.settings.threshold:
            return
        if self.pairwise.start_exchange(result.step, on_mixed=self._reset_after_mix):
            self.communicated += 1

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        return await self.pairwise.handle(peer, header, payload)


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="selsync",
        runtime=Selsync,
        settings=SelsyncSettings,
        messages=(Exchange, ExchangeReply, ExchangeChunk, ExchangeChunkReply, ExchangeAbort),
        summary="an adpsgd exchange only when the model moved more than a threshold",
        # + the reference: the model in float32 up to reference_mb, a sample of that size beyond
        memory=lambda g, numel: adpsgd_copies(g.codec)
        + min(1.0, g.settings.reference_numel / max(1, numel)),
        averages_models=True,
    )
)
