# What the non-default algorithms (dpsgd, choco, diloco, selsync) get from the node, and the
# shape they give back. Invariants: a runtime owns its algorithm's state and its header types;
# it reaches the network only through `request` with a deadline, the model only through the
# trainer's lock; a peer's tensors are decoded within a size budget and checked before use;
# decode/encode/mix run in worker threads.
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import trio

import compress
from gossip._averaging import check_update
from gossip._links import LinkTable

from ._config import GossipConfig
from ._exchange import acceptable_codecs, decode_model
from ._messages import Header
from ._trainer import StepResult, Trainer
from ._transport import PeerInfo

Tensors = dict[str, torch.Tensor]


@dataclass
class AlgorithmContext:
    """The node's services an algorithm runtime uses (all owned by the node).

    trainer: the local model; config: the gossip section; links: link estimates;
    request: the transport's request function; live_peers / address_of: membership;
    choose_partner / choose_codec: the node's partner policy and per-link codec choice;
    record_outcome / record_busy: feedback to the partner policy; rng: the node's seeded Random;
    start_soon: starts a background task in the node's nursery.
    """

    trainer: Trainer
    config: GossipConfig
    links: LinkTable
    request: Callable[..., Any]
    live_peers: Callable[[], Sequence[str]]
    address_of: Callable[[str], str | None]
    choose_partner: Callable[[float], str | None]
    choose_codec: Callable[[str, float], str]
    record_outcome: Callable[[str, bool, float], None]
    record_busy: Callable[[str, float], None]
    rng: random.Random
    start_soon: Callable[..., None]

    def acceptable(self, spec: str) -> bool:
        """Whether a peer may make us encode with `spec`: our fixed codec or the dense ladder."""
        return spec in acceptable_codecs(self.config)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.trainer.params().values())

    def encode(self, tensors: Tensors, spec: str, seed: int = 0) -> bytes:
        return compress.encode_named(sorted(tensors.items()), compress.get_codec(spec), seed=seed)

    def decode(self, payload: bytes | memoryview, spec: str) -> Tensors:
        """Decode a peer's tensors made with `spec`: only that codec family, within the model's
        size budget (DecodeError when bad)."""
        return decode_model(payload, spec, self.numel, self.trainer.task_device)

    def decode_checked(self, payload: bytes | memoryview, spec: str) -> Tensors:
        """Decode (see `decode`) and check names, shapes, finiteness and norm against our model.

        Raises:
            DecodeError, RejectedUpdate: the peer sent something we must not use.
        """
        remote = self.decode(payload, spec)
        live = self.trainer.params()
        check_update(live, remote, max_norm_ratio=self.config.max_norm_ratio)
        return remote

    def now(self) -> float:
        return trio.current_time()

    def round_deadline(self, peer: str, nbytes: int) -> float:
        """The link's transfer deadline without the failure backoff (a round must not grow)."""
        cfg = self.links.config
        est = self.links.estimate(peer, self.now())
        seconds = cfg.deadline_factor * est.transfer_time(nbytes)
        seconds += cfg.deadline_rttvar_mult * est.rttvar_s
        return min(cfg.deadline_cap_s, max(cfg.deadline_floor_s, seconds))


class AlgorithmRuntime(Protocol):
    """One algorithm's runtime inside the node (see node/_algo_*.py)."""

    headers: tuple[type[Header], ...]  # the request types this runtime answers

    async def after_step(self, result: StepResult) -> None:
        """Called by the train loop after each step; may start or await an exchange."""

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        """Answer one of `headers` from a peer."""

    def state(self) -> tuple[Tensors, dict]:
        """Algorithm state for a checkpoint (tensors, JSON-able meta); called in a worker thread."""

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        """Restore what `state` returned."""

    def statistics(self) -> dict[str, float | int]:
        """Counters for status.json (`algorithm_stats`)."""

    def model_replaced(self) -> None:
        """The model was replaced wholesale (state sync): restart what depends on it."""
