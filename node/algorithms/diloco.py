# diloco: local SGD with an outer Nesterov step on gossip-averaged pseudo-gradients.
# Invariants: the model moves by the outer step only at round ends (every inner_steps steps, or as
# many as comm_fraction asks for, measured again every round), from
# the round's starting parameters; a round end waits at most the partners' link deadlines (late
# or missing partners are left out, never waited for beyond that); each peer's pseudo-gradient of
# a round is used at most once and only if at most max_staleness rounds old (gossip's
# fresh_deltas); pseudo-gradients from peers are decoded within the model's size budget and
# checked first; every consensus_every rounds the outer parameters are averaged pairwise with one
# of the round's partners, both ends alike (each at its next outer step), so the models agree.
from __future__ import annotations

import dataclasses
import functools
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import (
    SLICE,
    ClipRadius,
    NesterovOuter,
    RejectedUpdate,
    check_norm_ratio,
    fresh_deltas,
    params_norm,
    pseudo_gradient,
    robust_average,
    robust_scales,
    trim_count,
)

from .._allocator import RELEASE_ABOVE_BYTES, release_free_memory
from .._config import GossipConfig, check_field, check_types
from .._log_quota import log_within_quota
from ..training import StepResult
from ..transport import U63, CodecSpec, ErrorReply, Header, PeerInfo, TransportError
from ._base import MODEL_CODECS, Algorithm, AlgorithmContext, AlgorithmSpec, Reply, Tensors
from ._diloco_rounds import RoundClock, SitOuts
from ._registry import register_algorithm
from ._stream import (
    FINE_CODECS,
    ChunkPlan,
    EncodedAssembly,
    SliceFeedback,
    cached_plan,
    encode_chunk,
    in_window,
    model_chunk,
    plan_refusal,
    update_distance,
    update_slices,
    value_share,
)

Update = EncodedAssembly | Tensors  # a peer's update: as it came, or (tests) as tensors


class _Refused(Exception):
    """A partner answered an offer's chunk with something else than a chunk."""


class _Declined(_Refused):
    """A partner declined an offer as busy (it holds as many updates as it may): it sits out
    the next round, its link not counted as failed."""


class _Stale(_Refused):
    """Our update was asked for as the outer step wrote the next round start over it."""


class _Full(Exception):
    """We hold as many peers' updates as fanout allows: an offer is declined as busy (its
    sender's fanout may be larger than ours, e.g. ours fitted to the memory), not rejected."""


log = structlog.get_logger()


class _ChunkOffer(Header, frozen=True):
    """One chunk of a model-shaped payload: `chunks` such requests under one `xid`, cut by the
    plan whose digest is `plan` (chunks of at most `chunk_numel` elements; both ends must
    agree), coded with `codec`; `round` counts the sender's outer steps."""

    codec: CodecSpec
    round: U63
    xid: U63
    plan: U63
    chunk_numel: U63
    chunks: U63
    index: U63


class DeltaOffer(_ChunkOffer, frozen=True, tag="delta_offer"):
    """The payload is chunk `index` of the sender's pseudo-gradient of outer round `round`;
    answered with the same chunk of the responder's latest pseudo-gradient, or with nothing
    (round 0) when that is not newer than round `have`, the sender's newest of the responder's
    updates (held or used): nobody sends an update twice. `steps`: the inner steps the update
    took (0: not said; taken as a whole round), its weight in the mean. (Nodes from before it
    refuse a header with it: headers refuse fields they do not know.)"""

    have: U63 = 0
    steps: U63 = 0
    round_ms: U63 = 0  # how long those steps took, in milliseconds (0: not said)


class DeltaReply(Header, frozen=True, tag="delta_reply"):
    """A chunk of the responder's latest pseudo-gradient (round 0, empty: it has none yet);
    `steps` and `round_ms` as in DeltaOffer."""

    round: U63
    steps: U63 = 0
    round_ms: U63 = 0


class OuterOffer(_ChunkOffer, frozen=True, tag="outer_offer"):
    """Chunk `index` of the sender's outer parameters after `round` outer steps (consensus), in
    a dense codec; answered with the same chunk of the responder's outer parameters (busy while
    its own outer step changes them). Rounds may differ: as in AD-PSGD, a peer behind (a
    straggler, a late joiner) is pulled toward the rest.
    """


class OuterReply(Header, frozen=True, tag="outer_reply"):
    """The asked chunk of the responder's outer parameters, after `round` outer steps."""

    round: U63


DENSE_CODECS = MODEL_CODECS  # codecs that can carry parameters
# Four thresholds trade exactness for memory on large models (python -m geotrain.node.bench.memory
# measures a node's peak in model copies beyond a plain loop; diloco's budget is 2.5):
#
# A model up to this keeps its own update between rounds (to answer partners whose rounds end
# later); a bigger one drops it after its outer step (its encoded chunks, with a lossy codec,
# still answer offers in that codec): a whole model held through every inner step otherwise
KEEP_UPDATE_BYTES = 64 * 2**20
# A model above this holds the peers' updates that came with codec none in bfloat16 from the
# moment each chunk is checked (its norm is the exact one) until its outer step: half a model
# copy per update instead of one. bfloat16 keeps 8 bits of mantissa, far finer than an int8
# update's own rounding
HOLD_HALF_ABOVE_BYTES = 64 * 2**20
# A model above this keeps its outer momentum in bfloat16: half a model copy saved through every
# inner step and at the round end's peak. The outer step's arithmetic stays float32 (the buffer
# is widened slice by slice); each stored value is rounded to 8 bits of mantissa per step, which
# moves the round start less than the bfloat16 holding above and far less than an int8 update's
# own rounding
MOMENTUM_HALF_ABOVE_BYTES = 64 * 2**20
# A model above this sends its update in a codec that rounds finely (FINE_CODECS) without error
# feedback, whose residual would be half a model copy (float16) held through every inner step
# and at the round end. int8 then rounds stochastically (unbiased: what a round loses to
# rounding is noise around zero, not a drift; our own update is always used exact), seeded per
# node so that partners' rounding noise averages out. Coarse codecs (int4, sign, the sparse
# ones) keep their feedback: they drop too much for rounding alone
FEEDBACK_FINE_UP_TO_BYTES = 64 * 2**20


@dataclass(frozen=True)
class DilocoSettings:
    """[gossip.diloco]

    inner_steps: H, local steps per outer round.
    outer_lr / outer_momentum: the outer Nesterov SGD (DiLoCo's published 0.7 / 0.9).
    fanout: most peers a pseudo-gradient is sent to per outer round.
    max_staleness: a peer's pseudo-gradient at most this many rounds older than ours is used (a
        slower peer's updates still count).
    consensus_every: every this many outer rounds a node averages its outer parameters with
        one of the round's partners (both move halfway, each at its next outer step), which
        keeps the swarm on one model, stragglers and late joiners included; 0: never (the
        models drift apart as nodes average different sets of updates). Costs one model in
        consensus_codec each way.
    consensus_codec: the codec of those parameters: a dense one (none, fp16, bf16, int8, int4).
    comm_fraction: adaptive rounds: 0 keeps inner_steps fixed; above 0 the node sets its inner
        steps after every round so that a round end (offers, swap, outer step: the time its
        training waits) takes at most this fraction of the round's compute: H = round-end
        seconds / (comm_fraction x seconds per step), at least inner_steps, at most
        max_inner_steps. A slower link or a faster step gives longer rounds, and back.
    max_inner_steps: the most inner steps adaptive rounds may take.
    catch_up: a peer ends its round early when a partner's update of a whole round comes while
        it is at most halfway through its own (between a tenth and half of its inner steps):
        it is the slow one, and it takes the swarm's progress now instead of at its own round
        end, H of its slow steps later (a 4x straggler would wait 4 rounds of the others). Every
        update is weighted by the inner steps it took (capped at a whole round of ours), so
        such a short round counts for what it did. False: rounds of inner_steps only.
    round_s: 0: rounds count steps only. Above 0 a round also ends once its inner steps have
        taken this many seconds (the steps' own time: a daemon's evaluations and checkpoints are
        not counted; with at least a tenth of inner_steps done): a slow peer then ends its
        rounds about as often as the fast ones, each time taking a partner's newest whole round
        in the reply to its offer, instead of waiting to be drawn by one (catch_up) or for its
        own H slow steps. Set it a little above what inner_steps take a peer of the usual speed:
        below that, a round ends before the partners have a newer round to give, and the fast
        peers' rounds are cut short too (more outer steps and bytes). The steps' weights keep a
        short round from counting for more than it did. "auto": AUTO_ROUND_MARGIN x the swarm's
        usual time for inner_steps: the upper median over partners of the seconds per step of
        their latest update we took (its offer or reply says its steps and their milliseconds),
        each forgotten after PACE_ROUNDS of that partner's rounds, so it is armed by the first
        update a node takes; off until then. Not with comm_fraction, which sets the rounds'
        length itself (docs/benchmarks.md measures it on geo3).
    """

    inner_steps: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fanout: int = 8
    max_staleness: int = 4
    consensus_every: int = 4
    consensus_codec: str = "int8"
    comm_fraction: float = 0.0
    max_inner_steps: int = 1000
    catch_up: bool = True
    round_s: float | str = 0.0

    def __post_init__(self) -> None:
        check_types(self, "gossip.diloco")
        check_field(self.inner_steps >= 1, "gossip.diloco.inner_steps", self.inner_steps, ">= 1")
        check_field(self.outer_lr > 0, "gossip.diloco.outer_lr", self.outer_lr, "> 0")
        check_field(0 <= self.outer_momentum < 1, "gossip.diloco.outer_momentum",
                    self.outer_momentum, "0 <= momentum < 1")  # fmt: skip
        check_field(self.fanout >= 1, "gossip.diloco.fanout", self.fanout, ">= 1")
        check_field(self.max_staleness >= 0, "gossip.diloco.max_staleness", self.max_staleness,
                    ">= 0")  # fmt: skip
        check_field(isinstance(self.consensus_every, int) and self.consensus_every >= 0,
                    "gossip.diloco.consensus_every", self.consensus_every,
                    ">= 0 (0: off)")  # fmt: skip
        check_field(self.consensus_codec in DENSE_CODECS, "gossip.diloco.consensus_codec",
                    self.consensus_codec, f"one of {DENSE_CODECS}")  # fmt: skip
        check_field(isinstance(self.comm_fraction, int | float) and 0 <= self.comm_fraction < 1,
                    "gossip.diloco.comm_fraction", self.comm_fraction,
                    "0 (fixed rounds) or a fraction in (0, 1)")  # fmt: skip
        check_field(self.max_inner_steps >= self.inner_steps, "gossip.diloco.max_inner_steps",
                    self.max_inner_steps, f">= inner_steps ({self.inner_steps})")  # fmt: skip
        check_field(isinstance(self.catch_up, bool), "gossip.diloco.catch_up", self.catch_up,
                    "true or false")  # fmt: skip
        check_field(self.round_s == "auto" or (
            isinstance(self.round_s, int | float) and not isinstance(self.round_s, bool)
            and math.isfinite(self.round_s) and self.round_s >= 0), "gossip.diloco.round_s",
            self.round_s, 'seconds >= 0 (0: rounds of inner_steps only), or "auto"')  # fmt: skip
        check_field(not (self.round_s and self.comm_fraction), "gossip.diloco.round_s",
                    self.round_s, "0 with comm_fraction (adaptive rounds set their own length; "
                    "one or the other)")  # fmt: skip


def wire_share(codec: str) -> float:
    """The bytes of a model encoded with `codec` over its float32 bytes (1 for "auto": it may
    choose none), measured on a 2^20-element tensor."""
    return 1.0 if codec in ("auto", "none") else value_share(codec)


def hold_codec(codec: str, numel: int) -> str | None:
    """What peers' updates that come in a wider codec are held in (None: as they came): our
    own fixed codec when it is a dense one (a peer running `auto` may send codec none, which
    a node that chose int8 would otherwise hold whole), else bfloat16 above
    HOLD_HALF_ABOVE_BYTES."""
    if codec in DENSE_CODECS and codec != "none":
        return codec
    return "bf16" if 4 * numel > HOLD_HALF_ABOVE_BYTES else None


def update_encoding(spec: str, numel: int) -> tuple[str, bool]:
    """How a round end's update negotiated as `spec` is encoded for a float32 model of `numel`
    values: (the spec it is encoded with, whether error feedback applies). Above
    FEEDBACK_FINE_UP_TO_BYTES a fine codec goes without feedback, int8 rounding stochastically
    (the same codec on the wire: the receiver decodes it the same way)."""
    if 4 * numel <= FEEDBACK_FINE_UP_TO_BYTES or spec == "none":
        return spec, True
    codec = compress.get_codec(spec)
    if codec.name not in FINE_CODECS:
        return spec, True
    if codec.name == "int8" and not codec.stochastic:
        return dataclasses.replace(codec, stochastic=True).spec, False
    return spec, False


def momentum_dtype(numel: int) -> torch.dtype | None:
    """What the outer momentum of a float32 model of `numel` values is held in (None: float32)."""
    return torch.bfloat16 if 4 * numel > MOMENTUM_HALF_ABOVE_BYTES else None


def held_share(codec: str, numel: int) -> float:
    """The most bytes a peer's update takes as held, over a model's float32 bytes: peers may
    send any codec of the dense ladder, which is held in `hold_codec` when that is narrower."""
    hold = hold_codec(codec, numel)
    return 1.0 if hold is None else wire_share(hold)




@dataclass(frozen=True)
class DilocoStatistics:
    outer_steps: int
    peer_deltas_used: int
    partners_missing: int
    consensus_mixes: int = 0  # partners' outer parameters averaged in
    # this round's inner steps (comm_fraction adapts them)
    inner_steps: int = field(default=0, metadata={"gauge": True})
    catch_ups: int = 0  # rounds ended early to take a faster partner's update (catch_up)
    timed_rounds: int = 0  # rounds ended early by round_s
    # the seconds after which a round ends by time (round_s, or what "auto" measured; 0: never)
    round_budget_s: float = field(default=0.0, metadata={"gauge": True})


class Diloco(Algorithm):
    """DiLoCo-style local SGD: H inner steps, then an outer Nesterov step on averaged updates.

    At a round end the pseudo-gradient (round start minus now) is encoded once (error feedback
    keeps what the codec dropped, except for a big model in a fine codec: update_encoding),
    offered to up to `fanout` live peers, and averaged with the
    peers' pseudo-gradients that arrived (replies, or offers pushed to us) within the deadline and
    at most `max_staleness` rounds old; the outer optimizer then moves the round's start and the
    model restarts there.

    Assumes: a small, well-connected group whose models start equal (same seed): only updates
    are averaged, never models, so models drift apart when nodes average different sets.
    Trades: agreement for H-fold fewer, compressible messages; a round end waits at most one
    deadline, and late partners are left out.
    """

    handles = (DeltaOffer, OuterOffer)

    def __init__(self, ctx: AlgorithmContext) -> None:
        super().__init__(ctx)
        cfg = ctx.settings
        self.outer = NesterovOuter(cfg.outer_lr, cfg.outer_momentum,
                                   momentum_dtype(ctx.peers.numel))  # fmt: skip
        self.start = ctx.trainer.snapshot()  # the parameters this outer round started from
        self.round = 0  # outer rounds completed
        # our latest update: (round, its chunks encoded with `codec`, codec), and its values;
        # codec none keeps no chunks (each is the values' bytes, encoded when asked)
        self.latest: tuple[int, list[bytes], str] = (0, [], "")
        self.latest_delta: Tensors | None = None
        self._keep_update = 4 * ctx.peers.numel <= KEEP_UPDATE_BYTES
        # peers' updates that came in a wider codec than ours (or uncompressed, to a big model)
        self._hold = hold_codec(ctx.gossip.codec, ctx.peers.numel)
        # a big model whose training waits for the round end (the daemon's) writes its update
        # over the round start (start - live: one model copy less at the round end, the
        # peak) and takes the outer step from there; a loop of the user's own keeps stepping
        # meanwhile, so it needs the live model at the round end, which the update copy keeps
        self._in_place = not self._keep_update and not getattr(
            ctx.trainer, "steps_beside_algorithm", True)
        self._start_holds_delta = False  # self.start is our update now (start = it + live)
        self._start_lock = threading.Lock()  # reads of self.start against its changes
        # peers' updates held as they came over the wire (a lossy codec's are a fraction of a
        # model), decoded a chunk at a time in the outer step
        self.inbox: dict[str, tuple[int, Update]] = {}
        self.used: dict[str, int] = {}
        self._incoming: dict[str, tuple[int, int, EncodedAssembly]] = {}  # peer -> xid, round
        self._last_chunk: dict[str, float] = {}  # peer -> when a chunk of its offer came last
        self._plans: dict[int, ChunkPlan] = {}
        self.feedback = SliceFeedback(torch.float16)
        # stochastic rounding's seeds (see update_encoding): this node's own, so that partners'
        # rounding noise is independent, from its seeded stream (a run repeats) without drawing
        # from it (the partner choices stay as they were)
        twin = random.Random()
        twin.setstate(ctx.rng.getstate())
        self._seed_base = twin.getrandbits(31)
        self._rejected_now: set[str] = set()  # partners whose update this round was refused
        self._declined_now: set[str] = set()  # partners that declined this round's offer (busy)
        self.sit_outs = SitOuts()  # partners that failed or declined sit out rounds
        self._replied: dict[str, int] = {}  # partner -> the round of its update this round end
        # offers crossing at a round end (both partners offer at once): each update travels in
        # its own offer only, and the replies carry none (else each went twice: bytes, memory)
        self._offering: dict[str, int] = {}  # partner -> our round our offer to it is sending
        self._answering: dict[str, tuple[int, int]] = {}  # partner -> its offer's xid, our
        # round the replies to it carry (0: none)
        self._crossed: set[str] = set()  # this round end's partners whose update comes with
        # their own offer (ours crossed it, or went in our replies to it)
        self._arrived = trio.Event()  # set (and replaced) when an offer to us ends or is dropped
        self.outer_steps = self.peer_deltas_used = self.missing = self.consensus_mixes = 0
        # consensus: partners' outer parameters to average in at our next outer step (with the
        # outer steps they had made); one offer of a peer's held while it arrives
        self.consensus: dict[str, tuple[int, Update]] = {}
        self._outer_in: tuple[str, int, int, EncodedAssembly] | None = None  # peer, xid, round
        self._stepping = False  # the outer step is changing self.start: answer no consensus
        # the inner steps peers' updates took: (peer, its round) -> steps (0: not said)
        self._steps_of: dict[tuple[str, int], int] = {}
        self.rounds = RoundClock(ctx.settings)  # when rounds end (sans-I/O)
        rule = ctx.gossip.robust
        self._consensus_radius = ClipRadius("none" if rule == "none" else "clip",
                                            cap=ctx.gossip.clip)  # fmt: skip

    def statistics(self) -> DilocoStatistics:
        return DilocoStatistics(self.outer_steps, self.peer_deltas_used, self.missing,
                                self.consensus_mixes, self.inner_steps,
                                self.rounds.catch_ups, self.rounds.timed_rounds,
                                self.round_budget_s())  # fmt: skip

    @property
    def inner_steps(self) -> int:
        """This round's inner steps (adaptive rounds change them)."""
        return self.rounds.inner_steps

    def round_budget_s(self) -> float:
        """The seconds after which a round ends by time (0: never; RoundClock.budget_s)."""
        return self.rounds.budget_s(self.ctx.now())

    def state(self) -> tuple[Tensors, dict]:
        # (no copies: a checkpoint is written under the trainer's lock, and the round start and
        # outer momentum change only under it, in the outer step; two model copies saved)
        tensors = {f"start/{n}": t for n, t in self.start.items()}
        if self._start_holds_delta:  # (not between steps: the round end restores it first)
            live = self.ctx.trainer.params()
            tensors = {f"start/{n}": t + live[n] for n, t in self.start.items()}
        tensors.update({f"momentum/{n}": t for n, t in self.outer.buffers.items()})
        tensors.update({f"ef/{n}": t for n, t in self.feedback.state_dict().items()})
        return tensors, {"round": self.round, **self.rounds.meta()}

    def load_state(self, tensors: Tensors, meta: dict) -> None:
        device = self.ctx.trainer.task_device
        live = self.ctx.trainer.params()
        saved = {k[6:]: tuple(t.shape) for k, t in tensors.items() if k.startswith("start/")}
        dropped = saved != {n: tuple(t.shape) for n, t in live.items()}
        if dropped:
            # another set of parameters trains now (one frozen or unfrozen since, or a
            # checkpoint from before frozen parameters were left out): the round starts afresh
            # from the restored model, its momentum and residuals dropped
            log.warning("diloco_state_dropped", saved=len(saved), training=len(live),
                        detail="the checkpoint's round start is of other parameters than "
                        "those training now: this round starts from the model")  # fmt: skip
            tensors = {k: v for k, v in tensors.items()
                       if not k.startswith(("start/", "momentum/", "ef/"))}  # fmt: skip
            self.model_replaced()  # (made before the restore: its start was the model then)
        for prefix, target in (("start/", self.start), ("momentum/", self.outer.buffers)):
            for key, t in tensors.items():
                if key.startswith(prefix):
                    name = key[len(prefix) :]
                    if target is self.outer.buffers:  # (as this node holds it, whatever the
                        # checkpoint's writer did)
                        t = t.to(dtype=self.outer.dtype or self.start.get(name, t).dtype)
                    target[name] = t.to(device)
        residuals = {k[3:]: v for k, v in tensors.items() if k.startswith("ef/") and "@" not in k}
        self.feedback.load_state_dict({k: v.to(device) for k, v in residuals.items()})
        self.round = int(meta.get("round", 0))
        # (dropped: the round starts from the restored model at this step)
        self.rounds.restore(self.ctx.trainer.step, meta, afresh=dropped)

    def model_replaced(self) -> None:
        def restart(live: Tensors) -> None:
            with self._start_lock:  # (after the trainer's lock, as in a round end or outer step)
                self.start = {name: t.detach().clone() for name, t in live.items()}
                self._start_holds_delta = False

        self.ctx.trainer.update(restart)  # (the round start changes under the trainer's lock)

    # -- the round start, which holds our update through an in-place round end ---------------
    def _start_norm(self) -> float:
        """||round start|| (a worker thread): through an in-place round end, of our update +
        the model, SLICE elements at a time."""
        with self._start_lock:
            if not self._start_holds_delta:
                return params_norm(self.start)
            live, total = self.ctx.trainer.params(), 0.0
            for name, t in self.start.items():
                flat, model = t.view(-1), live[name].reshape(-1)
                for i in range(0, flat.numel(), SLICE):
                    part = flat[i : i + SLICE] + model[i : i + SLICE]
                    total += float(torch.linalg.vector_norm(part)) ** 2
            return math.sqrt(total)

    def _start_distance(self, other: Update, live: Tensors | None = None) -> float:
        """||other - round start||, a slice at a time (the outer step, under the lock)."""
        if not self._start_holds_delta:
            return update_distance(other, self.start)
        live = self.ctx.trainer.params() if live is None else live
        total = 0.0
        for name, offset, t in update_slices(other):
            for i in range(0, t.numel(), SLICE):
                at = slice(offset + i, offset + min(i + SLICE, t.numel()))
                part = t[i : i + SLICE] - self.start[name].view(-1)[at]
                part.sub_(live[name].reshape(-1)[at])
                total += float(torch.linalg.vector_norm(part)) ** 2
        return math.sqrt(total)

    def _start_chunk(self, plan: ChunkPlan, index: int, spec: str) -> bytes:
        """Chunk `index` of the round start (our outer parameters) in `spec` (a worker
        thread)."""
        with self._start_lock:
            slices = model_chunk(self.start, plan, index)
            if self._start_holds_delta:
                live = self.ctx.trainer.params()
                slices = [(c, t + live[c.name].reshape(-1)[c.start : c.stop]) for c, t in slices]
            return encode_chunk(slices, spec)

    def _restore_start(self) -> None:
        """Leave an in-place round end that did not reach its outer step (cancelled, failed):
        the round start again (start = our update + the model, which has not moved)."""
        if not self._start_holds_delta:
            return

        def restore(live: Tensors) -> None:
            with self._start_lock:
                for name, t in self.start.items():
                    t.add_(live[name])
                self._start_holds_delta = False

        self.ctx.trainer.update(restore)
        self.latest, self.latest_delta = (0, [], ""), None

    def peer_disconnected(self, peer_id: str) -> None:
        """An offer `peer_id` was pushing to us will not be finished: free its slot now."""
        if self._incoming.pop(peer_id, None) is not None:
            log.info("offer_dropped", peer=peer_id[:12], reason="connection lost")
            self._offer_ended()
        self._answering.pop(peer_id, None)
        if self._outer_in is not None and self._outer_in[0] == peer_id:
            self._outer_in = None

    def _spec(self, partners: list[str]) -> str:
        peers = self.ctx.peers
        if peers.fixed_codec is not None:
            return peers.fixed_codec
        now = self.ctx.now()
        specs = {peers.choose_codec(p, now) for p in partners} or {"fp16"}
        return min(specs, key=peers.payload_nbytes)

    def plan(self, chunk_numel: int) -> ChunkPlan:
        """The chunk plan of our model for chunks of `chunk_numel` elements (a few cached).

        Raises:
            ValueError: it would have more than MAX_CHUNKS chunks.
        """
        return cached_plan(self._plans, self.ctx.trainer, chunk_numel)

    def _round_end(self, spec: str) -> tuple[Tensors, list[bytes]]:
        """Our update of this round, and its chunks encoded once (error feedback applies once;
        codec none: no chunks kept, see `_chunk`)."""
        self.rounds.update_made(self.ctx.trainer.step)

        def over_start(live: Tensors) -> Tensors:  # in place: start - live, where start was
            with self._start_lock:
                for name, t in self.start.items():
                    t.sub_(live[name])
                self._start_holds_delta = True
            return self.start

        delta = self.ctx.trainer.update(
            over_start if self._in_place else lambda live: pseudo_gradient(self.start, live))
        if spec == "none":
            return delta, []
        plan = self.plan(self.ctx.chunk_numel)
        shapes = dict(plan.shapes)
        encoding, feedback = update_encoding(spec, self.ctx.peers.numel)
        # without feedback, a residual held from rounds in a coarse codec goes out once more
        residual = self.feedback if feedback or self.feedback else None
        seed = self.round if feedback else self._seed_base + self.round * len(plan)
        chunks = [encode_chunk(model_chunk(delta, plan, i), encoding, residual,
                               seed=seed + i, shapes=shapes)
                  for i in range(len(plan))]  # fmt: skip
        if not feedback:
            self.feedback.reset()
        return delta, chunks

    def _can_send(self, plan: ChunkPlan, codec: str) -> bool:
        """Whether our latest update can be sent in `codec`, cut by `plan`."""
        _, chunks, spec = self.latest
        if chunks and spec == codec and plan.chunk_numel == self.ctx.chunk_numel:
            return True
        return self.latest_delta is not None

    async def _chunk(self, plan: ChunkPlan, index: int, codec: str) -> bytes:
        """Chunk `index` of our latest update, cut by `plan` in `codec`: the one encoded at the
        round end when it is that one, else encoded from the values now (no error feedback)."""
        _, chunks, spec = self.latest
        if chunks and spec == codec and plan.chunk_numel == self.ctx.chunk_numel:
            return chunks[index]
        delta = self.latest_delta
        assert delta is not None

        def encode() -> bytes:
            if delta is not self.start:
                return encode_chunk(model_chunk(delta, plan, index), codec)
            with self._start_lock:  # (an in-place round end's update: until its outer step)
                if not self._start_holds_delta:
                    raise _Stale
                return encode_chunk(model_chunk(delta, plan, index), codec)

        return await self.ctx.to_thread(encode)

    def _offer_ended(self) -> None:
        """Wake a round end waiting for offers to us to arrive (see `_await_crossing`)."""
        self._arrived.set()
        self._arrived = trio.Event()

    def _crossing_pending(self) -> bool:
        """Whether an offer that crossed ours this round end is still arriving (one abandoned
        earlier is not waited for)."""
        return any(p in self._incoming and self._incoming[p][0] == self._answering.get(p, (-1,))[0]
                   for p in self._crossed)  # fmt: skip

    async def _await_crossing(self, deadline_at: float) -> None:
        """Until `deadline_at`, wait for the offers that crossed ours this round end (their
        updates come with them, not with the replies)."""
        with trio.move_on_at(deadline_at):
            while self._crossing_pending():
                await self._arrived.wait()

    def _drop_stalled(self, now: float) -> None:
        """Free the offers to us that got no chunk for longer than their sender's own deadline
        for a whole exchange: it gave up on them. Kept, one would hold its chunks and stand for
        an update that never comes (`have` counts it: the sender would answer ours with none)."""
        for peer, (_, _, assembly) in list(self._incoming.items()):
            last = self._last_chunk.get(peer, now)
            nbytes = 2 * self.ctx.peers.payload_nbytes(assembly.spec)
            if now - last > self.ctx.peers.round_deadline(peer, nbytes, last):
                del self._incoming[peer]
                log.info("offer_dropped", peer=peer[:12], reason="no chunk within its deadline")
                self._offer_ended()
        self._last_chunk = {p: t for p, t in self._last_chunk.items() if p in self._incoming}

    def _held_round(self, peer: str, *, arriving: bool = True) -> int:
        """The newest round of `peer`'s updates we hold, have used or (`arriving`) are being
        sent (0: none)."""
        incoming = self._incoming.get(peer) if arriving else None
        return max(self.used.get(peer, 0), self.inbox.get(peer, (0, None))[0],
                   incoming[1] if incoming is not None else 0,
                   self._replied.get(peer, 0))  # fmt: skip

    async def after_step(self, result: StepResult) -> None:
        ctx = self.ctx
        end = self.rounds.step_done(result.step, result.seconds, self.round, ctx.now())
        if end is None:
            return
        if end.reason == "caught_up":
            log.info("round_caught_up", step=result.step, inner_steps=end.inner_steps)
        elif end.reason == "timed":
            log.info("round_timed", step=result.step, budget_s=round(self.round_budget_s(), 2),
                     inner_steps=end.inner_steps)  # fmt: skip
        started = ctx.now()
        round_ = self.round + 1
        # a client-mode peer offers, is not offered to; one that failed lately sits out some
        # rounds (else a crashed peer would keep drawing rounds it cannot answer)
        dialable = sorted(ctx.peers.dialable_peers())
        live = self.sit_outs.available(dialable, round_)
        partners = sorted(ctx.rng.sample(live, min(len(live), ctx.settings.fanout)))
        spec = self._spec(partners)
        # the last round's update goes before this one is made (one update held, not two); an
        # offer meanwhile is answered with none
        self.latest, self.latest_delta = (0, [], ""), None
        self._crossed.clear()
        self._rejected_now.clear()
        self._declined_now.clear()
        self._drop_stalled(started)
        try:
            await self._end_round(round_, partners, spec)
        finally:  # (an in-place round end cut short: the round start back, the model as it was)
            self._restore_start()
        if 4 * ctx.peers.numel > RELEASE_ABOVE_BYTES:  # the chunk buffers freed (below the
            # mmap threshold) back to the system, not kept through the inner steps
            await ctx.to_thread(release_free_memory)
        self.rounds.round_ended(result.step, ctx.now() - started)

    async def _end_round(self, round_: int, partners: list[str], spec: str) -> None:
        """Our update made, offered to `partners`, and the outer step on what came."""
        ctx = self.ctx
        delta, chunks = await ctx.to_thread(self._round_end, spec)
        self.latest, self.latest_delta = (round_, chunks, spec), delta
        replies: dict[str, tuple[int, Update | None]] = {}  # who answered (with its update)
        if partners:
            now = ctx.now()
            nbytes = sum(len(c) for c in chunks) or ctx.peers.payload_nbytes(spec)
            deadline = max(ctx.peers.round_deadline(p, 2 * nbytes, now) for p in partners)
            with trio.move_on_after(deadline):
                async with trio.open_nursery() as nursery:
                    for peer in partners:
                        nursery.start_soon(self._offer, peer, round_, spec, deadline, replies)
            await self._await_crossing(now + deadline)
        for peer in self._crossed:  # answered by their own offers: did they arrive?
            if peer in partners and peer not in replies and peer in self.inbox:
                replies[peer] = (0, None)
                self.counters.record_ok(peer, spec)
        self._crossed.clear()
        now = ctx.now()
        for peer in partners:  # an offer cut off by the deadline raised nothing: count it here
            if peer in replies:
                self.sit_outs.answered(peer)
                ctx.peers.answered(peer, True, now)
            elif peer in self._declined_now:
                self.sit_outs.declined(peer, round_)
            else:
                self.sit_outs.failed(peer, round_)
                if peer not in self._rejected_now:
                    ctx.peers.failed(peer, now)
                    self.counters.record_failed(peer, spec)
        self._rejected_now.clear()
        self._declined_now.clear()
        every = ctx.settings.consensus_every
        answered = [p for p in partners if p in replies]
        if every and round_ % every == 0 and answered:
            await self._consensus_offer(ctx.rng.choice(answered))
        await self._outer_step(round_, delta, replies, partners)

    async def _outer_step(self, round_, delta, replies, partners) -> None:
        offered = {**self.inbox}
        for peer, (r, d) in replies.items():
            if d is not None and r > offered.get(peer, (-1, None))[0]:
                offered[peer] = (r, d)
        use = fresh_deltas(
            round_,
            {p: r for p, (r, _) in offered.items()},
            self.used,
            max_staleness=self.ctx.settings.max_staleness,
        )
        others = [offered[p][1] for p in use]
        # each update weighted by the inner steps it took, a peer's at most a whole round of
        # ours (nobody outweighs us by saying so); 0, not said: a whole round
        whole = max(self.rounds.latest_steps, self.inner_steps)
        weights = [float(min(self._steps_of.get((p, offered[p][0]), 0) or whole, whole))
                   for p in use]  # fmt: skip
        own = float(self.rounds.latest_steps)
        self._replied.clear()
        rule, radius = self.ctx.gossip.robust, self.ctx.robust
        assert radius is not None

        # consensus: partners' outer parameters from this round's swaps
        mixes = {p: t for p, (_, t) in self.consensus.items()}
        self.consensus.clear()

        def step(live: Tensors) -> None:
            # a loop of the user's own kept training while the round ended: keep those steps
            # (live - live at the round end = live - (start - delta)) on top of the new start
            drift = self.ctx.trainer.step != self.rounds.round_end_step
            if drift:
                for name, tensor in live.items():
                    tensor.sub_(self.start[name]).add_(delta[name])
            # gossip.robust: peers' pseudo-gradients clipped around ours, or trimmed
            # the outer step moves every start alike: average first, then step
            self._mix(self.start, mixes, self._consensus_shares(mixes, self._start_distance))
            self._outer_update(delta, others, rule, radius, weights=(own, weights))
            for name, tensor in live.items():
                if drift:
                    tensor.add_(self.start[name])
                else:
                    tensor.copy_(self.start[name])

        def step_in_place(live: Tensors) -> None:
            # self.start holds our update (start - live); the model waited for the round end
            if self.ctx.trainer.step != self.rounds.round_end_step:
                raise RuntimeError("diloco: the model stepped during an in-place round end")
            shares = self._consensus_shares(mixes, lambda o: self._start_distance(o, live))
            for name, tensor in live.items():  # the round start, made where the model is
                tensor.add_(self.start[name])
            self._mix(live, mixes, shares)
            self._outer_update(self.start, others, rule, radius, live, weights=(own, weights))
            for name, tensor in self.start.items():  # the next round's start
                tensor.copy_(live[name])
            self._start_holds_delta = False

        def locked(live: Tensors) -> None:
            with self._start_lock:
                (step_in_place if self._start_holds_delta else step)(live)

        self._stepping = True
        try:
            await self.ctx.to_thread(lambda: self.ctx.trainer.apply(locked))
        finally:
            self._stepping = False
        self.consensus_mixes += len(mixes)
        if not self._keep_update:  # (a big model: its encoded chunks, if any, still answer)
            self.latest_delta = None
        for peer in use:
            self.used[peer] = offered[peer][0]
        for peer, (r, _) in list(self.inbox.items()):  # (a newer one that came during the
            if peer in offered and r <= offered[peer][0]:  # step stays, for the next)
                del self.inbox[peer]
        self._steps_of = {k: v for k, v in self._steps_of.items()
                          if self.inbox.get(k[0], (None,))[0] == k[1]}  # fmt: skip
        self.rounds.forget_arrivals(self.inbox)
        live = set(self.ctx.peers.live_peers())
        self.used = {p: r for p, r in self.used.items() if p in live}
        self.sit_outs.keep(live)
        self._answering = {p: a for p, a in self._answering.items() if p in live}
        self.round = round_
        self.outer_steps += 1
        self.peer_deltas_used += len(use)
        missing = [p for p in partners if p not in replies and p not in use]  # (its own
        # offer may have brought its update while ours was declined)
        self.missing += len(missing)
        log.info(
            "outer_step",
            round=round_,
            used=[p[:12] for p in use],
            missing=[p[:12] for p in missing],
            consensus=[p[:12] for p in mixes],
            inner_steps=self.inner_steps,
        )

    def _consensus_shares(self, mixes: dict[str, Update],
                          distance: Callable[[Update], float]) -> list[float]:  # fmt: skip
        """Each partner's share c_j = w s_j in the consensus average: equal weights w, its
        difference from our outer parameters (`distance`) clipped around ours (as
        gossip.clipped_neighbourhood_mix)."""
        weight, radius = 1.0 / (len(mixes) + 1), self._consensus_radius
        shares = []
        for other in mixes.values():
            d = distance(other)
            shares.append(weight * radius.factor(d))
        return shares

    @staticmethod
    def _mix(target: Tensors, mixes: dict[str, Update], shares: list[float]) -> None:
        """Average partners' outer parameters into `target` (ours), a slice of one partner's
        at a time: target' = (1 - sum_j c_j) target + sum_j c_j x_j (no copy of target)."""
        if not mixes:
            return
        with torch.no_grad():
            for t in target.values():
                t.mul_(1.0 - sum(shares))
            for other, share in zip(mixes.values(), shares, strict=True):
                for name, offset, t in update_slices(other):
                    target[name].view(-1)[offset : offset + t.numel()].add_(t, alpha=share)

    def _outer_update(self, delta: Tensors, others: list[Update], rule: str,
                      radius: ClipRadius, target: Tensors | None = None,
                      weights: tuple[float, list[float]] | None = None) -> None:  # fmt: skip
        """The outer step of `target` (the round start when None) on the robust mean of our
        update and the peers' (gossip.robust: clipped around ours, or trimmed), a slice of one
        update at a time: the mean is never held whole, nor a peer's update decoded whole (but
        for a trimmed mean, which needs every update's value of a coordinate at once).
        `weights`: (ours, the peers') in the mean, the inner steps each update took (None:
        equal; a trimmed mean is unweighted)."""
        target = self.start if target is None else target
        if rule == "trim" and trim_count(len(others) + 1):
            whole = [o.decoded() if isinstance(o, EncodedAssembly) else o for o in others]
            self.outer.step(target, robust_average(delta, whole, rule, radius))
            return

        scales = robust_scales([functools.partial(update_distance, o, delta) for o in others],
                               rule, radius)  # fmt: skip
        mine, theirs = weights if weights is not None else (1.0, [1.0] * len(others))
        total = mine + sum(theirs)
        shares = [w / total for w in theirs]
        # mean = own + sum_j c_j s_j (x_j - own) = (1 - sum_j c_j s_j) own + sum_j c_j s_j x_j,
        # c_j = w_j / (w_own + sum_k w_k)
        own = 1.0 - sum(c * scale for c, scale in zip(shares, scales, strict=True))
        self.outer.begin(target)
        for name, t in delta.items():
            self.outer.add(target, name, t, own)
        for other, scale, share in zip(others, scales, shares, strict=True):
            for name, offset, t in update_slices(other):
                self.outer.add(target, name, t, share * scale, offset)

    async def _consensus_offer(self, peer: str) -> None:
        """Swap outer parameters with `peer` chunk by chunk and keep its for our outer step (it
        keeps ours for its next one)."""
        ctx = self.ctx
        address = ctx.peers.address_of(peer)
        if address is None:
            return
        spec, plan, made = ctx.settings.consensus_codec, self.plan(ctx.chunk_numel), self.round
        xid = ctx.rng.getrandbits(63)
        theirs = EncodedAssembly(plan, spec, ctx.trainer.task_device)
        started, moved, their_round = ctx.now(), [0], []
        deadline = ctx.peers.round_deadline(peer, 2 * ctx.peers.payload_nbytes(spec), started)

        async def one(index: int) -> None:
            data = await ctx.to_thread(self._start_chunk, plan, index, spec)
            header = OuterOffer(codec=spec, round=made, xid=xid, plan=plan.digest,
                                chunk_numel=plan.chunk_numel, chunks=len(plan), index=index)
            reply, got, _ = await ctx.network.request(address, header, data, deadline_s=deadline,
                                                      expect_peer=peer)  # fmt: skip
            if not isinstance(reply, OuterReply):
                raise _Refused(getattr(reply, "reason", "") or type(reply).__name__)
            their_round.append(reply.round)
            moved[0] += len(data) + len(got)
            await ctx.to_thread(theirs.add, index, got)

        try:
            with trio.move_on_after(deadline):
                await in_window(range(len(plan)), one)
            if not theirs.complete:
                raise _Refused("no complete answer within the deadline")
            await ctx.to_thread(self._check_norm, theirs, True)
        except (TransportError, _Refused) as exc:
            log.info("consensus_skipped", partner=peer[:12], reason=str(exc))
            return
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._rejected_from(peer, spec, exc)
            return
        now = ctx.now()
        ctx.peers.transferred(peer, moved[0], now - started, now)
        if self.round == made:  # (nothing replaced our model meanwhile)
            self.consensus[peer] = (max(their_round), theirs)

    def _check_norm(self, update: EncodedAssembly, start: bool = False) -> None:
        """A peer's complete update or outer parameters (its chunks checked as they came)
        against the norm of our model, or of our outer parameters (`start`; a worker thread).

        Raises:
            RejectedUpdate: "norm".
        """
        mine = self._start_norm() if start else params_norm(self.ctx.trainer.params())
        check_norm_ratio(update.norm, mine, max_norm_ratio=self.ctx.gossip.max_norm_ratio,
                         what="outer parameters" if start else "update (pseudo-gradient)",
                         against="our outer parameters" if start else "our model")

    def _rejected_from(self, peer: str, spec: str, exc: Exception) -> None:
        """A partner's answer failed a check: count it, choose the partner less, say why."""
        self.counters.record_rejected(peer, spec, exc)
        self.ctx.peers.unreliable(peer, self.ctx.now())
        log_within_quota("update_rejected", peer=peer[:12], reason=str(exc))

    async def _offer(self, peer, round_, spec, deadline, replies) -> None:
        """Send our update to `peer` chunk by chunk and take its latest one from the replies."""
        ctx = self.ctx
        address = ctx.peers.address_of(peer)
        if address is None:
            return
        if self._answering.get(peer, (0, 0))[1] == round_:
            # its offer to us is arriving and our replies carry this update: nothing to send,
            # and its update comes with its offer (the round end waits for it, and counts it)
            self._crossed.add(peer)
            return
        plan = self.plan(ctx.chunk_numel)
        xid = ctx.rng.getrandbits(63)
        have = self._held_round(peer)  # (it answers none when it has nothing newer for us)
        self._offering[peer] = round_
        theirs: EncodedAssembly | None = EncodedAssembly(plan, spec, ctx.trainer.task_device,
                                                         self._hold)  # fmt: skip
        their_round: list[int] = []
        started, moved, changed, their_steps, their_ms = ctx.now(), [0], [False], [0], [0]

        async def one(index: int) -> None:
            header = DeltaOffer(codec=spec, round=round_, xid=xid, plan=plan.digest,
                                chunk_numel=plan.chunk_numel, chunks=len(plan), index=index,
                                have=have, steps=self.rounds.latest_steps,
                                round_ms=self.rounds.latest_round_ms)  # fmt: skip
            ours = await self._chunk(plan, index, spec)
            reply, data, _ = await ctx.network.request(
                address, header, ours, deadline_s=deadline, expect_peer=peer
            )  # fmt: skip
            if isinstance(reply, ErrorReply) and reply.code == "busy":
                raise _Declined(reply.reason)
            if not isinstance(reply, DeltaReply):
                raise _Refused(getattr(reply, "reason", "") or type(reply).__name__)
            moved[0] += len(ours) + len(data)
            if their_round and reply.round != their_round[0]:
                # its update changed while it answered (its round ended): ours still gets there
                # whole; of its answer nothing is kept (chunks of two updates make none)
                changed[0] = True
            their_round.append(reply.round)
            their_steps[0], their_ms[0] = reply.steps, reply.round_ms
            if reply.round > 0 and not changed[0]:
                assert theirs is not None
                await ctx.to_thread(theirs.add, index, data)

        try:
            try:
                await in_window(range(len(plan)), one)
            finally:
                if self._offering.get(peer) == round_:
                    del self._offering[peer]
            delta = None
            if changed[0]:
                their_round, theirs = [0], None
                log.info("update_changed", partner=peer[:12],
                         detail="its round ended during our offer: ours was delivered, its "
                         "update comes with its own offer")  # fmt: skip
            elif their_round and their_round[0] > 0:
                delta = theirs
                await ctx.to_thread(self._check_norm, theirs)
        except _Declined as exc:  # neither ok nor failed: the partner is full this round
            self._declined_now.add(peer)
            log.info("exchange_declined", partner=peer[:12], reason=str(exc))
            return
        except (TransportError, _Refused) as exc:  # counted as failed when the round ends
            log.info("exchange_failed", partner=peer[:12], reason=str(exc))
            return
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._rejected_now.add(peer)
            self._rejected_from(peer, spec, exc)
            return
        now = ctx.now()
        ctx.peers.transferred(peer, moved[0], now - started, now)
        replies[peer] = (their_round[0] if their_round else 0, delta)
        if delta is not None:
            self._replied[peer] = their_round[0]
            self._steps_of[(peer, their_round[0])] = their_steps[0]
            self.rounds.saw_pace(peer, their_steps[0], their_ms[0], self.ctx.now())
        self.counters.record_ok(peer, spec)

    async def handle(self, peer: PeerInfo, header: Header, payload: memoryview) -> Reply:
        if isinstance(header, OuterOffer):
            return await self._answer_outer(peer, header, payload)
        assert isinstance(header, DeltaOffer)
        ctx = self.ctx
        if not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        plan, why = plan_refusal(self._plans, ctx.trainer, header.chunk_numel,
                                 ctx.max_chunk_numel, header.plan, header.chunks,
                                 header.index)  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        try:
            await self._take(peer.peer_id, header, payload, plan)
        except _Full as exc:
            log.debug("offer_declined", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="busy", reason=str(exc)), b""
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            if self._incoming.pop(peer.peer_id, None) is not None:
                self._offer_ended()
            if peer.peer_id in self._crossed:
                self._rejected_now.add(peer.peer_id)
            self.counters.record_rejected(peer.peer_id, header.codec, exc)
            log_within_quota("update_rejected", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        round_, available = self.latest[0], self._can_send(plan, header.codec)
        answering = self._answering.get(peer.peer_id)
        if answering is None or answering[0] != header.xid:  # its offer's first chunk here
            crossing = self._offering.get(peer.peer_id) == round_  # ours goes in our offer
            if crossing:
                self._crossed.add(peer.peer_id)
            none = not available or round_ <= header.have or crossing
            answering = self._answering[peer.peer_id] = (header.xid, 0 if none else round_)
        if answering[1] == 0 or not available:  # none, or none it lacks
            return DeltaReply(round=0), b""
        try:
            return (DeltaReply(round=round_, steps=self.rounds.latest_steps,
                               round_ms=self.rounds.latest_round_ms),
                    await self._chunk(plan, header.index, header.codec))
        except _Stale:  # our outer step took it meanwhile: as if our round had ended (none)
            return DeltaReply(round=0), b""

    async def _answer_outer(self, peer: PeerInfo, header: OuterOffer, payload: memoryview) -> Reply:
        """One chunk of a partner's outer parameters for ours; kept for our next outer step when
        it completes (checked as a pseudo-gradient is)."""
        ctx = self.ctx
        if header.codec not in DENSE_CODECS or not ctx.acceptable(header.codec):
            return ErrorReply(code="bad_request", reason=f"codec {header.codec!r} refused"), b""
        if self._stepping:  # our outer parameters are changing right now
            return ErrorReply(code="busy", reason="in its outer step"), b""
        plan, why = plan_refusal(self._plans, ctx.trainer, header.chunk_numel,
                                 ctx.max_chunk_numel, header.plan, header.chunks,
                                 header.index)  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        held = self._outer_in  # (peer, xid, our outer steps when it began, assembly)
        if held is not None and held[2] != self.round:  # begun before our last outer step: the
            self._outer_in = None  # chunks we sent were of other parameters
            if held[:2] == (peer.peer_id, header.xid):
                return ErrorReply(code="busy", reason="made an outer step during the swap"), b""
            held = None
        if held is None or held[:2] != (peer.peer_id, header.xid):
            if held is not None and held[0] != peer.peer_id:  # one at a time (memory budget)
                return ErrorReply(code="busy", reason="answering another consensus offer"), b""
            held = self._outer_in = (peer.peer_id, header.xid, self.round,
                                     EncodedAssembly(plan, header.codec, ctx.trainer.task_device))
        assembly = held[3]
        try:
            if await ctx.to_thread(assembly.add, header.index, payload):
                self._outer_in = None
                await ctx.to_thread(self._check_norm, assembly, True)
                if held[2] == self.round:  # (our outer parameters are still those it saw)
                    self.consensus[peer.peer_id] = (header.round, assembly)
        except (RejectedUpdate, compress.DecodeError, ValueError) as exc:
            self._outer_in = None
            self.counters.record_rejected(peer.peer_id, header.codec, exc)
            log_within_quota("update_rejected", peer=peer.short_id, reason=str(exc))
            return ErrorReply(code="bad_request", reason=f"update rejected: {exc}"[:500]), b""
        data = await ctx.to_thread(self._start_chunk, plan, header.index, header.codec)
        return OuterReply(round=self.round), data

    async def _take(self, peer: str, header: DeltaOffer, payload: memoryview, plan) -> None:
        """Add one chunk of `peer`'s offer; a complete, checked update goes to the inbox."""
        ctx = self.ctx
        current = self._incoming.get(peer)
        fresh = current is None or current[0] != header.xid
        if fresh and header.round <= self._held_round(peer, arriving=False):
            return  # an update of it we hold or used already: not taken twice
        if current is None and peer not in self.inbox and peer not in self._offering and len(
            self.inbox
        ) + len(self._incoming) >= ctx.settings.fanout:  # as many updates held as the memory
            # budget counts (a partner we offer to: its update stands for its reply's)
            raise _Full(f"already holding {ctx.settings.fanout} peers' updates")
        if current is None or current[0] != header.xid:  # a new offer replaces an unfinished one
            assembly = EncodedAssembly(plan, header.codec, ctx.trainer.task_device, self._hold)
            current = self._incoming[peer] = (header.xid, header.round, assembly)
        assembly = current[2]
        self._last_chunk[peer] = ctx.now()
        if not await ctx.to_thread(assembly.add, header.index, payload):
            return
        try:
            await ctx.to_thread(self._check_norm, assembly)
            if header.round > self.inbox.get(peer, (-1, None))[0]:
                self.inbox[peer] = (header.round, assembly)
                self._steps_of[(peer, header.round)] = header.steps
                self.rounds.update_arrived(peer, ctx.trainer.step, header.steps, header.round)
                self.rounds.saw_pace(peer, header.steps, header.round_ms, ctx.now())
        finally:  # (checked before it stops counting as arriving: a round end waits for it)
            if self._incoming.get(peer, (None,))[0] == header.xid:  # (a newer offer may
                del self._incoming[peer]  # have replaced it)
                self._offer_ended()
        self.counters.record_ok(peer, header.codec)


def diloco_copies(gossip: GossipConfig, numel: int, fanout: int) -> float:
    """Model copies diloco keeps beyond a plain loop with `fanout` partners (see ALGORITHM)."""
    s = gossip.settings
    momentum = 1.0 if momentum_dtype(numel) is None else 0.5
    return (2.0 + momentum + own_share(gossip.codec, numel)
            + 2 * fanout * held_share(gossip.codec, numel)
            + (2 * wire_share(s.consensus_codec) if s.consensus_every else 0))  # fmt: skip


def own_share(codec: str, numel: int) -> float:
    """Our update's encoded chunks and error feedback (a half-precision residual), over a
    model's float32 bytes: none for codec none; chunks alone where update_encoding drops the
    feedback; else counted as one copy."""
    if codec == "none":
        return 0.0
    if codec != "auto" and not update_encoding(codec, numel)[1]:
        return wire_share(codec)
    return 1.0


def fit_fanout(gossip: GossipConfig, copies: float, numel: int) -> GossipConfig | None:
    """`gossip` with fanout lowered to what `copies` model copies hold: each partner may leave
    an update in our inbox and one in its reply (None: not even one partner fits)."""
    s = gossip.settings
    most = next((f for f in range(s.fanout, 0, -1) if diloco_copies(gossip, numel, f) <= copies),
                0)  # fmt: skip
    if most < 1:
        return None
    if most == s.fanout:
        return gossip
    fitted = dataclasses.replace(s, fanout=most)
    return dataclasses.replace(gossip, algorithm_settings={**gossip.algorithm_settings,
                                                           "diloco": fitted})  # fmt: skip


ALGORITHM = register_algorithm(
    AlgorithmSpec(
        name="diloco",
        runtime=Diloco,
        settings=DilocoSettings,
        messages=(DeltaOffer, DeltaReply, OuterOffer, OuterReply),
        summary="local SGD: inner_steps local steps, then an outer step on averaged updates",
        # round start, outer momentum (in bfloat16 above MOMENTUM_HALF_ABOVE_BYTES: half a
        # copy) and our update (a model above KEEP_UPDATE_BYTES holds it only through its round
        # end, where this peak is); with a lossy codec its encoded chunks and half-precision
        # error feedback (chunks alone: own_share); up to fanout updates from peers offered to
        # us plus fanout replies, held as they came or narrower (hold_codec, held_share); with
        # consensus, a partner's outer parameters we asked for and one we answer, as they came
        # in consensus_codec
        memory=lambda g, numel: diloco_copies(g, numel, g.settings.fanout),
        fit=fit_fanout,
    )
)
