# selsync: selective synchronization on top of the pairwise (AD-PSGD) exchange. Invariants: the
# threshold is checked every exchange_every steps against the model as it was after this node's
# last exchange (started or answered); an exchange is started only when the relative change
# passes the threshold and none is running; the exchange itself is adpsgd's, unchanged.
from __future__ import annotations

from dataclasses import dataclass, field

from geotrain.gossip import relative_change

from .._config import check_field
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
    """

    threshold: float = 0.01

    def __post_init__(self) -> None:
        check_field(self.threshold > 0, "gossip.selsync.threshold", self.threshold, "> 0")


@dataclass(frozen=True)
class SelsyncStatistics:
    steps: int
    communicated_steps: int
    comm_fraction: float = field(metadata={"gauge": True})  # communicated_steps / steps
    last_relative_change: float = field(metadata={"gauge": True})


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
        self.reference = ctx.trainer.snapshot()
        self.steps = self.communicated = 0
        self.last_change = 0.0

    def statistics(self) -> SelsyncStatistics:
        fraction = self.communicated / self.steps if self.steps else 0.0
        return SelsyncStatistics(self.steps, self.communicated, fraction, self.last_change)

    def state(self) -> tuple[Tensors, dict]:
        tensors, _ = self.pairwise.state()
        tensors.update({f"reference/{n}": t.clone() for n, t in self.reference.items()})
        return tensors, {"steps": self.steps, "communicated": self.communicated}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        self.pairwise.load_state(tensors, meta)
        device = self.ctx.trainer.task_device
        for key, t in tensors.items():
            if key.startswith("reference/"):
                self.reference[key[len("reference/") :]] = t.to(device)
        self.steps = int(meta.get("steps", 0))
        self.communicated = int(meta.get("communicated", 0))

    def model_replaced(self) -> None:
        self._reset_reference()

    def busy(self) -> bool:
        return self.pairwise.busy()

    def _reset_reference(self) -> None:
        self.reference = self.ctx.trainer.snapshot()

    async def _reset_after_mix(self) -> None:
        await self.ctx.to_thread(self._reset_reference)

    async def after_step(self, result: StepResult) -> None:
        self.steps += 1
        if result.step % self.ctx.gossip.exchange_every:
            return
        trainer = self.ctx.trainer
        change = await self.ctx.to_thread(
            lambda: trainer.update(lambda live: relative_change(live, self.reference))
        )
        self.last_change = change
        if change <= self.ctx.settings.threshold:
            return
        if self.pairwise.start_exchange(on_mixed=self._reset_after_mix):
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
        memory=lambda g: adpsgd_copies(g.codec) + 1.0,  # + the reference model
    )
)
