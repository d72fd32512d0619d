# State sync: a node that joins late fetches the current model from a live peer before its first
# step, and every node serves its model to such joiners. Invariants: a fetched model is decoded
# within the model's size budget and checked (names, shapes, finite) before it replaces ours; a
# failed fetch leaves our model as it was; a request of a node running another algorithm is
# refused; nothing here runs tensor work on the event loop.
from __future__ import annotations

import random

import structlog
import trio

from geotrain import compress
from geotrain.gossip import RejectedUpdate

from ._peer_choice import MembershipView
from ._protocol import StateReply, StateRequest
from .algorithms import Algorithm, Network, decode_model
from .training import Trainer
from .transport import ErrorReply, Header, PeerInfo, TransportError

STATE_SYNC_WAIT_S = 30.0  # how long a joiner keeps asking before it trains from scratch
log = structlog.get_logger()


class StateSync:
    """Both sides of state sync for one node.

    Args:
        trainer: the local model; algorithm: told when the model was replaced; algorithm_name:
            what this node runs (a joiner of another algorithm is refused).
        network: sends requests; membership: whom to ask; rng: the order they are asked in.
    """

    handles = (StateRequest,)

    def __init__(
        self,
        trainer: Trainer,
        algorithm: Algorithm,
        algorithm_name: str,
        network: Network,
        membership: MembershipView,
        rng: random.Random,
    ) -> None:
        self._trainer = trainer
        self._algorithm = algorithm
        self._name = algorithm_name
        self._network = network
        self._membership = membership
        self._rng = rng
        self._numel = sum(t.numel() for t in trainer.params().values())

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        assert isinstance(header, StateRequest)
        if header.algorithm != self._name:
            reason = f"this node runs {self._name}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        snapshot = await trio.to_thread.run_sync(self._trainer.snapshot)
        codec = compress.get_codec("none")
        data = await trio.to_thread.run_sync(
            lambda: compress.encode_named(sorted(snapshot.items()), codec)
        )
        return StateReply(step=self._trainer.step), data

    async def fetch(self, stop: trio.Event) -> bool:
        """Replace our model with a live peer's, asking one after another for up to
        STATE_SYNC_WAIT_S. Returns whether a model was fetched."""
        with trio.move_on_after(STATE_SYNC_WAIT_S):
            while not stop.is_set():
                peers = list(self._membership.live_peers())
                self._rng.shuffle(peers)
                for peer in peers:
                    address = self._membership.address_of(peer)
                    if address is None:
                        continue
                    step = await self._fetch_from(peer, address, deadline_s=30.0)
                    if step is not None:
                        log.info("state_synced", peer=peer[:12], peer_step=step)
                        await trio.to_thread.run_sync(self._algorithm.model_replaced)
                        return True
                await trio.sleep(0.2)
        log.warning("state_sync_skipped", reason="no peer answered; training from scratch")
        return False

    async def _fetch_from(self, peer: str, address: str, deadline_s: float) -> int | None:
        """Replace our model with `peer`'s. Returns the peer's step, or None when it failed."""
        trainer = self._trainer
        try:
            reply, payload, _ = await self._network.request(
                address,
                StateRequest(algorithm=self._name),
                b"",
                deadline_s=deadline_s,
                expect_peer=peer,
            )
            if not isinstance(reply, StateReply):
                reason = getattr(reply, "reason", "") or type(reply).__name__
                log.info("state_sync_failed", peer=peer[:12], reason=reason)
                return None
            remote = await trio.to_thread.run_sync(
                decode_model, payload, "none", self._numel, trainer.task_device
            )
            await trio.to_thread.run_sync(
                lambda: trainer.load_params(remote, max_norm_ratio=float("inf"))
            )
        except (TransportError, RejectedUpdate, compress.DecodeError) as exc:
            log.info("state_sync_failed", peer=peer[:12], reason=str(exc))
            return None
        return reply.step
