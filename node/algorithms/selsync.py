# selsync: selective synchronization on top of the pairwise (AD-PSGD) exchange. Invariants: the
# threshold is checked every exchange_every steps against the model as it was after this node's
# last exchange (started or answered); an exchange is started only when the relative change
# passes the threshold and none is running; the exchange itself is adpsgd's, unchanged.
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from geotrain.gossip import all_finite, relative_change

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

REFERENCE_F32_BELOW = 0.005  # thresholds this low keep the reference in float32


def reference_dtype(threshold: float) -> torch.dtype:
    return torch.float32 if threshold < REFERENCE_F32_BELOW else torch.float16


@dataclass(frozen=True)
class SelsyncSettings:
    """[gossip.selsync]

    threshold: relative model change ||w - w_last|| / ||w|| since the last exchange that
        triggers the next one (1% by default: on digits-mlp about a third of the checks pass
        early in training, far fewer later). The model as of the last exchange is kept in half
        precision (half a model of memory), whose rounding adds ~3e-4 to the measured change;
        below a threshold of REFERENCE_F32_BELOW it is kept in float32 (a whole model).
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
        self.reference: Tensors = {}
        self._reset_reference()
        self.steps = self.communicated = 0
        self.last_change = 0.0

    def statistics(self) -> SelsyncStatistics:
        fraction = self.communicated / self.steps if self.steps else 0.0
        return SelsyncStatistics(self.steps, self.communicated, fraction, self.last_change)

    def state(self) -> tuple[Tensors, dict]:
        tensors, _ = self.pairwise.state()
        tensors.update({f"reference/{n}": t for n, t in self.reference.items()})
        return tensors, {"steps": self.steps, "communicated": self.communicated}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        self.pairwise.load_state(tensors, meta)
        device = self.ctx.trainer.task_device
        for key, t in tensors.items():
            name = key[len("reference/") :]
            if key.startswith("reference/") and name in self.reference:
                ref = t.to(device, self.reference[name].dtype)
                # a tensor kept in float32 for half's range stays in it
                self.reference[name] = ref if all_finite(ref) else t.to(device).float()
        self.steps = int(meta.get("steps", 0))
        self.communicated = int(meta.get("communicated", 0))

    def model_replaced(self) -> None:
        self._reset_reference()

    def busy(self) -> bool:
        return self.pairwise.busy()

    def _reset_reference(self) -> None:
        """The live model becomes the reference, copied into the reference's own buffers (a new
        copy beside the old one was a whole model more at every exchange's end)."""
        dtype = reference_dtype(self.ctx.settings.threshold)

        def copy(live: Tensors) -> None:
            for name, t in live.items():
                ref = self.reference.get(name)
                if ref is None or ref.shape != t.shape or ref.device != t.device:
                    ref = self.reference[name] = torch.empty_like(t, dtype=dtype)
                ref.copy_(t.detach())
                if ref.dtype != torch.float32 and not all_finite(ref):  # beyond half's range
                    self.reference[name] = t.detach().float().clone()

        self.ctx.trainer.update(copy)

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
        # + the reference model, in half precision unless the threshold is tiny
        memory=lambda g: adpsgd_copies(g.codec)
        + reference_dtype(g.settings.threshold).itemsize / 4,
    )
)
