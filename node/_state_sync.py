# State sync: a node that joins late fetches the current model from a live peer before its first
# step, and every node serves its model to such joiners, chunk by chunk. Invariants: the server
# keeps nothing between requests (each chunk is read from its live model when asked, so serving
# costs no model copy); every chunk request has a deadline from the link's estimate and the
# chunk's size; a fetched chunk is decoded within its size and checked (the plan's slices,
# finite) as it arrives, into a staging copy; our model is replaced only when every chunk
# arrived, so a failed or abandoned fetch leaves it as it was; progress is logged every few
# seconds; nothing here runs tensor work on the event loop. Once the model is in, the joiner asks
# the same peer for its optimizer's state the same way (layout first, then chunks, into a staging
# copy; a loop of the user's own fetches the chunks at its wrap, once its optimizer's class is
# known); that part fails softly: a peer with another optimizer, or none yet, or a fetch that
# breaks, leaves the joiner with a fresh optimizer, said in the log.
from __future__ import annotations

import contextlib
import math
import random

import msgspec
import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import LinkTable, RejectedUpdate, is_client_address

from ._config import ConfigError
from ._peer_choice import MembershipView
from ._protocol import (
    MAX_BUFFER_BYTES,
    MAX_LAYOUT_BYTES,
    BufferStateReply,
    BufferStateRequest,
    OptimizerLayout,
    OptimizerStateReply,
    OptimizerStateRequest,
    StateReply,
    StateRequest,
)
from .algorithms import (
    CHUNKS_IN_FLIGHT,
    MODELS_DIFFER,
    Algorithm,
    ChunkPlan,
    Network,
    ToThread,
    cached_plan,
    chunks_in_flight,
    decode_chunk,
    encode_chunk,
    in_window,
    plan_refusal,
    read_chunk_encoded,
    slow_start_s,
)
from .training import Trainer
from .transport import ErrorReply, Header, PeerInfo, TransportError

STATE_SYNC_WAIT_S = 30.0  # how long a joiner looks for a live peer before it trains from scratch
MAX_TRIES = 8  # fetches that failed (peer gone, bad chunks) before it trains from scratch
PROGRESS_EVERY_S = 5.0
MAX_STATE_COPIES = 4  # the most optimizer state a joiner takes, in model copies (Adam: 2)
# gossip.robust set (peers may be malicious): the model is each value's median over this many
# donors, so one dishonest donor cannot hand a joiner a model of its choosing; a joiner waits
# DONOR_WAIT_S for that many, then takes the peers there are (with a warning)
UNTRUSTED_DONORS = 3
DONOR_WAIT_S = 10.0
log = structlog.get_logger()


class _Failed(Exception):
    pass


class _DonorFailed(Exception):
    """One donor of a median fetch failed: the fetch ends (says which, and why)."""

    def __init__(self, peer: str, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer, self.cause = peer, cause


class _NothingYet(_Failed):
    """The peer has no optimizer state yet (it has not stepped: a swarm starting together)."""


class ModelMismatch(ConfigError):
    """The swarm's peers train another model (other parameter names or shapes): this node can
    never exchange with them. Raised at start, by state sync, instead of training alone."""


MISMATCH_PEERS = 2  # this many peers refusing our model's plan settle it (or every peer there is)


FETCH_ERRORS = (_Failed, TransportError, RejectedUpdate, compress.DecodeError)


class StateSync:
    """Both sides of state sync for one node.

    Args:
        trainer: the local model; algorithm: told when the model was replaced; algorithm_name:
            what this node runs (a joiner of another algorithm is refused).
        network: sends requests; membership: whom to ask; links: deadlines; rng: the order
            peers are asked in.
        chunk_numel: elements per chunk of the fetches we start; max_chunk_numel: the most a
            joiner may ask for.
        to_thread: runs tensor work (worker threads; `inline` in tests on a virtual clock).
    """

    handles = (StateRequest, OptimizerStateRequest, BufferStateRequest)

    def __init__(
        self,
        trainer: Trainer,
        algorithm: Algorithm,
        algorithm_name: str,
        network: Network,
        membership: MembershipView,
        links: LinkTable,
        rng: random.Random,
        *,
        chunk_numel: int,
        max_chunk_numel: int,
        to_thread: ToThread = trio.to_thread.run_sync,
        untrusted: bool = False,
    ) -> None:
        self._trainer = trainer
        # gossip.robust set (peers may be malicious): no optimizer state or buffers are taken
        # from a donor.
        # (Its model is taken with the finite-value checks only: a norm check against our own
        # freshly made model would refuse honest donors, whose norm grows fast early on.)
        self._untrusted = untrusted
        self._algorithm = algorithm
        self._name = algorithm_name
        self._network = network
        self._membership = membership
        self._links = links
        self._rng = rng
        self._differ: set[str] = set()  # peers that refused our plan as another model's
        self._chunk_numel = chunk_numel
        self._max_chunk_numel = max_chunk_numel
        self._plans: dict[int, ChunkPlan] = {}
        self._to_thread = to_thread
        # what state sync moved (payloads: model, optimizer and buffer values) each way, a part
        # of the node's traffic that `geotrain status` names apart from the exchanges'
        self.bytes_in = self.bytes_out = 0

    def _plan(self, chunk_numel: int) -> ChunkPlan:
        return cached_plan(self._plans, self._trainer, chunk_numel)

    async def _request(self, address: str, header: Header, payload: bytes, *, deadline_s: float,
                       expect_peer: str) -> tuple[Header, bytearray, PeerInfo]:  # fmt: skip
        """The network's request, its reply's payload counted (bytes_in)."""
        reply, data, peer = await self._network.request(
            address, header, payload, deadline_s=deadline_s, expect_peer=expect_peer)
        self.bytes_in += len(data)
        return reply, data, peer

    # -- serving ----------------------------------------------------------------------------
    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        reply, data = await self._serve(header)
        self.bytes_out += len(data)
        return reply, data

    async def _serve(self, header: Header) -> tuple[Header, bytes]:
        if isinstance(header, OptimizerStateRequest):
            return await self._serve_optimizer(header)
        if isinstance(header, BufferStateRequest):
            return await self._serve_buffers()
        assert isinstance(header, StateRequest)
        if header.algorithm != self._name:
            reason = f"this node runs {self._name}, not {header.algorithm}"
            return ErrorReply(code="bad_request", reason=reason), b""
        plan, why = plan_refusal(
            self._plans, self._trainer, header.chunk_numel, self._max_chunk_numel, header.plan,
            None, header.index,
        )  # fmt: skip
        if plan is None:
            return ErrorReply(code="bad_request", reason=why[:500]), b""
        step = self._trainer.step
        data, _ = await self._to_thread(read_chunk_encoded, self._trainer, plan, header.index,
                                        0, self._trainer.chunk_staging("state_sync"))  # fmt: skip
        return StateReply(step=step, chunks=len(plan)), data

    async def _serve_buffers(self) -> tuple[Header, bytes]:
        """Our model's buffers, all in one payload (float32), read now."""

        def read(_params: dict[str, torch.Tensor]) -> tuple[int, bytes]:
            buffers = sorted(self._trainer.buffers().items())
            if 4 * sum(t.numel() for _, t in buffers) > MAX_BUFFER_BYTES:
                return len(buffers), b""
            named = [(name, t.detach().float()) for name, t in buffers]
            return len(named), compress.encode_named(named, compress.get_codec("none"))

        count, data = await self._to_thread(self._trainer.update, read)
        if count and not data:
            reason = f"buffers above {MAX_BUFFER_BYTES >> 20} MiB: not sent"
            return ErrorReply(code="bad_request", reason=reason), b""
        return BufferStateReply(count=count), data

    async def _serve_optimizer(self, header: OptimizerStateRequest) -> tuple[Header, bytes]:
        """Our optimizer's layout, or one chunk of its state tensors read now (no copy kept)."""
        layout = await self._to_thread(self._trainer.optimizer_layout)
        if layout is None or not layout["tensors"]:
            return ErrorReply(code="busy", reason="no optimizer state yet"), b""
        if header.layout:
            data = msgspec.msgpack.encode(layout)
            if len(data) > MAX_LAYOUT_BYTES:
                reason = f"an optimizer layout of {len(data)} bytes (at most {MAX_LAYOUT_BYTES})"
                return ErrorReply(code="bad_request", reason=reason), b""
            return OptimizerStateReply(chunks=0), data
        if not 1 <= header.chunk_numel <= self._max_chunk_numel:
            reason = f"chunks of {header.chunk_numel} elements: expected 1..{self._max_chunk_numel}"
            return ErrorReply(code="bad_request", reason=reason), b""
        try:
            plan = _optimizer_plan(layout["tensors"], header.chunk_numel)
        except ValueError as exc:
            return ErrorReply(code="bad_request", reason=str(exc)[:500]), b""
        if plan.digest != header.plan or header.index >= len(plan):
            reason = "another optimizer state (names or shapes), or a chunk outside the plan"
            return ErrorReply(code="bad_request", reason=reason), b""
        slices = plan.chunks[header.index]

        def read(tensors: dict[str, torch.Tensor]) -> bytes:
            return encode_chunk([(s, tensors[s.name].reshape(-1)[s.start : s.stop].float())
                                 for s in slices], "none")  # fmt: skip

        data = await self._to_thread(lambda: self._trainer.optimizer_tensors(read))
        return OptimizerStateReply(chunks=len(plan)), data

    # -- fetching ---------------------------------------------------------------------------
    async def fetch(self, stop: trio.Event) -> bool:
        """Replace our model with a live peer's (untrusted: each value's median over
        UNTRUSTED_DONORS peers'). Peers are asked one after another (a fetch that makes progress
        gets the time it needs: its chunks have their own deadlines); the joiner gives up after
        MAX_TRIES failed fetches, or STATE_SYNC_WAIT_S with nobody to ask.

        Returns:
            Whether a model was fetched.
        """
        idle, tries = 0.0, 0
        self._differ = set()
        started = trio.current_time()
        failed: set[str] = set()  # donors of a median fetch that failed: left out after
        while not stop.is_set() and idle < STATE_SYNC_WAIT_S and tries < MAX_TRIES:
            peers = list(self._membership.live_peers())
            self._rng.shuffle(peers)
            if self._untrusted:
                dialable = self._dialable(peers)
                fresh = [d for d in dialable if d[0] not in failed]
                if not fresh:  # (everyone failed once: they may have been busy)
                    failed.clear()
                    fresh = dialable
                waited = trio.current_time() - started
                # one peer that cannot serve (gone, slow, another model, refusing) must not sink
                # every try: it is left out, and the fetch waits for another peer or goes on
                # without it once the wait is over
                donors = fresh[:UNTRUSTED_DONORS]
                if donors and (len(donors) == UNTRUSTED_DONORS or waited >= DONOR_WAIT_S):
                    tries += 1
                    step, culprit = await self._fetch_model(donors)
                    if step is not None:
                        await self._synced([p for p, _ in donors], step, waited)
                        return True
                    failed.add(culprit)
                    self._check_mismatch(peers)
            for peer, address in [] if self._untrusted else self._dialable(peers):
                if tries >= MAX_TRIES:
                    break
                tries += 1
                step, _ = await self._fetch_model([(peer, address)])
                if step is not None:
                    await self._synced([peer], step, trio.current_time() - started)
                    await self.fetch_buffers(peer, address)
                    await self._optimizer_from(peer, address)
                    return True
                self._check_mismatch(peers)
            await trio.sleep(0.2)
            idle += 0.2
        if stop.is_set():  # asked to stop while it waited: nothing will train from scratch
            log.info("state_sync_stopped", tries=tries)
            return False
        reason = "no peer answered" if tries == 0 else f"{tries} fetches failed"
        log.warning("state_sync_skipped", reason=f"{reason}; training from scratch")
        return False

    def _dialable(self, peers: list[str]) -> list[tuple[str, str]]:
        out = []
        for peer in peers:
            address = self._membership.address_of(peer)
            if address is not None and not is_client_address(address):
                out.append((peer, address))
        return out

    async def _synced(self, donors: list[str], step: int, waited: float) -> None:
        log.info("state_synced", peer=",".join(p[:12] for p in donors), peer_step=step,
                 donors=len(donors))  # fmt: skip
        await self._to_thread(self._algorithm.model_replaced)
        if not self._untrusted:
            return
        if len(donors) < UNTRUSTED_DONORS:
            log.warning("state_sync_few_donors", donors=len(donors), wanted=UNTRUSTED_DONORS,
                        waited_s=round(waited, 1), detail="gossip.robust is set, but the model is "
                        + ("one donor's: a dishonest one could have sent any model"
                           if len(donors) == 1 else "the mean of two donors': a dishonest one "
                           "could have moved it anywhere"))  # fmt: skip
        # (1e30 momentum from one admitted attacker left a joiner at chance accuracy for good:
        # it cannot be checked against ours; nor can buffers, which gossip never mixes back)
        log.info("optimizer_state_not_taken", peer=",".join(p[:12] for p in donors),
                 reason="gossip.robust is set: a peer's optimizer state and buffers are not "
                 "trusted", detail="the optimizer starts fresh and the model keeps its own "
                 "buffers")  # fmt: skip

    async def fetch_buffers(self, peer: str, address: str) -> bool:
        """Take `peer`'s buffers (BatchNorm's running statistics) into our model. Fails softly:
        returns False, and says why in the log; a model without buffers asks nothing."""
        ours = await self._to_thread(self._trainer.buffers)
        if not ours:
            return False
        numel = sum(t.numel() for t in ours.values())
        try:
            deadline = self._links.exchange_deadline(peer, 4 * numel + 4096, trio.current_time())
            reply, payload, _ = await self._request(
                address, BufferStateRequest(), b"", deadline_s=deadline, expect_peer=peer)
            if not isinstance(reply, BufferStateReply):
                raise _Failed(getattr(reply, "reason", "") or type(reply).__name__)
            device = self._trainer.task_device
            pairs = await self._to_thread(lambda: compress.decode_named(
                payload, max_numel=numel, device=device, allowed=("none",)))  # fmt: skip
            await self._to_thread(self._trainer.load_buffers, dict(pairs))
        except (*FETCH_ERRORS, ValueError) as exc:
            log.warning("buffers_skipped", peer=peer[:12], reason=str(exc)[:300],
                        detail="the model keeps its own buffers (e.g. fresh running statistics)")
            return False
        log.info("buffers_synced", peer=peer[:12], buffers=len(pairs))
        return True

    async def _optimizer_from(self, peer: str, address: str) -> None:
        """Take `peer`'s optimizer state now or, for a loop of the user's own that has wrapped
        no optimizer yet, at its wrap: only then is our optimizer's class known, and a peer's
        state of another class is refused from its layout, before any of it is fetched (a
        joiner fetched 6.6 MB of it at join, and skipped it at wrap)."""
        defer = getattr(self._trainer, "fetch_optimizer_at_wrap", None)
        if defer is None or self._trainer.optimizer is not None:
            await self.fetch_optimizer(peer, address)
            return
        if not await self.fetch_optimizer(peer, address, layout_only=True):
            return  # (a layout no optimizer of this model could have: refused now, said)
        token = trio.lowlevel.current_trio_token()

        def at_wrap() -> None:  # (the user's thread, in wrap: it waits for the fetch)
            with contextlib.suppress(trio.RunFinishedError):  # (the node stopped: start fresh)
                trio.from_thread.run(self.fetch_optimizer, peer, address, trio_token=token)

        defer(at_wrap)
        log.info("optimizer_state_at_wrap", peer=peer[:12],
                 detail="the peer's optimizer state is fetched at wrap(), if its optimizer is "
                 "of the same class as the one wrapped")  # fmt: skip

    async def fetch_optimizer(self, peer: str, address: str, *, layout_only: bool = False
                              ) -> bool:  # fmt: skip
        """Take `peer`'s optimizer state into ours (our hyperparameters stay). Fails softly:
        returns False, and says why in the log, when it could not. `layout_only`: only check
        that its layout fits our model (and optimizer, if there is one); fetch none of it.
        """
        try:
            layout = await self._optimizer_layout_of(peer, address)
            if layout_only:
                return True
            shapes = {name: tuple(shape) for name, shape, _ in layout.tensors}
            plan = _optimizer_plan(layout.tensors, self._chunk_numel)
            dtypes = {name: _float_dtype(dtype) for name, _, dtype in layout.tensors}
            staged: dict[str, torch.Tensor] = {}
            progress = _Progress(peer, len(plan), plan.numel * 4)
            device = self._trainer.task_device

            async def one(index: int) -> None:
                request = OptimizerStateRequest(plan=plan.digest, chunk_numel=plan.chunk_numel,
                                                index=index)  # fmt: skip
                nbytes = CHUNKS_IN_FLIGHT * (4 * plan.chunk_numel_of(index) + 4096)
                started = trio.current_time()
                deadline = self._links.exchange_deadline(peer, nbytes, started)
                reply, payload, _ = await self._request(
                    address, request, b"", deadline_s=deadline, expect_peer=peer)
                if not isinstance(reply, OptimizerStateReply) or reply.chunks != len(plan):
                    raise _Failed(getattr(reply, "reason", "") or type(reply).__name__)
                values = await self._to_thread(decode_chunk, payload, "none", plan, index, device)
                for s, t in zip(plan.chunks[index], values, strict=True):
                    buffer = staged.get(s.name)
                    if buffer is None:
                        buffer = staged[s.name] = torch.empty(shapes[s.name], device=device,
                                                              dtype=dtypes[s.name])  # fmt: skip
                    buffer.reshape(-1)[s.start : s.stop] = t
                progress.add(len(payload), trio.current_time())

            await in_window(range(len(plan)), one, catch=FETCH_ERRORS)
            now = await self._to_thread(self._trainer.adopt_optimizer_state, layout.cls, staged,
                                        layout.scalars, layout.schedule_steps,
                                        layout.params)  # fmt: skip
        except (*FETCH_ERRORS, ValueError) as exc:
            # (a peer that has not stepped yet is the usual start of a swarm, not a problem)
            say = log.info if isinstance(exc, _NothingYet) else log.warning
            say("optimizer_state_skipped", peer=peer[:12], reason=str(exc)[:300],
                detail="the optimizer starts fresh, and so does a schedule passed to wrap "
                "(its warmup again), though the model is the peer's")  # fmt: skip
            return False
        log.info("optimizer_state_synced" if now else "optimizer_state_fetched", peer=peer[:12],
                 optimizer=layout.cls, tensors=len(staged), mb=round(progress.received / 1e6, 1),
                 **({} if now else {"detail": "loaded into the optimizer at wrap"}))  # fmt: skip
        return True

    async def _optimizer_layout_of(self, peer: str, address: str) -> OptimizerLayout:
        """`peer`'s optimizer layout, checked against ours (when ours is known already).

        Raises:
            _Failed, TransportError, ValueError: none to be had, or one that does not fit.
        """
        deadline = self._links.exchange_deadline(peer, 64 * 1024, trio.current_time())
        reply, payload, _ = await self._request(
            address, OptimizerStateRequest(layout=True), b"", deadline_s=deadline,
            expect_peer=peer)  # fmt: skip
        if isinstance(reply, ErrorReply) and reply.code == "busy":
            raise _NothingYet(reply.reason)
        if not isinstance(reply, OptimizerStateReply):
            raise _Failed(getattr(reply, "reason", "") or type(reply).__name__)
        if len(payload) > MAX_LAYOUT_BYTES:
            raise _Failed(f"an optimizer layout of {len(payload)} bytes")
        try:
            layout = msgspec.msgpack.decode(bytes(payload), type=OptimizerLayout)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _Failed(f"a bad optimizer layout: {exc}") from None
        shapes = {n: tuple(s) for n, s, _ in layout.tensors}
        # whatever our optimizer is (a library node's is not known before wrap), its state is
        # of our parameters' shapes (or scalars), and a few copies of the model at most
        params = self._trainer.params()
        ours = {tuple(t.shape) for t in params.values()} | {()}
        odd = sorted(n for n, shape in shapes.items() if shape not in ours)
        if odd:
            raise _Failed(f"optimizer state tensors of shapes no parameter has: {odd[:3]}")
        total, model = sum(math.prod(s) for s in shapes.values()), sum(
            t.numel() for t in params.values())  # fmt: skip
        if total > MAX_STATE_COPIES * model + len(shapes):
            raise _Failed(f"an optimizer state of {total:,} values for a model of {model:,}")
        self._trainer.optimizer_fits(layout.cls, shapes, layout.scalars, layout.params)
        return layout

    def _check_mismatch(self, peers: list[str]) -> None:
        """Raise ModelMismatch once MISMATCH_PEERS peers (or all the dialable ones) refused our
        model's plan as another model's."""
        dialable = [p for p in peers if not is_client_address(self._membership.address_of(p) or "")]
        if self._differ and len(self._differ) >= min(MISMATCH_PEERS, len(dialable)):
            names = ", ".join(sorted(p[:12] for p in self._differ))
            ours = self._trainer.describe()
            raise ModelMismatch(
                f"the model differs from the swarm's: {len(self._differ)} peer(s) ({names}) "
                "train other parameter names or shapes, or froze other parameters or values "
                f"(ours: {ours}); every peer must build the same model, freeze the same "
                "parameters (requires_grad False) and load the same frozen values before "
                "joining"
            )

    async def _fetch_model(self, donors: list[tuple[str, str]]) -> tuple[int | None, str]:
        """Replace our model with `donors`' (one: its model; three: each value's median, so one
        dishonest donor cannot move a value beyond the honest two's; two: their mean), chunk by
        chunk into a staging copy, each chunk asked of every donor, loaded once every chunk is
        in. Returns the donors' median step, or None and the donor that failed (the model
        stays as it was)."""
        plan = self._plan(self._chunk_numel)
        k = len(donors)
        staged: dict[str, torch.Tensor] = {}
        progress = _Progress(",".join(p[:12] for p, _ in donors), len(plan) * k,
                             plan.numel * 4 * k)  # fmt: skip
        parts: dict[int, list] = {}
        steps: dict[str, int] = {}

        async def one(item: int) -> None:
            index, d = divmod(item, k)
            peer, address = donors[d]
            try:
                steps[peer], tensors = await self._get_chunk(peer, address, plan, index, progress)
            except FETCH_ERRORS as exc:
                raise _DonorFailed(peer, exc) from None
            got = parts.setdefault(index, [None] * k)
            got[d] = tensors
            if all(t is not None for t in got):
                del parts[index]
                mids = got[0] if k == 1 else await self._to_thread(_medians, got)
                for s, mid in zip(plan.chunks[index], mids, strict=True):  # (here: one writer)
                    self._staging(staged, plan, s.name)[s.start : s.stop] = mid

        width = min(self._width(peer, plan) for peer, _ in donors)
        try:
            await in_window(range(k), one, catch=_DonorFailed)  # (chunk 0 of each: plans agree)
            await in_window(range(k, k * len(plan)), one, catch=_DonorFailed, width=width)
        except _DonorFailed as exc:
            log.info("state_sync_failed", peer=exc.peer[:12], reason=str(exc),
                     chunks=progress.done, donors=k)  # fmt: skip
            if isinstance(exc.cause, _Failed) and str(exc).startswith(MODELS_DIFFER):
                self._differ.add(exc.peer)
            return None, exc.peer
        trainer = self._trainer
        try:
            await self._to_thread(
                lambda: trainer.load_params(staged, max_norm_ratio=float("inf"))
            )
        except FETCH_ERRORS as exc:  # (each chunk was checked: not expected)
            log.info("state_sync_failed", reason=str(exc), donors=k)
            return None, donors[0][0]
        ordered = sorted(steps.values())
        return ordered[(len(ordered) - 1) // 2], ""

    def _width(self, peer: str, plan: ChunkPlan) -> int:
        """Chunks of `plan` to have in flight from `peer`: from its link's bandwidth-delay
        product (see chunks_in_flight)."""
        est = self._links.estimate(peer, trio.current_time())
        return chunks_in_flight(est.rtt_s, est.goodput_bytes_per_s, 4 * plan.chunk_numel,
                                len(plan))  # fmt: skip

    def _staging(self, staged: dict, plan: ChunkPlan, name: str) -> torch.Tensor:
        """The flat staging tensor of `name` (made on first use)."""
        buffer = staged.get(name)
        if buffer is None:
            shape = dict(plan.shapes)[name]
            buffer = staged[name] = torch.empty(shape, device=self._trainer.task_device)
        return buffer.reshape(-1)

    async def _get_chunk(self, peer, address, plan: ChunkPlan, index: int,
                         progress) -> tuple[int, list[torch.Tensor]]:  # fmt: skip
        """Chunk `index` of `peer`'s model, decoded and checked: (its step, the values)."""
        request = StateRequest(
            algorithm=self._name, plan=plan.digest, chunk_numel=plan.chunk_numel, index=index
        )
        # the link's deadline for a whole window (this chunk may queue behind the others) and
        # the slow start of a fresh connection's
        now = trio.current_time()
        nbytes = self._width(peer, plan) * (4 * plan.chunk_numel_of(index) + 4096)
        rtt = self._links.estimate(peer, now).rtt_s
        deadline = self._links.exchange_deadline(peer, nbytes, now) + slow_start_s(rtt, nbytes)
        started = trio.current_time()
        reply, payload, _ = await self._request(
            address, request, b"", deadline_s=deadline, expect_peer=peer
        )
        if not isinstance(reply, StateReply) or reply.chunks != len(plan):
            reason = getattr(reply, "reason", "") or f"{type(reply).__name__} for chunk {index}"
            raise _Failed(reason)
        device = self._trainer.task_device
        tensors = await self._to_thread(
            decode_chunk, payload, "none", plan, index, device, None,
            self._trainer.chunk_staging("state_sync"),
        )  # fmt: skip
        now = trio.current_time()
        if now > started:
            self._links.record_transfer(peer, len(payload), now - started, now)
        progress.add(len(payload), now)
        return reply.step, tensors


def _medians(got: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each slice's elementwise median over the donors' values (three; the mean of two)."""
    out = []
    for values in zip(*got, strict=True):
        if len(values) == 3:  # (elementwise: torch.median over a stacked dim sorts)
            a, b, c = values
            out.append(torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c)))
        else:
            out.append(torch.stack(values).mean(dim=0))
    return out


FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def _float_dtype(name: str) -> torch.dtype:
    dtype = FLOAT_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"an optimizer state tensor of dtype {name!r} (floating point only)")
    return dtype


def _optimizer_plan(tensors, chunk_numel: int) -> ChunkPlan:
    """The chunk plan of an optimizer's state tensors ((name, shape, dtype) each).

    Raises:
        ValueError: more than MAX_CHUNKS chunks, or no tensors.
    """
    if not tensors:
        raise ValueError("no optimizer state tensors")
    return ChunkPlan.build([(name, tuple(shape)) for name, shape, _ in tensors], chunk_numel)


class _Progress:
    """Logs a fetch's progress every PROGRESS_EVERY_S."""

    def __init__(self, peer: str, chunks: int, nbytes: int) -> None:
        self.peer, self.chunks, self.nbytes = peer, chunks, nbytes
        self.done = self.received = 0
        self.started = self.logged = trio.current_time()

    def add(self, nbytes: int, now: float) -> None:
        self.done += 1
        self.received += nbytes
        if now - self.logged >= PROGRESS_EVERY_S:
            self.logged = now
            rate = self.received / max(now - self.started, 1e-9) / 1e6
            log.info("state_sync_progress", peer=self.peer[:12], chunks=self.done,
                     of=self.chunks, mb=round(self.received / 1e6, 1),
                     mb_per_s=round(rate, 1))  # fmt: skip
