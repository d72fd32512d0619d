# selsync: selective synchronization on top of the pairwise (AD-PSGD) exchange. Invariants: the
# threshold is checked every exchange_every steps against the model as it was after this node's
# last exchange (started or answered); an exchange is started only when the relative change
# passes selsync_threshold and none is running; the rest is the adpsgd exchange unchanged.
from __future__ import annotations

import structlog
import trio

from gossip._algorithms import relative_change

from ._algorithm import AlgorithmContext, Tensors
from ._exchange import ExchangeService
from ._messages import Header
from ._protocol import Exchange, ExchangeReply
from ._trainer import StepResult
from ._transport import PeerInfo

log = structlog.get_logger()


class SelsyncRuntime:
    """Selective synchronization: an adpsgd exchange only when the model changed enough.

    Every `exchange_every` steps the relative change ||w - w_ref|| / ||w|| since the last
    exchange (started or answered) is compared with `selsync_threshold`; above it, a pairwise
    exchange starts. `statistics()` reports the fraction of steps at which one was started.

    Assumes: that small updates can wait (late training, flat regions). Trades: agreement between
    peers for fewer exchanges; with a high threshold the peers drift as if training alone.

    Args:
        ctx: the node's services.
        exchange: the node's pairwise exchange service (used as adpsgd uses it).
    """

    headers = (Exchange,)

    def __init__(self, ctx: AlgorithmContext, exchange: ExchangeService) -> None:
        self.ctx = ctx
        self.exchange = exchange
        self.reference = ctx.trainer.snapshot()
        self._running = False
        self.steps = self.communicated = 0
        self.last_change = 0.0

    def statistics(self) -> dict[str, float | int]:
        return {
            "steps": self.steps,
            "communicated_steps": self.communicated,
            "comm_fraction": self.communicated / self.steps if self.steps else 0.0,
            "last_relative_change": self.last_change,
        }

    def state(self) -> tuple[Tensors, dict]:
        return {f"reference/{n}": t.clone() for n, t in self.reference.items()}, {
            "steps": self.steps,
            "communicated": self.communicated,
        }

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        device = self.ctx.trainer.task_device
        for key, t in tensors.items():
            if key.startswith("reference/"):
                self.reference[key[len("reference/") :]] = t.to(device)
        self.steps = int(meta.get("steps", 0))
        self.communicated = int(meta.get("communicated", 0))

    def model_replaced(self) -> None:
        self._reset_reference()

    def _reset_reference(self) -> None:
        self.reference = self.ctx.trainer.snapshot()

    async def after_step(self, result: StepResult) -> None:
        self.steps += 1
        if result.step % self.ctx.config.exchange_every:
            return
        change = await trio.to_thread.run_sync(
            lambda: self.ctx.trainer.update(lambda live: relative_change(live, self.reference))
        )
        self.last_change = change
        if change <= self.ctx.config.selsync_threshold or self._running:
            return
        if not self.ctx.live_peers():
            return
        self.communicated += 1
        self._running = True
        self.ctx.start_soon(self._exchange)

    async def _exchange(self) -> None:
        try:
            if await self.exchange.exchange_once():
                await trio.to_thread.run_sync(self._reset_reference)
        finally:
            self._running = False

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        assert isinstance(header, Exchange)
        reply = await self.exchange.handle_exchange(peer, header, payload)
        if isinstance(reply[0], ExchangeReply):  # we mixed: our progress is shared
            await trio.to_thread.run_sync(self._reset_reference)
        return reply
