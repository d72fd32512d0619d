# The contract between the node and an algorithm. Invariants: an algorithm owns its state, its
# message types, its settings table and its counters; it reaches the network only through
# `ctx.network.request` with a deadline, the swarm only through `ctx.peers`, the model only
# through the trainer's lock; a peer's tensors are decoded within the model's size budget and
# checked before use; encode/decode/mix run through `ctx.to_thread` (worker threads in a node,
# inline in deterministic tests).
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import trio

from geotrain import compress
from geotrain.gossip import ClipRadius, RejectedUpdate, check_update

from .._config import GossipConfig
from .._peer_choice import DENSE_LADDER, HALF_CODECS, PeerChoice
from ..training import StepResult, Trainer
from ..transport import Header, PeerInfo

Tensors = dict[str, torch.Tensor]
Reply = tuple[Header, bytes]
# codecs that carry every value (at most quantized): what a model, not a difference, travels in
# (compress's VALUE_CODECS are the narrower set a sparse codec's kept values may use)
MODEL_CODECS = ("none", "fp16", "bf16", "int8", "int4")


class Network(Protocol):
    """How an algorithm sends a request (the node's transport, or an in-memory one in tests)."""

    async def request(
        self,
        address: str,
        header: Header,
        payload: bytes | bytearray | memoryview = b"",
        *,
        deadline_s: float,
        expect_peer: str | None = None,
    ) -> tuple[Header, bytearray, PeerInfo]: ...


@dataclass(frozen=True)
class PeerExchangeStatistics:
    ok: int = 0
    failed: int = 0
    rejected: int = 0
    codec: str | None = None  # the codec of the latest exchange with this peer


@dataclass(frozen=True)
class ExchangeStatistics:
    """Exchanges of one node, whatever the algorithm: what `geotrain status` shows."""

    ok: int
    failed: int
    rejected: int
    peers: Mapping[str, PeerExchangeStatistics]
    rejected_by_reason: Mapping[str, int] = field(default_factory=dict)
    # seconds of the exchanges this node started that succeeded (adpsgd, selsync, choco): the
    # latest one's and the mean (None: none yet, or an algorithm that does not time them)
    last_s: float | None = None
    mean_s: float | None = None


class ExchangeCounters:
    """Exchange outcomes in total and per peer. Every algorithm fills one (`ctx.counters`).

    ok: an exchange (started or answered by us) that changed our model; failed: no usable answer
    in time; rejected: the peer's tensors failed validation and were not used, counted also by
    reason (`rejection_reason`: a RejectedUpdate's code, "decode" or "invalid").
    """

    def __init__(self) -> None:
        self._peers: dict[str, dict[str, Any]] = {}
        self.ok = self.failed = self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}
        self._timed = 0  # started exchanges that succeeded, timed: how many, their seconds
        self._timed_s = 0.0
        self._last_s: float | None = None

    def _peer(self, peer: str, codec: str | None) -> dict[str, Any]:
        entry = self._peers.setdefault(peer, {"ok": 0, "failed": 0, "rejected": 0, "codec": None})
        if codec is not None:
            entry["codec"] = codec
        return entry

    def record_ok(self, peer: str, codec: str | None, seconds: float | None = None) -> None:
        """An exchange that changed our model; `seconds`: how long one we started took."""
        self.ok += 1
        self._peer(peer, codec)["ok"] += 1
        if seconds is not None:
            self._timed += 1
            self._timed_s += seconds
            self._last_s = seconds

    def record_failed(self, peer: str, codec: str | None = None) -> None:
        self.failed += 1
        self._peer(peer, codec)["failed"] += 1

    def record_rejected(
        self, peer: str, codec: str | None = None, exc: BaseException | None = None
    ) -> None:
        self.rejected += 1
        self._peer(peer, codec)["rejected"] += 1
        reason = rejection_reason(exc)
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def statistics(self) -> ExchangeStatistics:
        peers = {p: PeerExchangeStatistics(**e) for p, e in self._peers.items()}
        return ExchangeStatistics(
            self.ok, self.failed, self.rejected, peers, dict(self.rejected_by_reason),
            self._last_s, self._timed_s / self._timed if self._timed else None,
        )  # fmt: skip


def rejection_reason(exc: BaseException | None) -> str:
    """A short, bounded code for why an update was rejected (a metric label)."""
    if isinstance(exc, RejectedUpdate):
        return exc.reason if exc.reason in REJECTION_REASONS else "other"
    if isinstance(exc, compress.DecodeError):
        return "decode"
    if isinstance(exc, ValueError):
        return "invalid"
    return "other"


REJECTION_REASONS = ("names", "shape", "dtype", "nonfinite", "norm")


ToThread = Callable[..., Awaitable[Any]]


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` on the event loop itself: for tests on a virtual clock (no thread can race it)."""
    return fn(*args)


# Chunks a node reads and codes at once for its exchanges (adpsgd, selsync, dpsgd: the
# context's `coding`): each holds a few buffers of the chunk's size while it works, and chunks
# worked on from many threads at once leave their buffers spread over malloc's arenas. Unbounded,
# the chunks in flight each way raise a large node's peak by about a quarter of a model copy
# and make an exchange no faster (python -m geotrain.node.bench.memory, .exchange). A core for
# each two, at most four
TENSOR_SLOTS = max(1, min(4, len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 2) // 2))  # (the cores we may run on)


@dataclass
class AlgorithmContext:
    """What the node hands an algorithm (all owned by the node).

    Attributes:
        trainer: the local model and optimizer (change it only through its methods).
        gossip: the [gossip] section; settings: this algorithm's own [gossip.<name>] table.
        peers: live peers, partner and codec choice, deadlines, outcome feedback.
        network: sends requests (the transport).
        rng: the node's seeded Random.
        start_soon: starts a background task in the node's nursery.
        to_thread: runs blocking tensor work (trio.to_thread.run_sync, or `inline` in tests).
        counters: exchange outcomes, read by the node's status.
        chunk_numel: elements per chunk of the model streams we start (network.chunk_mb).
        max_chunk_numel: the most a peer may ask for (what fits in one message).
        robust: the clipping radius of `gossip.robust` (made from the config when not given);
            every mix of a neighbour's difference asks it for tau and it counts what it clipped.
        coding: the node's TENSOR_SLOTS, held while a chunk is read and coded (`coded`).
    """

    trainer: Trainer
    gossip: GossipConfig
    settings: Any
    peers: PeerChoice
    network: Network
    rng: random.Random
    start_soon: Callable[..., None]
    to_thread: ToThread = trio.to_thread.run_sync
    counters: ExchangeCounters = field(default_factory=ExchangeCounters)
    chunk_numel: int = 2 * 2**20
    max_chunk_numel: int = 64 * 2**20
    # seconds of the machine's own clock, for measuring tensor work (which takes no time on a
    # virtual clock, where `now` stands still during it); tests pass a fixed one
    clock: Callable[[], float] = time.perf_counter
    robust: ClipRadius | None = None
    coding: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(TENSOR_SLOTS))

    def __post_init__(self) -> None:
        if self.robust is None:
            self.robust = ClipRadius(self.gossip.robust, cap=self.gossip.clip)

    async def coded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`to_thread(fn, *args)` holding one of the node's TENSOR_SLOTS: chunk reading and
        coding (`async with ctx.coding` for several calls in one slot)."""
        async with self.coding:
            return await self.to_thread(fn, *args)

    @property
    def numel(self) -> int:
        return self.peers.numel

    def now(self) -> float:
        return trio.current_time()

    def acceptable(self, spec: str) -> bool:
        """Whether a peer may make us encode with `spec`: our fixed codec, the dense ladder or a
        half-precision model's exact codec (any other spec would cost us work we never agreed
        to)."""
        return spec in {*DENSE_LADDER, *HALF_CODECS.values(), self.gossip.codec} - {"auto"}

    def encode(self, tensors: Tensors, spec: str, seed: int = 0) -> bytes:
        return compress.encode_named(sorted(tensors.items()), compress.get_codec(spec), seed=seed)

    def decode(self, payload: bytes | bytearray | memoryview, spec: str) -> Tensors:
        """Decode a peer's tensors made with `spec`: only that codec family, within the model's
        size budget (compress.DecodeError when bad)."""
        return decode_model(payload, spec, self.numel, self.trainer.task_device)

    def decode_checked(self, payload: bytes | bytearray | memoryview, spec: str) -> Tensors:
        """Decode (see `decode`) and check names, shapes, finiteness and norm against our model.

        Raises:
            DecodeError, RejectedUpdate: the peer sent something we must not use.
        """
        remote = self.decode(payload, spec)
        check_update(self.trainer.params(), remote, max_norm_ratio=self.gossip.max_norm_ratio)
        return remote


def decode_model(
    payload: bytes | bytearray | memoryview, spec: str, max_numel: int, device: torch.device
) -> Tensors:
    """Decode a peer's tensors made with `spec`: only that codec family, within `max_numel`
    (compress.DecodeError when bad)."""
    pairs = compress.decode_named(
        payload,
        max_numel=max_numel,
        device=device,
        allowed=compress.codec_family(compress.get_codec(spec)),
    )
    return dict(pairs)


class Algorithm:
    """One algorithm's runtime inside a node. Subclasses set `handles` and implement
    `after_step` and `handle`; the rest has defaults for algorithms without state.

    Args:
        ctx: the node's services.
    """

    handles: ClassVar[tuple[type[Header], ...]] = ()  # the request types this runtime answers
    _quiet = False  # a checkpoint is written: no exchange starts or is taken (quiet())

    def __init__(self, ctx: AlgorithmContext) -> None:
        self.ctx = ctx

    @property
    def counters(self) -> ExchangeCounters:
        return self.ctx.counters

    async def after_step(self, result: StepResult) -> None:
        """Called by the training driver after each local step; may start or await exchanges
        (it never waits on the network longer than one of its deadlines)."""
        raise NotImplementedError

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        """Answer one of `handles` from a peer. The payload view is valid during this call only."""
        raise NotImplementedError

    def state(self) -> tuple[Tensors, dict]:
        """Algorithm state for a checkpoint (tensors, JSON-able meta); called in a worker thread."""
        return {}, {}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        """Restore what `state` returned."""

    def statistics(self) -> object | None:
        """This algorithm's own counters (a frozen dataclass) for status, or None. Its numeric
        fields are counters that only grow (Prometheus: `geotrain_<algorithm>_<name>_total`),
        except those declared `field(metadata={"gauge": True})`: levels that go up and down."""
        return None

    def status_counters(self) -> dict[str, float | int]:
        """What status shows as algorithm_stats: `statistics()` and, under gossip.robust, robust
        mixing's counters (robust_clipped, robust_trimmed_rounds, ...)."""
        own = self.statistics()
        out = dataclasses.asdict(own) if own is not None else {}  # type: ignore[call-overload]
        if self.ctx.robust is not None and self.ctx.robust.active:
            out.update(dataclasses.asdict(self.ctx.robust.statistics()))
        return out

    def status_gauges(self) -> frozenset[str]:
        """The names in `status_counters` that are levels (gauges), not counts."""
        out = {f.name for f in _gauge_fields(self.statistics())}
        if self.ctx.robust is not None and self.ctx.robust.active:
            out.update(f.name for f in _gauge_fields(self.ctx.robust.statistics()))
        return frozenset(out)

    def model_replaced(self) -> None:
        """The model was replaced wholesale (state sync): restart what depends on it."""

    def peer_disconnected(self, peer_id: str) -> None:
        """The connection `peer_id` opened to us closed (it died, left or was cut off): drop
        what we hold for an exchange it was driving. Runs in the trio loop; must not block."""

    def busy(self) -> bool:
        """Whether an exchange this node started is still running (shutdown waits for it)."""
        return False

    @contextlib.asynccontextmanager
    async def quiet(self, wait_s: float) -> AsyncIterator[None]:
        """Around a checkpoint's write (which holds the model lock for seconds at 10^8: an
        exchange's chunks wait on it and its partner's deadline passes): start or take no new
        exchange (`_quiet` set: the runtime's own checks), and first let those in flight end
        (`_in_flight`, at most `wait_s`). Nothing waits by default."""
        self._quiet = True
        try:
            with trio.move_on_after(wait_s):
                while self._in_flight():
                    await trio.sleep(0.02)
            yield
        finally:
            self._quiet = False

    def _in_flight(self) -> bool:
        """Whether an exchange that reads the live model runs (quiet() waits for it to end)."""
        return False


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the node needs to know about one algorithm; registered by its module.

    Attributes:
        name: the `gossip.algorithm` value.
        runtime: builds the runtime from the node's context.
        settings: the frozen dataclass of its [gossip.<name>] table (validated in __post_init__,
            every field with a default), or None when it has no settings of its own.
        messages: every header type it sends or answers (registered with the transport).
        summary: one line for help texts.
        memory: the most model copies it keeps beyond a plain training loop, for a gossip config
            (its settings and codec) and the model's parameter count; the node's memory budget
            is checked with it. None: unknown (nothing is checked).
        fit: for an algorithm whose memory grows with a setting, the gossip config with that
            setting lowered so that it keeps at most the given model copies, for a model of the
            given parameter count (None: it cannot).
        averages_models: it mixes whole models (not differences or updates), which want a codec
            that carries every value (MODEL_CODECS): the node warns about another fixed codec.
    """

    name: str
    runtime: Callable[[AlgorithmContext], Algorithm]
    settings: type | None
    messages: tuple[type[Header], ...]
    summary: str
    memory: Callable[[GossipConfig, int], float] | None = None
    fit: Callable[[GossipConfig, float, int], GossipConfig | None] | None = None
    averages_models: bool = False

    def default_settings(self) -> Any:
        return self.settings() if self.settings is not None else None


def _gauge_fields(stats: object | None) -> list[dataclasses.Field]:
    if stats is None or not dataclasses.is_dataclass(stats):
        return []
    return [f for f in dataclasses.fields(stats) if f.metadata.get("gauge")]
