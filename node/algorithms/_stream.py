# A model as a stream of bounded chunks. Invariants: both ends derive the same chunk plan from the
# model's names and shapes and the chunk size (its digest travels in the first message, so ends
# that disagree find out before any tensor work); a chunk is at most `chunk_numel` elements, so no
# message, buffer or handler ever holds a whole uncompressed model it does not need; a received
# chunk is decoded within its own size, must name exactly the slices the plan says and be finite;
# a pairwise session never touches the live model before every chunk has arrived and the
# whole-model checks passed: until then the mix waits in one buffer of the model's size, so a
# rejected, timed-out or abandoned exchange leaves the model exactly as it was.
from __future__ import annotations

import functools
import hashlib
import math
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import (
    SLICE,
    ClipRadius,
    RejectedUpdate,
    all_finite,
    check_norm_ratio,
    clip_scale,
    distance_squared,
)

from .._peer_choice import PeerChoice
from ..training import ChunkStaging, Trainer
from ._base import Tensors

log = structlog.get_logger()
DEFAULT_CHUNK_BYTES = 8 * 2**20  # of float32: small enough to pipeline, big enough per round trip
CHUNKS_IN_FLIGHT = 4  # requests of one stream on the wire at once, at least
# ... and at most this many bytes of them one way (memory: each chunk in flight holds buffers of
# its size on both ends): on a long fat link the window grows with its bandwidth-delay product
WINDOW_BYTES = 64 * 2**20
# ... and, above WINDOW_FLOOR_BYTES, at most this share of the stream's bytes: with ~8 buffers a
# chunk in flight, the window's growth costs at most a quarter of a model copy (a 10^8 model
# keeps 32 MiB in flight whatever the link; a 10^9 one may keep 64 MiB)
WINDOW_SHARE = 1 / 32
WINDOW_FLOOR_BYTES = 32 * 2**20
# A chunk request spends about three round trips on the wire (its parts go, the reply's first part
# comes back, the rest of the reply is pulled): a stream keeps this many BDPs of chunks in flight.
BDP_ROUND_TRIPS = 3
INITIAL_WINDOW_BYTES = 10 * 1448  # TCP's initial window (RFC 6928), where slow start begins
FINE_CODECS = ("int8", "fp16", "bf16")  # dense codecs that round finely (no values dropped)
# A model above this, mixing pairwise in a fine codec or uncompressed, keeps its mix buffer in
# bfloat16. In a fine codec it keeps what it sent as the encoded chunk (decoded again when the
# peer's chunk comes): the mix is then x += w (Q(x_peer) - Q(x_sent)), the difference of what
# each end received from the other. Uncompressed, the difference x_peer - x_sent is taken in
# float32 and rounded into the buffer: the two ends' differences are exact negatives, and so
# are their roundings. Either way the pair's sum is kept exactly, and each value moves by its
# share of the difference to within bfloat16's 8 bits of mantissa (2^-9 of the difference, not
# of the value; int8 itself rounds each value to 1/254 of its slice's largest). This saves the
# float32 buffer (a whole model copy through every exchange) and a float32 copy of every chunk
# in flight: half a model copy at a 100M-parameter node's peak (python -m
# geotrain.node.bench.memory --late-joiner; the budget is 1.5 copies)
MIX_HALF_ABOVE_BYTES = 64 * 2**20
MAX_CHUNKS = 1 << 16  # the most chunks a plan may have: a peer cannot make us cut a model finely


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of tensor `name`, flattened."""

    name: str
    start: int
    stop: int

    @property
    def label(self) -> str:
        return f"{self.name}@{self.start}"

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ChunkPlan:
    """How a model is cut into chunks: consecutive slices of its tensors in name order, each chunk
    at most `chunk_numel` elements (small tensors share a chunk)."""

    chunks: tuple[tuple[Slice, ...], ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    chunk_numel: int
    digest: int  # of the shapes, chunk_numel and salt: equal plans have equal digests

    @classmethod
    def build(
        cls, shapes: Sequence[tuple[str, Sequence[int]]], chunk_numel: int, salt: int = 0
    ) -> ChunkPlan:
        """`salt`: more that peers must agree on to exchange (the digest of frozen parameters)."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel={chunk_numel}: expected >= 1")
        ordered = tuple(sorted((name, tuple(int(d) for d in shape)) for name, shape in shapes))
        expected = -(-sum(math.prod(shape) for _, shape in ordered) // chunk_numel)
        if expected > MAX_CHUNKS:
            raise ValueError(f"chunks of {chunk_numel} elements: {expected} chunks, at most "
                             f"{MAX_CHUNKS}")  # fmt: skip
        chunks: list[tuple[Slice, ...]] = []
        current: list[Slice] = []
        room = chunk_numel
        for name, shape in ordered:
            numel, start = math.prod(shape), 0
            if numel == 0:  # an empty tensor still travels (by name), so both ends have it
                current.append(Slice(name, 0, 0))
            while start < numel:
                take = min(room, numel - start)
                current.append(Slice(name, start, start + take))
                start += take
                room -= take
                if room == 0:
                    chunks.append(tuple(current))
                    current, room = [], chunk_numel
        if current or not chunks:
            chunks.append(tuple(current))
        key = (ordered, chunk_numel) if not salt else (ordered, chunk_numel, salt)
        h = hashlib.sha256(repr(key).encode()).digest()
        return cls(tuple(chunks), ordered, chunk_numel, int.from_bytes(h[:8], "big") >> 1)

    @classmethod
    def for_model(cls, params: Tensors, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ChunkPlan:
        return cls.build([(n, tuple(t.shape)) for n, t in params.items()], max(1, chunk_bytes // 4))

    def __len__(self) -> int:
        return len(self.chunks)

    @functools.cached_property
    def shape_of(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape by name."""
        return dict(self.shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes)

    def chunk_numel_of(self, index: int) -> int:
        return sum(s.numel for s in self.chunks[index])


def chunks_in_flight(rtt_s: float, bytes_per_s: float, chunk_bytes: int,
                     chunks: int | None = None) -> int:  # fmt: skip
    """Chunk requests of one stream to keep on the wire at once on a link of `rtt_s` round trip
    and `bytes_per_s` goodput: BDP_ROUND_TRIPS bandwidth-delay products of chunks and one more,
    at least CHUNKS_IN_FLIGHT, at most window_chunks of a stream of `chunks` chunks, and never
    more than its `chunks` (a window wider than the stream would stretch each chunk's deadline
    for bytes that never come). 1 Gbit/s at 150 ms and 8 MiB chunks: 8 for a 10^9 model, 4 for
    a 10^8 one (its window stays at 32 MiB); 100 Mbit/s at 80 ms: 4."""
    chunk_bytes = max(1, chunk_bytes)
    most = window_chunks(chunk_bytes, None if chunks is None else chunks * chunk_bytes)
    bdp = max(0.0, rtt_s) * max(0.0, bytes_per_s)
    width = max(CHUNKS_IN_FLIGHT, min(most, math.ceil(BDP_ROUND_TRIPS * bdp / chunk_bytes) + 1))
    return width if chunks is None else max(1, min(width, chunks))


def window_chunks(chunk_bytes: int, stream_bytes: int | None = None) -> int:
    """The most chunks of `chunk_bytes` a stream of `stream_bytes` (None: unknown) keeps in
    flight on any link (what the memory estimate counts): CHUNKS_IN_FLIGHT, or more while they
    stay within WINDOW_BYTES and, above WINDOW_FLOOR_BYTES, WINDOW_SHARE of the stream; never
    more than the stream has."""
    chunk_bytes = max(1, chunk_bytes)
    if stream_bytes is None:
        return max(CHUNKS_IN_FLIGHT, WINDOW_BYTES // chunk_bytes)
    cap = min(WINDOW_BYTES, max(WINDOW_FLOOR_BYTES, int(stream_bytes * WINDOW_SHARE)))
    chunks = -(-stream_bytes // chunk_bytes)
    return max(CHUNKS_IN_FLIGHT, min(cap // chunk_bytes, chunks))


def slow_start_s(rtt_s: float, nbytes: int) -> float:
    """Seconds TCP's slow start may add to moving `nbytes` on a fresh (or idle, where the
    kernel restarts it) connection: a round trip for each doubling of its window from the
    initial one. 64 MiB at 150 ms: 1.8 s."""
    return max(0.0, rtt_s) * max(0.0, math.log2(max(1, nbytes) / INITIAL_WINDOW_BYTES))


async def in_window(
    indices: Iterable[int],
    fetch: Callable[[int], Awaitable[None]],
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    width: int = CHUNKS_IN_FLIGHT,
) -> None:
    """Run `fetch(i)` for each index, `width` at a time; the first `catch` failure cancels the
    others and is raised here (not wrapped in an exception group)."""
    limit = trio.Semaphore(width)
    failure: list[BaseException] = []

    async def one(index: int) -> None:
        try:
            await fetch(index)
        except catch as exc:
            failure.append(exc)
            nursery.cancel_scope.cancel()
        finally:
            limit.release()

    async with trio.open_nursery() as nursery:
        for index in indices:
            await limit.acquire()
            if failure:
                break
            nursery.start_soon(one, index)
    if failure:
        raise failure[0]


class ChunkTimer:
    """Our own seconds of tensor work per chunk of a stream (encode, decode, check, mix),
    smoothed, and from it how long one chunk request may take. A deadline from the link alone
    knows nothing of the tensor work: with a big model on busy cores, choco's exchanges (one
    deadline for the whole stream, from the link's goodput) all ended in TooSlowError."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def observe(self, seconds: float) -> None:
        self.seconds = seconds if not self.seconds else 0.8 * self.seconds + 0.2 * seconds

    def deadline(self, peers: PeerChoice, peer: str, nbytes: int, now: float,
                 chunks: int | None = None) -> float:  # fmt: skip
        """Seconds a chunk request of `nbytes` each way may take: the link's deadline for the
        bytes of a whole window (the chunk may queue behind the window's others) and the slow
        start of a fresh connection's window, plus the tensor work of a window on both ends
        (each as long as ours)."""
        # (at least CHUNKS_IN_FLIGHT: a stream of fewer chunks keeps that slack for a busy box)
        width = max(CHUNKS_IN_FLIGHT, self.width(peers, peer, nbytes, now, chunks))
        window = width * 2 * nbytes
        compute = 2 * width * self.seconds
        rtt = peers.links.estimate(peer, now).rtt_s
        return peers.exchange_deadline(peer, window, now) + slow_start_s(rtt, window) + 2 * compute

    @staticmethod
    def width(peers: PeerChoice, peer: str, nbytes: int, now: float,
              chunks: int | None = None) -> int:  # fmt: skip
        """Chunks of about `nbytes` to keep in flight to `peer`, of a stream of `chunks` (see
        chunks_in_flight)."""
        est = peers.links.estimate(peer, now)
        return chunks_in_flight(est.rtt_s, est.goodput_bytes_per_s, nbytes, chunks)


PEER_CHUNK_HINT = "the asked node's network.peer_chunk_mb"
_SAID_DIFFER: weakref.WeakSet = weakref.WeakSet()  # the trainers (nodes) that warned it
MODELS_DIFFER = "models differ"  # how a refusal for another model's plan begins


def models_differ(trainer: Trainer) -> str:
    """Why a peer's request for a plan of another model is refused; warned once per node (the
    refusals alone went by at info level, and peers of other names trained alone unnoticed)."""
    if trainer not in _SAID_DIFFER:
        _SAID_DIFFER.add(trainer)
        log.warning("models_differ", hint="a peer asked to exchange a model of other parameter "
                    "names or shapes: neither mixes with the other. Every node must train the "
                    "same architecture under the same names (torch.compile adds '_orig_mod.', "
                    "DataParallel 'module.': join with the inner model), and freeze the same "
                    "parameters with the same values loaded before joining",
                    frozen_parameters=trainer.frozen_numel)  # fmt: skip
    return (f"{MODELS_DIFFER}: other parameter names or shapes, other frozen parameters or "
            "values (or a wrong chunk count)")


def plan_refusal(
    cache: dict[int, ChunkPlan], trainer: Trainer, chunk_numel: int, most: int, digest: int,
    chunks: int | None, index: int,
) -> tuple[ChunkPlan | None, str]:  # fmt: skip
    """A peer's request for chunk `index` of a plan: (our plan, "") when it is one we agree to,
    else (None, why not): chunks of 1..`most` elements, at most MAX_CHUNKS of them, the same
    digest (and chunk count when given), an index inside."""
    if not 1 <= chunk_numel <= most:
        return None, f"chunks of {chunk_numel} elements: expected 1..{most} ({PEER_CHUNK_HINT})"
    try:
        plan = cached_plan(cache, trainer, chunk_numel)
    except ValueError as exc:  # cut too finely
        return None, str(exc)
    if digest != plan.digest or (chunks is not None and chunks != len(plan)):
        return None, models_differ(trainer)
    if index >= len(plan):
        return None, f"chunk {index} of a {len(plan)}-chunk plan"
    return plan, ""


def cached_plan(cache: dict[int, ChunkPlan], trainer: Trainer, chunk_numel: int) -> ChunkPlan:
    """The plan of `trainer`'s model for `chunk_numel`, from `cache` (which keeps at most 4).

    Raises:
        ValueError: more than MAX_CHUNKS chunks.
    """
    plan = cache.get(chunk_numel)
    if plan is None:
        shapes = [(n, tuple(t.shape)) for n, t in trainer.params().items()]
        plan = ChunkPlan.build(shapes, chunk_numel, trainer.frozen_digest)
        while len(cache) >= 4:
            del cache[next(iter(cache))]
        cache[chunk_numel] = plan
    return plan


def read_chunk(trainer: Trainer, plan: ChunkPlan, index: int) -> list[tuple[Slice, torch.Tensor]]:
    """Copies of the live model's slices of chunk `index` (a read: beside a step's passes)."""

    def copy(live: Tensors) -> list[tuple[Slice, torch.Tensor]]:
        return [(s, live[s.name].reshape(-1)[s.start : s.stop].clone()) for s in plan.chunks[index]]

    return trainer.read(copy)


def read_chunk_encoded(
    trainer: Trainer, plan: ChunkPlan, index: int, seed: int = 0,
    staging: ChunkStaging | None = None,
) -> tuple[bytearray, list[torch.Tensor]]:  # fmt: skip
    """Chunk `index` of the live model read straight into an uncompressed payload (codec none,
    `seed`; a read: see Trainer.read): the bytes `encode_chunk(read_chunk(...), "none")` gives,
    with one copy of the values instead of two. Returns the payload and views of the values
    inside it (what was sent). With `staging` (a model on a device: the trainer's
    chunk_staging), the values come through its host buffer: the read only queues the copy,
    and this thread, not the training one, waits for it."""
    slices = plan.chunks[index]

    def sources(live: Tensors) -> list[torch.Tensor]:
        return [live[s.name].detach().reshape(-1)[s.start : s.stop] for s in slices]

    def fill(live: Tensors) -> tuple[bytearray, list[torch.Tensor]]:
        payload, views = compress.dense_named_payload(
            [(s.label, s.numel, live[s.name].dtype) for s in slices], seed=seed)
        for view, src in zip(views, sources(live), strict=True):
            view.copy_(src)
        return payload, views

    if staging is None:
        return trainer.read(fill)
    with staging.to_host() as copy:

        def start(live: Tensors) -> list[torch.dtype]:  # (the lock is held only for this)
            copy.start(sources(live))
            return [live[s.name].dtype for s in slices]

        dtypes = trainer.read(start)
        payload, views = compress.dense_named_payload(
            [(s.label, s.numel, dtype) for s, dtype in zip(slices, dtypes, strict=True)],
            seed=seed)  # fmt: skip
        for view, value in zip(views, copy.host(), strict=True):
            view.copy_(value)
    return payload, views


def encode_staged(slices: list[tuple[Slice, torch.Tensor]], seed: int,
                  staging: ChunkStaging) -> bytearray:  # fmt: skip
    """An uncompressed payload (codec none, `seed`) of chunk copies of our own (`slices`, on
    the model's device), their values brought through `staging`'s host buffer."""
    with staging.to_host() as copy:
        copy.start([t for _, t in slices])
        payload, views = compress.dense_named_payload(
            [(s.label, s.numel, t.dtype) for s, t in slices], seed=seed)
        for view, value in zip(views, copy.host(), strict=True):
            view.copy_(value)
    return payload


def model_chunk(model: Tensors, plan: ChunkPlan, index: int) -> list[tuple[Slice, torch.Tensor]]:
    """Views of chunk `index`'s slices of a model held apart (a published round, an update)."""
    return [(s, model[s.name].reshape(-1)[s.start : s.stop]) for s in plan.chunks[index]]


class SliceFeedback:
    """Error feedback for model streams: one residual per tensor (in `dtype`, made on first
    use), of which each chunk corrects and updates its slices. Residuals do not depend on how a
    model is cut, so peers with other chunk sizes, or a restart with another one, share them.

    Args:
        dtype: float16 (half a model of memory; a residual's rounding is ~1e-3 of itself) or
            float32.
    """

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        self.dtype = dtype
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def encode(self, slices: list[tuple[Slice, torch.Tensor]], spec: str, shapes: dict,
               seed: int = 0, owned: bool = False) -> bytes:  # fmt: skip
        """The chunk's payload of `slices` + their residuals; keeps what the codec dropped.
        `owned`: the slices are the caller's own copies, which may be overwritten (no
        temporaries of the chunk's size beyond the decoded payload)."""
        codec = compress.get_codec(spec)
        named = []
        corrected_all = []
        for s, t in slices:
            residual = self._residual(s.name, shapes[s.name], t.device).reshape(-1)
            r = residual[s.start : s.stop]
            if owned and t.dtype == torch.float32:
                corrected = t.add_(r)
            else:
                corrected = t.float() + r.float()
            named.append((s.label, corrected))
            corrected_all.append((s, corrected, residual))
        payload = compress.encode_named(named, codec, seed=seed)
        sent = compress.decode_named(payload, max_numel=sum(s.numel for s, _ in slices),
                                     device=slices[0][1].device if slices else "cpu")  # fmt: skip
        if codec.name == "fp16":  # the one codec that rounds a finite value to inf
            check_fp16_range(value for _, value in sent)
        for (s, corrected, residual), (_, value) in zip(corrected_all, sent, strict=True):
            residual[s.start : s.stop] = corrected.sub_(value.reshape(-1))  # ours: in place
        return payload

    def __bool__(self) -> bool:
        """Whether any residual is held."""
        return bool(self._residuals)

    def _residual(self, name: str, shape: tuple, device: torch.device) -> torch.Tensor:
        with self._lock:
            r = self._residuals.get(name)
            if r is None or tuple(r.shape) != tuple(shape):
                r = self._residuals[name] = torch.zeros(shape, dtype=self.dtype, device=device)
            return r

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock:
            return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._residuals = {n: r.detach().to(self.dtype).clone() for n, r in state.items()}

    def reset(self) -> None:
        with self._lock:
            self._residuals.clear()


def check_fp16_range(tensors: Iterable[torch.Tensor]) -> None:
    """Raise ValueError when a value is (or became) infinite in float16: beyond its +-65504, a
    peer would refuse the chunk, and an error-feedback residual or a mix of what we sent would
    turn infinite (NaN later) on our side."""
    for t in tensors:
        if not all_finite(t):
            raise ValueError("a value beyond float16's range (65504): use codec bf16 or int8")


def encode_chunk(
    slices: list[tuple[Slice, torch.Tensor]],
    spec: str,
    feedback: SliceFeedback | None = None,
    seed: int = 0,
    shapes: dict | None = None,
    owned: bool = False,
) -> bytes:
    """One chunk's payload: its slices, each named `name@start`, coded with `spec` (with error
    feedback when given; `shapes` then names every tensor's shape; `owned`: see
    SliceFeedback.encode)."""
    if feedback is not None:
        return feedback.encode(slices, spec, shapes or {}, seed, owned)
    named = [(s.label, t) for s, t in slices]
    return compress.encode_named(named, compress.get_codec(spec), seed=seed)


def decode_chunk(
    payload: bytes | bytearray | memoryview,
    spec: str,
    plan: ChunkPlan,
    index: int,
    device: torch.device,
    squares: list[float] | None = None,
    staging: ChunkStaging | None = None,
) -> list[torch.Tensor]:
    """A peer's chunk `index`: exactly the plan's slices, finite, decoded within its size.
    Uncompressed values on the CPU are views of `payload` when it is writable (a received
    message's own buffer): the caller reads them, or copies them before changing them.

    Args:
        squares: when given, each slice's squared L2 norm is appended to it (the finite check
            computes them: no extra pass for a caller that needs them).
        staging: the host buffer uncompressed values cross to `device` through (the trainer's
            chunk_staging, for a model on a device; a lossy codec's smaller payload is decoded
            on the device by its codec); the checks then run on the device.

    Raises:
        compress.DecodeError: not a payload of `spec`'s family or bigger than the chunk.
        RejectedUpdate: other slices than the plan's ("names", "shape") or NaN/inf ("nonfinite").
    """
    expected = plan.chunks[index]
    codec = compress.get_codec(spec)
    staged = staging is not None and codec.name == "none"
    pairs = compress.decode_named(
        payload,
        max_numel=plan.chunk_numel_of(index),
        device="cpu" if staged else device,
        allowed=compress.codec_family(codec),
        borrow=True,
    )
    if staged:  # (names and sizes are checked below, on the device's copies)
        assert staging is not None
        pairs = list(zip([label for label, _ in pairs],
                         staging.to_device([t for _, t in pairs]), strict=True))  # fmt: skip
    labels = [label for label, _ in pairs]
    if labels != [s.label for s in expected]:
        raise RejectedUpdate("names", f"chunk {index}: slices {labels[:3]} are not the plan's")
    out = []
    for s, (_, t) in zip(expected, pairs, strict=True):
        if t.numel() != s.numel:
            raise RejectedUpdate("shape", f"chunk {index}: {s.label} has {t.numel()} elements")
        if not t.is_floating_point():
            raise RejectedUpdate("nonfinite", f"chunk {index}: {s.label} is not floating point")
        out.append(t.reshape(-1).float())
    # NaN and inf carry into a norm: one multi-tensor pass checks every slice (a model with
    # hundreds of small tensors paid a Python round per slice); a norm that overflowed from
    # finite values is told apart by the exact check before anything is refused
    norms = squared_norms(out)
    for s, t, sq in zip(expected, out, norms, strict=True):
        if not math.isfinite(sq) and not all_finite(t):
            raise RejectedUpdate("nonfinite", f"chunk {index}: {s.label} holds NaN or inf")
    if squares is not None:
        squares.extend(norms)
    return out


def squared_norms(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's squared L2 norm, in one multi-tensor call."""
    if not tensors:
        return []
    return [n * n for n in torch.stack(torch._foreach_norm(tensors)).tolist()]


SMALL_SLICE = 1 << 16  # elements: slices up to this are mixed with multi-tensor calls


class SpareBuffers:
    """Model-sized buffers kept from one exchange for the next. Allocating a mix buffer afresh
    touches every page of it: for a 400 MB model ~100,000 page faults, about 0.2 s of system
    time per exchange, on the cores training needs. At most one buffer per tensor name is kept;
    what `take` hands out belongs to the taker until it `give`s it back (a failed exchange
    simply drops its buffers). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
        """A buffer of `shape` and `dtype` on `device` (its values are whatever it held)."""
        with self._lock:
            t = self._spare.pop(name, None)
        if (t is None or tuple(t.shape) != tuple(shape) or t.device != torch.device(device)
                or t.dtype != dtype):  # fmt: skip
            t = torch.empty(shape, device=device, dtype=dtype)
        return t

    def give(self, buffers: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._spare.update(buffers)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._spare.values())


class PairwiseMix:
    """One side of a streamed pairwise average: x += weight * (x_peer - x_sent), per chunk.

    Our chunk i is read from the live model when it is sent (`send`), the peer's chunk i is
    checked when it arrives (`receive`), and weight * (theirs - ours as sent) is kept in a buffer
    of the model's size; `commit` checks the whole (norm) and adds the buffer to the live model in
    one step under the trainer's lock. Dropping the object without `commit` changes nothing.
    A model above MIX_HALF_ABOVE_BYTES in a fine codec or codec none keeps the buffer in
    bfloat16: in a fine codec it mixes theirs - ours as the peer decoded it, uncompressed the
    float32 difference rounded (see there: `half`).

    With a sparse codec (top-k, random-k) only the values the peer sent are averaged; the ones it
    did not send decode as 0.0 and leave ours as they are (a value sent as exactly 0.0 is taken
    for one not sent: ours stays there too). Mixing those zeros in would pull most of the model
    halfway to zero at every exchange (`python -m geotrain.node.bench.codecs` measures sparse
    codecs' accuracy).

    Args:
        trainer: our model; plan: the chunk plan both ends agreed on; spec: the codec.
        feedback: error feedback for what we send (None: none kept; adpsgd keeps none for a
            sparse codec).
        weight: the peer's share; max_norm_ratio: refuse a peer model whose norm is above this
            multiple of ours (+1); clip: bound the distance one exchange may move us.
        radius: robust mixing's adaptive radius (gossip.robust); when given it decides the bound
            (`clip` is its cap) from the full difference's norm, summed over every chunk before
            anything is applied, so a streamed exchange clips exactly as a whole one would.
        spare: where the mix buffer comes from and goes back to after a commit (None: made
            afresh each time).
    """

    def __init__(
        self,
        trainer: Trainer,
        plan: ChunkPlan,
        spec: str,
        feedback: SliceFeedback | None,
        *,
        weight: float = 0.5,
        max_norm_ratio: float = 10.0,
        clip: float | None = None,
        seed: int = 0,
        radius: ClipRadius | None = None,
        spare: SpareBuffers | None = None,
    ) -> None:
        self.radius, self.spare = radius, spare
        self.trainer, self.plan, self.spec, self.feedback = trainer, plan, spec, feedback
        self.weight, self.max_norm_ratio, self.clip, self.seed = weight, max_norm_ratio, clip, seed
        self.device = trainer.task_device
        self.staging = trainer.chunk_staging("exchange")  # (None: the model is in host memory)
        self.sparse = compress.get_codec(spec).sparse
        self.half = mixes_in_half(spec, plan.numel)
        # chunk -> what we sent (until theirs came: its values, or with `half` its payload);
        # None while it is being encoded
        self.sent: dict[int, list[torch.Tensor] | bytes | None] = {}
        self.received: set[int] = set()
        self._lock = threading.Lock()  # chunks are sent and received from several threads
        self._delta: dict[str, torch.Tensor] = {}  # name -> (shape,) buffer, made as needed
        self._ours_sq = self._theirs_sq = self._diff_sq = 0.0

    @property
    def complete(self) -> bool:
        return len(self.received) == len(self.plan)

    def send(self, index: int) -> bytes:
        """Our chunk `index`, read from the live model now and encoded (a worker thread).

        Raises:
            ValueError: an index out of the plan or sent before; our model is not finite.
        """
        with self._lock:
            if not 0 <= index < len(self.plan) or index in self.sent or index in self.received:
                raise ValueError(f"chunk {index} of a {len(self.plan)}-chunk plan, or twice")
            self.sent[index] = None  # taken: being read and encoded
        if self.spec == "none" and self.feedback is None:
            if self.staging is None:  # host memory: read straight into the message
                payload, sent = read_chunk_encoded(self.trainer, self.plan, index,
                                                   self.seed + index)  # fmt: skip
                self.sent[index] = sent
                return payload
            # a device: what was sent stays there for the mix (a chunk's copy on the device),
            # and the message is made from it through the host buffer
            slices = read_chunk(self.trainer, self.plan, index)
            payload = encode_staged(slices, self.seed + index, self.staging)
            self.sent[index] = [t.float() for _, t in slices]
            return payload
        slices = read_chunk(self.trainer, self.plan, index)
        if self.half:  # the copies read are ours to overwrite: only the payload is kept
            if self.feedback is None and compress.get_codec(self.spec).name == "fp16":
                check_fp16_range(t.to(torch.float16) for _, t in slices)
            payload = encode_chunk(slices, self.spec, self.feedback, seed=self.seed + index,
                                   shapes=self.plan.shape_of, owned=True)  # fmt: skip
            self.sent[index] = payload
            return payload
        self.sent[index] = [t.float() for _, t in slices]
        return encode_chunk(slices, self.spec, self.feedback, seed=self.seed + index,
                            shapes=self.plan.shape_of)  # fmt: skip

    def receive(self, index: int, payload: bytes | bytearray | memoryview) -> bool:
        """Check the peer's chunk `index` and keep its share of the mix (a worker thread).

        Returns:
            True for the call that completed the model (commit then, once).

        Raises:
            RejectedUpdate, compress.DecodeError: the chunk is bad (the exchange must be dropped).
            ValueError: a chunk we did not send, or one received before.
        """
        with self._lock:
            ours = self.sent.get(index)
            if index in self.received or ours is None:
                raise ValueError(f"chunk {index}: already received, or not sent by us")
            del self.sent[index]
        theirs_sq: list[float] = []
        theirs = decode_chunk(payload, self.spec, self.plan, index, self.device, theirs_sq,
                              self.staging)  # fmt: skip
        slices = self.plan.chunks[index]
        with self._lock:
            diffs = [self._buffer(s.name).reshape(-1)[s.start : s.stop] for s in slices]
        if isinstance(ours, bytes):  # (self.half)
            return self._receive_half(index, ours, theirs, theirs_sq, diffs)
        if self.half:  # uncompressed: the exact difference, rounded into the bfloat16 buffer
            exact = [torch.sub(t, o) for t, o in zip(theirs, ours, strict=True)]
            torch._foreach_copy_(diffs, exact)
            return self._received(index, sum(squared_norms(ours)), sum(theirs_sq),
                                  sum(squared_norms(exact)))  # fmt: skip
        small = [i for i, s in enumerate(slices) if s.numel <= SMALL_SLICE]
        if small:  # many small tensors: a few multi-tensor calls, not a Python round per slice
            torch._foreach_copy_([diffs[i] for i in small], [theirs[i] for i in small])
            torch._foreach_sub_([diffs[i] for i in small], [ours[i] for i in small])
        for i, s in enumerate(slices):
            if s.numel > SMALL_SLICE:  # straight into the mix buffer: no temporary, one pass
                torch.sub(theirs[i], ours[i], out=diffs[i])
        if self.sparse:  # what the peer did not send moves nothing
            for diff, value in zip(diffs, theirs, strict=True):
                diff.masked_fill_(value == 0, 0.0)
        ours_sq, diff_sq = sum(squared_norms(ours)), sum(squared_norms(diffs))
        return self._received(index, ours_sq, sum(theirs_sq), diff_sq)

    def _received(self, index: int, ours_sq: float, theirs_sq: float, diff_sq: float) -> bool:
        """Count chunk `index` in (its squared norms); whether the model is complete now."""
        with self._lock:
            self._ours_sq += ours_sq
            self._theirs_sq += theirs_sq
            self._diff_sq += diff_sq
            self.received.add(index)
            return self.complete

    def _receive_half(self, index: int, ours: bytes, theirs: list[torch.Tensor],
                      theirs_sq: list[float], diffs: list[torch.Tensor]) -> bool:  # fmt: skip
        """`receive` with `half`: theirs - ours as the peer decoded it, into bfloat16."""
        # (our own payload: checked when it was encoded, within float16's range included)
        sent = [value.reshape(-1).float() for _, value in compress.decode_named(
            ours, max_numel=self.plan.chunk_numel_of(index), device=self.device)]  # fmt: skip
        ours_sq = sum(squared_norms(sent))
        for t, value in zip(theirs, sent, strict=True):
            t.sub_(value)  # a fine codec decodes into new tensors: ours to change
        diff_sq = sum(squared_norms(theirs))  # the exact difference, before it is rounded
        torch._foreach_copy_(diffs, theirs)
        return self._received(index, ours_sq, sum(theirs_sq), diff_sq)

    def _buffer(self, name: str) -> torch.Tensor:
        """Tensor `name`'s part of the mix buffer, made on first use (under the lock): every
        element is written before the commit reads it."""
        buffer = self._delta.get(name)
        if buffer is None:
            shape = self.plan.shape_of[name]
            dtype = torch.bfloat16 if self.half else torch.float32
            buffer = self._delta[name] = (
                torch.empty(shape, device=self.device, dtype=dtype) if self.spare is None
                else self.spare.take(name, shape, self.device, dtype))  # fmt: skip
        return buffer

    def commit(self) -> float:
        """Check the whole peer model's norm and mix it in (a worker thread).

        Returns:
            The L2 distance between the peer's model and ours as sent (before clipping).

        Raises:
            RejectedUpdate: its norm is too big; nothing was changed.
        """
        if not self.complete:
            raise ValueError(f"commit after {len(self.received)} of {len(self.plan)} chunks")
        check_norm_ratio(math.sqrt(self._theirs_sq), math.sqrt(self._ours_sq),
                         max_norm_ratio=self.max_norm_ratio)  # fmt: skip
        distance = math.sqrt(self._diff_sq)

        def apply(live: Tensors) -> None:
            # the radius is asked under the model's lock: concurrent exchanges' commits take
            # turns, so its window and counters see one update at a time
            scale = self.weight * (clip_scale(distance, self.clip) if self.radius is None
                                   else self.radius.factor(distance))  # fmt: skip
            for name, delta in self._delta.items():
                live[name].add_(delta.view_as(live[name]), alpha=scale)

        self.trainer.apply(apply)
        if self.spare is not None:
            self.spare.give(self._delta)
        self._delta = {}
        return distance


def mixes_in_half(spec: str, numel: int) -> bool:
    """Whether a pairwise mix of a float32 model of `numel` values in codec `spec` keeps its
    buffer in bfloat16 (MIX_HALF_ABOVE_BYTES)."""
    name = compress.get_codec(spec).name
    return name in (*FINE_CODECS, "none") and 4 * numel > MIX_HALF_ABOVE_BYTES


class _Arrivals:
    """What both assemblies share: the plan both ends agreed on, the codec and the device, and
    each chunk taken once and counted once it is in (thread-safe: chunks may be added from
    several worker threads at once; complete only when every chunk is in, so the last chunk to
    arrive does not report it complete while an earlier one is still being decoded)."""

    def __init__(self, plan: ChunkPlan, spec: str, device: torch.device) -> None:
        self.plan, self.spec, self.device = plan, spec, device
        self.received: set[int] = set()  # taken (being checked, or in)
        self._in = 0
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        return self._in == len(self.plan)

    def _take(self, index: int, payload: bytes | bytearray | memoryview) -> list[torch.Tensor]:
        """Claim chunk `index` and decode it (see decode_chunk).

        Raises:
            RejectedUpdate, compress.DecodeError: the chunk is bad.
            ValueError: an index out of the plan, or one received before.
        """
        with self._lock:
            if not 0 <= index < len(self.plan) or index in self.received:
                raise ValueError(f"chunk {index} of a {len(self.plan)}-chunk plan, or twice")
            self.received.add(index)
        return decode_chunk(payload, self.spec, self.plan, index, self.device)

    def _count_in(self) -> bool:
        """One more chunk is in; whether that completed the model."""
        with self._lock:
            self._in += 1
            return self.complete


class ModelAssembly(_Arrivals):
    """A peer's model (or update) arriving chunk by chunk, each checked as it comes, into one
    staging copy.

    Args:
        plan: the chunk plan both ends agreed on; spec: the codec; device: where it lands.
    """

    def __init__(self, plan: ChunkPlan, spec: str, device: torch.device) -> None:
        super().__init__(plan, spec, device)
        self.tensors: Tensors = {}

    def add(self, index: int, payload: bytes | bytearray | memoryview) -> bool:
        """Check chunk `index` and keep it (a worker thread). Returns whether that completed it.

        Raises:
            as `_take`.
        """
        values = self._take(index, payload)
        for s, t in zip(self.plan.chunks[index], values, strict=True):
            with self._lock:
                buffer = self.tensors.get(s.name)
                if buffer is None:
                    shape = self.plan.shape_of[s.name]
                    buffer = self.tensors[s.name] = torch.empty(shape, device=self.device)
            buffer.reshape(-1)[s.start : s.stop] = t
        return self._count_in()


def keep_unsent(model: Tensors, base: Tensors, spec: str) -> None:
    """A peer's whole model that came through `spec`: when that is a sparse codec (top-k,
    random-k), its values not sent (decoded as 0.0) take `base`'s in place, so that a mix toward
    it (x += w (model - base)) leaves them as they are, as PairwiseMix does. A slice at a time:
    no model-sized temporary."""
    if not compress.get_codec(spec).sparse:
        return
    for name, tensor in model.items():
        flat, ref = tensor.view(-1), base[name].reshape(-1)
        for start in range(0, flat.numel(), SLICE):
            part = flat[start : start + SLICE]
            part.copy_(torch.where(part == 0, ref[start : start + SLICE].to(part.dtype), part))


class EncodedAssembly(_Arrivals):
    """A peer's update arriving chunk by chunk, each checked as it comes (decoded once: the
    plan's slices, finite; its norm added up) and kept as it came: a lossy codec's chunks are a
    fraction of the values' bytes (int8 about a quarter, top-k 1% about 2%), codec none's are
    the values (the received buffers themselves, not copied), or, with a narrower `hold`
    codec, the values re-encoded in it as they come (checked, and counted in the norm, as they
    were sent). `slices` decodes them again where the update is used, one chunk at a time.

    Args:
        plan: the chunk plan both ends agreed on; spec: the codec; device: where values land.
        hold: a dense codec to keep chunks in when it takes fewer bytes than `spec`'s.
    """

    def __init__(self, plan: ChunkPlan, spec: str, device: torch.device,
                 hold: str | None = None) -> None:  # fmt: skip
        super().__init__(plan, spec, device)
        self._payloads: dict[int, bytes | bytearray | memoryview] = {}  # chunks that are in
        self._squares = 0.0
        narrower = hold is not None and value_share(hold) < value_share(spec)
        self.held_spec = hold if narrower else spec

    @property
    def norm(self) -> float:
        """The L2 norm of the chunks received (the whole update's once complete)."""
        return math.sqrt(self._squares)

    @property
    def nbytes(self) -> int:
        """The bytes held: what came over the wire, or its values in the `hold` codec."""
        return sum(len(p) for p in self._payloads.values())

    def add(self, index: int, payload: bytes | bytearray | memoryview) -> bool:
        """Check chunk `index` and keep it (a worker thread). Returns whether that completed it.

        Raises:
            as `_take`.
        """
        values = self._take(index, payload)
        squares = sum(float(torch.linalg.vector_norm(t)) ** 2 for t in values)
        if self.held_spec != self.spec:
            payload = encode_chunk(list(zip(self.plan.chunks[index], values, strict=True)),
                                   self.held_spec, seed=index)  # fmt: skip
        with self._lock:
            self._payloads[index] = payload
            self._squares += squares
        return self._count_in()

    def slices(self) -> Iterable[tuple[str, int, torch.Tensor]]:
        """(tensor name, offset of the first element, values) of every slice, a chunk decoded
        at a time (uncompressed values are views of the kept buffers: read them only)."""
        for index in range(len(self.plan)):
            values = decode_chunk(self._payloads[index], self.held_spec, self.plan, index,
                                  self.device)  # fmt: skip
            for s, t in zip(self.plan.chunks[index], values, strict=True):
                yield s.name, s.start, t

    def decoded(self) -> Tensors:
        """The whole update decoded into new tensors (a model's worth of float32)."""
        shapes = self.plan.shape_of
        out: Tensors = {}
        for name, offset, t in self.slices():
            if name not in out:
                out[name] = torch.empty(shapes[name], device=self.device)
            out[name].view(-1)[offset : offset + t.numel()] = t
        return out


@functools.lru_cache(maxsize=64)
def value_share(spec: str) -> float:
    """The bytes of 2^20 values encoded with `spec` over their float32 bytes."""
    numel = 2**20
    return compress.expected_nbytes_named([("t", (numel,))], compress.get_codec(spec)) / (4 * numel)


def update_slices(update: EncodedAssembly | Tensors) -> Iterable[tuple[str, int, torch.Tensor]]:
    """(name, offset, values) of an update held encoded or as tensors (each tensor whole)."""
    if isinstance(update, EncodedAssembly):
        return update.slices()
    return ((name, 0, t.reshape(-1)) for name, t in update.items())


def update_distance(update: EncodedAssembly | Tensors, reference: Tensors) -> float:
    """||update - reference|| (L2, every tensor), a slice of the update at a time."""
    return math.sqrt(sum(distance_squared(t, reference[n].view(-1)[i : i + t.numel()])
                         for n, i, t in update_slices(update)))  # fmt: skip
