# The node: it builds its parts and runs them in one trio nursery. Parts: the transport (secure
# requests), membership (who is alive, link probes), peer choice (partners, codecs, deadlines),
# the algorithm (exchanges), state sync, the checkpointer, the status reporter and the training
# driver. Invariants: training runs in worker threads and never waits for the network beyond an
# algorithm's deadline; a request from a peer reaches exactly the part that owns its message
# type, and one of a type nobody owns is refused, counted and logged; on stop (signal, max_steps,
# leaving `open_node`) the node lets an exchange in flight finish for at most STOP_GRACE_S, writes
# a checkpoint and tells the swarm it leaves.
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import BinaryIO

import structlog
import torch
import trio

from geotrain import compress
from geotrain.gossip import LinkTable, PartnerSelector, client_address

from ._allocator import tune_allocator
from ._certificate_watch import CertificateWatch, renew_hint, utc
from ._checkpointer import Checkpointer, load_checkpoint
from ._config import ConfigError, NodeConfig, TrainingConfig, preset_overrides
from ._credentials import load_identity
from ._driver import LoopDriver, TrainingDriver
from ._limits import raise_open_files_limit
from ._log_quota import log_within_quota
from ._membership_service import MembershipService
from ._memory import (
    LOOP_OPTIMIZER,
    MemoryEstimate,
    check_budget,
    estimate_memory,
    fit_budget,
    optimizer_state_copies,
)
from ._metrics import MetricsServer, NodeCollector
from ._mismatch import MismatchWatch
from ._peer_choice import PeerChoice, model_dtype
from ._protocol import node_header_codec
from ._state_sync import ModelMismatch, StateSync
from ._status_report import Progress, StatusReporter, StatusSources
from .algorithms import MODEL_CODECS, Algorithm, AlgorithmContext, get_algorithm
from .identity import Admission, Identity
from .state import Checkpoint, CheckpointStore, NodeStatus, StateDir, write_atomically
from .training import (
    LEDGER_AHEAD_STEPS,
    Diverged,
    LoopTrainer,
    Task,
    TaskContext,
    Trainer,
    UnknownTaskParam,
    resolve_device,
    resolve_task,
)
from .transport import (
    ErrorReply,
    Header,
    ListenError,
    PeerInfo,
    Transport,
    TransportConfig,
    open_transport,
)

STOP_GRACE_S = 5.0
# [training] settings a loop of the user's own reads; every other one is the daemon trainer's
LOOP_READS_TRAINING = ("wait_for_peers", "wait_for_peers_s", "eval_every", "eval_every_s",
                       "seed", "max_nonfinite_steps")  # fmt: skip
# ... and those left alone though unread: documented as unused (task, params), or written by
# `node init --shard` into the node.toml a library node shares (shard_index, num_shards)
LOOP_IGNORES_TRAINING = ("task", "params", "shard_index", "num_shards")
log = structlog.get_logger()

Handler = Callable[[PeerInfo, Header, memoryview], Awaitable[tuple[Header, bytes]]]


class _Router:
    """Hands each request to the part that owns its message type."""

    def __init__(self) -> None:
        self._routes: dict[type[Header], Handler] = {}
        self.rejected: Counter[str] = Counter()
        self._held: dict[type[Header], str] = {}  # kinds answered "busy" for now, and why

    def hold(self, part, reason: str) -> None:
        """Answer `part`'s requests "busy" (`reason`) until release(): not refused, nothing
        counted against the asking peer, which tries again later."""
        self._held.update(dict.fromkeys(part.handles, reason))

    def release(self) -> None:
        self._held.clear()

    def add(self, part) -> None:
        for kind in part.handles:
            if kind in self._routes:
                raise ValueError(f"two parts of the node answer {kind.__name__}")
            self._routes[kind] = part.handle

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        handler = self._routes.get(type(header))
        if handler is not None:
            held = self._held.get(type(header))
            if held is not None:
                return ErrorReply(code="busy", reason=held), b""
            return await handler(peer, header, payload)
        if not self._routes:  # still starting: the peer may retry
            return ErrorReply(code="busy", reason="node starting"), b""
        self.rejected["unexpected"] += 1
        kind = type(header).__name__
        log_within_quota("message_rejected", peer=peer.short_id, kind="unexpected", reason=kind)
        return ErrorReply(code="bad_request", reason=f"unexpected {kind}"), b""


class Node:
    """One geotrain node. Run it with `open_node(config)` (in-process) or `await node.run()`
    inside trio; `request_stop()` ends it cleanly.

    Args:
        config: the validated node configuration.
        identity: this node's key; admission: whom it lets in and its own credential.
        loop: a training loop of the user's own (see geotrain.join) instead of the config's task.
        on_ready: called (in the node's thread) once peers are ready and the model is synced.
    """

    def __init__(
        self,
        config: NodeConfig,
        identity: Identity,
        admission: Admission,
        *,
        loop: LoopTrainer | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.loop = loop  # a user's own training loop (geotrain.join), or None: the task's
        self._on_ready = on_ready  # called once the node can take the loop's first step
        self.steps: trio.MemorySendChannel | None = None  # where a user's loop sends its steps
        self.identity = identity
        self.admission = admission
        self.state = StateDir(config.state.dir)
        self.spec = get_algorithm(config.gossip.algorithm)
        seed = config.training.seed * 7919 + int.from_bytes(identity.public_key[:4], "big")
        self.rng = random.Random(seed)
        self.links = LinkTable()
        self.selector = PartnerSelector(config.gossip.policy, identity.peer_id, rng=self.rng)
        self.progress = Progress()
        self.router = _Router()
        self.address: str | None = None
        self.algorithm: Algorithm | None = None
        self.memory: MemoryEstimate | None = None  # (made by prepare: the model's size is known)
        # what the node does before it is ready (said when a join times out)
        self._starting: Callable[[], str] = lambda: (
            "starting: building the task or trainer, taking the state directory, listening")
        self._stop = trio.Event()
        self._stopped = trio.Event()
        self._running = True
        self._reporter: StatusReporter | None = None
        self.metrics: MetricsServer | None = None
        self._checkpointer: Checkpointer | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._transport: Transport | None = None
        self._prepared: tuple[Task, Trainer, Checkpoint | None, CheckpointStore] | None = None
        self._state_lock: BinaryIO | None = None  # held while this node runs on its state.dir
        self._mismatch: ModelMismatch | None = None  # the swarm refused our model: stop, fail
        self._ledger: dict | None = None  # [privacy]: privacy.json as it was at start

    def request_stop(self) -> None:
        """Ask the node to stop (idempotent); `run()` returns after a clean shutdown. A loop of
        the user's own is heard no more (its step channel closes)."""
        self._stop.set()
        if self.steps is not None:
            self.steps.close()

    async def wait_stopped(self) -> None:
        """Wait until `run()` has finished its shutdown (max_steps reached, or stop requested)."""
        await self._stopped.wait()

    @property
    def final_checkpoint_failed(self) -> bool:
        """The checkpoint at stop could not be written (logged: checkpoint_failed, final)."""
        return self._checkpointer is not None and self._checkpointer.final_failed

    @property
    def rejected_messages(self) -> Counter[str]:
        """Requests refused as malformed, by kind ("gossip", "probe", "unexpected")."""
        return self.router.rejected + self.membership.rejected

    def status(self) -> NodeStatus:
        """A snapshot of the node (what status.json holds). Only once it listens."""
        if self._reporter is None:
            raise RuntimeError("the node is not running yet")
        return self._reporter.snapshot()

    # -- set-up (a worker thread) ---------------------------------------------------------------
    def _build_training(self) -> tuple[Task | None, Trainer, Checkpoint | None, CheckpointStore]:
        t = self.config.training
        store = CheckpointStore(self.state.checkpoints, keep=self.config.state.keep)
        if self.loop is not None:
            if self.config.privacy.enabled:  # the user's own optimizer is not ours to wrap
                raise ConfigError("privacy.epsilon: [privacy] covers the daemon's own training "
                                  "only, not a loop of your own (geotrain.join)")  # fmt: skip
            self._fit_memory(self.loop, LOOP_OPTIMIZER, "assumed until wrap() shows yours")
            return None, self.loop, load_checkpoint(store, self.config.gossip.algorithm), store
        if t.threads:
            torch.set_num_threads(t.threads)
        ctx = TaskContext(
            shard_index=t.shard_index,
            num_shards=t.num_shards,
            seed=t.seed,
            partition=t.partition,
            alpha=t.alpha,
            device=resolve_device(t.device),
            params=t.params,
        )
        task = resolve_task(t.task)(ctx)
        self._check_params(t.task, ctx)
        # unset settings (None) take the task's recipe; with [privacy] its per-sample clipping
        # replaces the recipe's clipping of the whole gradient
        clip = 0.0 if self.config.privacy.enabled else t.clip_grad_norm
        trainer = Trainer(
            task, optimizer=t.optimizer, lr=t.lr, slowdown=t.slowdown,
            precision=t.precision, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
            schedule=t.schedule, total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
            clip_grad_norm=clip, accumulate=t.accumulate, step_time_s=t.step_time_ms / 1000,
        )  # fmt: skip
        self._make_private(trainer)
        self._ledger = self._read_privacy_ledger(trainer)
        self._fit_memory(trainer, trainer.recipe.optimizer)
        ckpt = load_checkpoint(store, self.config.gossip.algorithm)
        return task, trainer, ckpt, store

    @staticmethod
    def _check_params(task: str, ctx: TaskContext) -> None:
        """A [training.params] key the task never asked for: refused for a built-in task,
        warned for a plugin."""
        try:
            unasked = ctx.check_unasked(task)
        except UnknownTaskParam as exc:
            raise ConfigError(f"training.params.{exc.key}: {exc}") from None
        if unasked:
            log.warning("task_params_unused", task=task, unused=unasked, asked=sorted(ctx.asked))

    def _fit_memory(self, trainer: LoopTrainer, optimizer: str | None, described: str = "") -> None:
        """Estimate the memory this node needs, lower the algorithm's settings that grow with it
        to what fits (logged), and refuse a config that still does not (MemoryBudgetError)."""
        self.config, self.memory, fitted = fit_budget(self.config, trainer, self.spec, optimizer,
                                                      described)  # fmt: skip
        if fitted:
            log.warning("memory_fitted", detail=fitted)
        self._say_estimate()
        check_budget(self.config, self.memory)

    def _say_estimate(self, hint: str = "") -> None:
        """Log the memory estimate (a warning, with `hint`, when it says something is wrong)."""
        assert self.memory is not None
        (log.warning if hint else log.info)(
            "memory_estimate", need_gb=round(self.memory.total_gb, 3),
            detail=self.memory.explain(), limit_gb=self.config.limits.memory_gb,
            **({"hint": hint} if hint else {}))  # fmt: skip

    def starting(self) -> str:
        """What the node is doing on its way to ready (joining: why join has not returned)."""
        return self._starting()

    def measure_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A loop of the user's own wrapped its optimizer: the memory estimate (status,
        metrics) counts that optimizer's state instead of the Adam-sized guess made at join
        (logged when it changes; the settings fitted at join stay)."""
        if self.loop is None or self.memory is None:
            return
        copies, described = optimizer_state_copies(optimizer)
        if described == self.memory.optimizer:
            return
        self.memory = estimate_memory(self.config, self.loop, self.spec, state_copies=copies,
                                      described=described)  # fmt: skip
        if self._reporter is not None:
            self._reporter.sources.memory_estimate_mb = self.memory.total_gb * 1000
        limit = self.config.limits.memory_gb
        over = limit is not None and self.memory.total_gb > limit  # (amsgrad's third copy)
        self._say_estimate("your optimizer keeps more state than the Adam-sized guess the check "
                           "at join passed: the node may outgrow limits.memory_gb" if over else "")

    def _make_private(self, trainer: Trainer) -> None:
        """[privacy]: Opacus on the trainer, or a ConfigError saying why it cannot be."""
        p = self.config.privacy
        if not p.enabled:
            return
        from .training import PrivacyError, make_private

        try:
            private = make_private(
                trainer, epsilon=p.epsilon, delta=p.delta, max_grad_norm=p.max_grad_norm,
                noise_multiplier=p.noise_multiplier, planned_steps=self.config.training.max_steps,
                accountant=p.accountant, sample_rate=p.sample_rate,
            )  # fmt: skip
        except ImportError as exc:
            raise ConfigError(
                f"[privacy] needs opacus: pip install 'geotrain[privacy]' ({exc})"
            ) from exc
        except PrivacyError as exc:
            raise ConfigError(f"privacy: {exc}") from exc
        log.info("privacy_on", epsilon=p.epsilon, delta=p.delta, max_grad_norm=p.max_grad_norm,
                 noise_multiplier=round(private.noise_multiplier, 4),
                 sample_rate=round(private.sample_rate, 5), accountant=p.accountant)  # fmt: skip

    def _read_privacy_ledger(self, trainer: Trainer) -> dict | None:
        """[privacy]: the budget this node recorded as spent (state.dir/privacy.json), or None.

        Raises:
            ConfigError: the file is there but unreadable: the node does not start afresh on a
                budget it may have spent (remove the file only with every model it sent).
        """
        path = self.state.privacy_ledger
        if trainer.private is None:
            return None
        try:
            state = json.loads(path.read_bytes())
            trainer.private.steps_in(state)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"state.dir: the privacy ledger {str(path)!r} cannot be read ({exc}): it records "
                "the budget this node's data has spent, so the node does not start without it; "
                "restore it, or remove it only if every model this node ever sent is gone too"
            ) from None
        return state

    def _open_privacy_ledger(self, trainer: Trainer) -> None:
        """After the checkpoint's restore: take the ledger's spend where it counts more steps
        than the checkpoint (the node was killed after it), then record every private step in it
        before it is taken."""
        private = trainer.private
        if private is None:
            return
        ledger, path = self._ledger, self.state.privacy_ledger
        if ledger is not None and private.steps_in(ledger) > private.steps_in(private.state()):
            before = private.epsilon()
            private.load_state(ledger)
            log.warning("privacy_ledger_ahead", epsilon_checkpoint=round(before, 4),
                        epsilon_spent=round(private.epsilon(), 4), ledger=str(path),
                        detail="the ledger counts more private steps than the checkpoint "
                        "(the node stopped without writing one after them): they stay spent; "
                        f"after a kill it counts up to {LEDGER_AHEAD_STEPS} steps more than were "
                        "taken")  # fmt: skip

        def write(state: dict) -> None:
            try:
                write_atomically(path, json.dumps(state).encode())
            except OSError as exc:  # no step is taken that the ledger does not count
                raise self._state_dir_error(exc) from None

        private.ledger = write

    async def _replan_privacy(self, trainer: Trainer) -> None:
        """After the spend is restored: a budget raised since it was spent is said; a derived
        noise is re-derived for what is left of the budget over the steps left of
        training.max_steps, and refused where it would drown the gradients.

        Raises:
            ConfigError: the noise would more than double (the budget left is too small for
                the steps asked): the node would train on noise, and its swarm would mix it in.
        """
        private, p = trainer.private, self.config.privacy
        if private is None:
            return
        max_steps = self.config.training.max_steps
        left = max_steps - trainer.step
        # (accountant work: in a worker thread, both)
        change, spent = await trio.to_thread.run_sync(
            lambda: (private.replan(left), round(private.epsilon(), 4)))
        if private.budget_raised:
            log.warning("privacy_budget_raised", epsilon_spent=spent, budget=p.epsilon,
                        detail="the ledger's budget was spent; privacy.epsilon is larger now, so "
                        "training on this node's data goes on, its spend counted from the "
                        "ledger's")  # fmt: skip
        if change is None:
            return
        was, now = change
        if now > 2 * was:
            raise ConfigError(
                f"privacy: epsilon {spent:g} of {p.epsilon:g} is spent (the ledger), and "
                f"spreading the rest over the {left} steps left of training.max_steps "
                f"({max_steps}) needs noise {now:.3g} where it was {was:.3g}: more than twice "
                "the noise, the gradients drown in it, and the swarm mixes the result in. "
                "Raise privacy.epsilon (a new budget), lower training.max_steps, or set "
                "privacy.noise_multiplier to choose the noise yourself")  # fmt: skip
        log.warning("privacy_noise_replanned", noise_multiplier=round(now, 4),
                    was=round(was, 4), epsilon_spent=spent, budget=p.epsilon, steps_left=left,
                    detail="the noise that spends what is left of the budget over the steps "
                    "left of training.max_steps")  # fmt: skip

    def _transport_config(self) -> TransportConfig:
        net = self.config.network
        return TransportConfig(
            listen=net.listen,
            max_message_bytes=net.max_message_mb * 2**20,
            handshake_timeout_s=net.handshake_timeout_s,
            max_pending_handshakes=net.max_pending_handshakes,
            # parts stay 4 MiB: a default 8 MiB chunk in one message was 1.16x faster on
            # loopback (bench_exchange) but raised a 100M-parameter node's peak by 0.2 model
            # copies (bench_memory: +1.55 vs +1.31), the allocator keeping more free blocks
        )

    # -- the run --------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped. `task_status.started(address)` once the node listens."""
        try:
            await self._run(task_status)
        finally:
            self._release_state()
            self._stopped.set()

    async def prepare(self) -> None:
        """Build the task, the trainer and the memory estimate, and read the newest checkpoint
        (a worker thread). `run()` does it when nobody did; `open_node` does it first, so that
        what stops a node before it starts reaches the caller as itself.

        Raises:
            MemoryBudgetError: the config does not fit limits.memory_gb. ResumeError: the state
                directory holds another algorithm's checkpoint. ValueError: a bad task.
                StateDirInUse: another node runs on state.dir. ConfigError: the node's membership
                certificate has expired, or the metrics port is taken.
        """
        if self._prepared is None:
            self._check_certificate()
            self._warn_unused_settings()
            self._warn_loop_unused_training()
            self._warn_preset_overridden()
            self._warn_codec_for_models()
            tune_allocator()
            raise_open_files_limit()
            self._start_metrics()  # first: a port in use stops the node before it writes a file
            made = not self.state.root.exists()
            try:
                self._take_state_dir()
                self._prepared = await trio.to_thread.run_sync(self._build_training)
            except BaseException:
                if made and self._state_lock is not None:  # (refused: leave no state dir)
                    self.state.remove_unused()
                self._release_state()
                self._close_metrics()
                self.metrics = None  # (a prepare() tried again starts it again)
                raise

    def _warn_unused_settings(self) -> None:
        """A [gossip.<algorithm>] table of another algorithm than the one configured is kept
        (one may switch back) but said: a typo'd algorithm name or a forgotten line left it
        silently unused."""
        gossip = self.config.gossip
        unused = sorted(set(gossip.algorithm_settings) - {gossip.algorithm})
        if unused:
            log.warning("gossip_settings_unused", tables=[f"gossip.{n}" for n in unused],
                        algorithm=gossip.algorithm,
                        hint=f"gossip.algorithm is {gossip.algorithm!r}: these tables do "
                        "nothing")  # fmt: skip

    def _warn_loop_unused_training(self) -> None:
        """[training] settings that only the daemon's trainer reads, set (not at their defaults)
        for a loop of the user's own, are said: precision = "bf16", accumulate or lr there did
        nothing under geotrain.join, silently (the task and its params are documented as unused:
        a node.toml shared with daemons has them)."""
        if self.loop is None:
            return
        training, defaults = self.config.training, TrainingConfig()
        unused = [f.name for f in dataclasses.fields(training)
                  if f.name not in LOOP_READS_TRAINING + LOOP_IGNORES_TRAINING
                  and getattr(training, f.name) != getattr(defaults, f.name)]  # fmt: skip
        if unused:
            log.warning("training_settings_unused", settings=[f"training.{f}" for f in unused],
                        hint="your own loop does these itself (optimizer, schedule, autocast, "
                        "clipping, accumulation, device); geotrain.join reads only "
                        f"{', '.join(LOOP_READS_TRAINING)} from [training]")  # fmt: skip

    def _warn_preset_overridden(self) -> None:
        """A gossip preset whose settings the [gossip] table sets otherwise is said: `geotrain
        node init` writes `algorithm = "adpsgd"`, so adding `preset = "frugal"` to that file ran
        adpsgd with the preset's codec, and nothing said so."""
        overridden = preset_overrides(self.config.gossip)
        if overridden:  # another algorithm is hardly the preset at all; a setting, a choice
            say = log.warning if "algorithm" in overridden else log.info
            say("gossip_preset_overridden", preset=self.config.gossip.preset,
                        overridden={k: f"{mine!r} (preset: {theirs!r})"
                                    for k, (mine, theirs) in overridden.items()},
                        hint="the [gossip] table or --set gives these, and those win; remove "
                        "them to take the preset's")  # fmt: skip

    def _warn_codec_for_models(self) -> None:
        """A fixed codec that does not carry every value (top-k, random-k, sign, PowerSGD), for
        an algorithm that averages whole models, is taken but said (BENCHMARKS.md): dpsgd with
        sign ended two digits nodes at 0.61; sparse codecs average only the values they carry,
        and eight digits peers whose slow links took top-k stalled near 0.92 where int4 and
        int8 (what `auto` chooses among for these) reached 0.95."""
        gossip = self.config.gossip
        if gossip.codec == "auto" or not self.spec.averages_models:
            return
        codec = compress.get_codec(gossip.codec)
        if codec.name not in MODEL_CODECS:
            what = ("averages only the values it sends, which leaves models further apart"
                    if codec.sparse else "flattens every value")  # fmt: skip
            log.warning("codec_drops_model_values", codec=gossip.codec, algorithm=gossip.algorithm,
                        hint=f"{gossip.algorithm} averages whole models and this codec {what}: "
                        "it cost accuracy where int8 did not; prefer 'auto', int8 or int4 (or "
                        "choco or diloco, which send differences)")  # fmt: skip

    def _take_state_dir(self) -> None:
        """Create state.dir and hold it (StateDirInUse when another node does)."""
        self._warn_if_state_moved()
        try:
            self.state.create()
            if self._state_lock is None:
                self._state_lock = self.state.lock()
                self.state.create()  # (a node refused at start that held it before removed it)
                if self._state_lock is not None:  # (no flock: another node may be writing)
                    count, size = self.state.remove_left_temp_files()
                    if count:
                        log.info("left_temp_files_removed", count=count, mb=round(size / 1e6, 1),
                                 reason="an earlier node here was killed while it wrote them")
        except OSError as exc:  # read-only, a file in the way, no permission, no space
            raise self._state_dir_error(exc) from None

    def _warn_if_state_moved(self) -> None:
        """The default state.dir followed the working directory before 2026-12-03; it is the
        config file's folder's now. A node that would start afresh there while ./state holds
        checkpoints says so (it was likely started from that folder before)."""
        old = Path.cwd() / "state"
        # (a state.dir of another name was chosen: nothing moved it)
        if self.state.root.name != "state" or self.state.root.resolve() == old.resolve() or any(
                self.state.checkpoints.glob("ckpt-*")):  # fmt: skip
            return
        if (old / "checkpoints").is_dir() and any((old / "checkpoints").glob("ckpt-*")):
            log.warning("state_dir_moved", state_dir=str(self.state.root), found=str(old),
                        hint="checkpoints lie in ./state of the working directory, not in "
                        "state.dir (the default is now relative to the config file): set "
                        f"state.dir = {str(old)!r} to resume from them")  # fmt: skip

    def _close_metrics(self) -> None:
        if self.metrics is not None:  # (kept: its port stays readable after the node stopped)
            self.metrics.close()

    def _release_state(self) -> None:
        if self._state_lock is not None:
            self._state_lock.close()
            self._state_lock = None

    def _check_certificate(self) -> None:
        cert = self.admission.certificate
        if cert is not None and cert.expires_at <= time.time():
            path = self.config.identity.certificate
            raise ConfigError(
                f"identity.certificate = {str(path)!r}: expired at {utc(cert.expires_at)}; "
                + renew_hint(self.identity.peer_id, path, running=False)
            )

    def _start_metrics(self) -> None:
        """Serve Prometheus metrics when [metrics] listen is set (before anything else starts,
        so a port in use stops the node at once)."""
        listen = self.config.metrics.listen
        if listen is None or self.metrics is not None:
            return
        self.metrics = MetricsServer(listen, NodeCollector(
            self._metrics_snapshot, self._age,
            lambda: self._checkpointer.failures if self._checkpointer is not None else 0))
        log.info("metrics_listening", address=f"{listen.rpartition(':')[0]}:{self.metrics.port}")

    def _metrics_snapshot(self) -> NodeStatus:
        """The status, from the HTTP server's thread: a hop to the node's loop."""
        if self._token is None or self._reporter is None:
            raise RuntimeError("the node is not running (yet)")
        return trio.from_thread.run_sync(self._reporter.snapshot, trio_token=self._token)

    def _age(self) -> float | None:
        at = self._checkpointer.written_at if self._checkpointer is not None else None
        return None if at is None else time.monotonic() - at

    async def _run(self, task_status) -> None:
        await self.prepare()
        assert self._prepared is not None
        task, trainer, ckpt, store = self._prepared
        self.trainer = trainer
        cfg = self.config
        trainer.max_bad_losses = cfg.training.max_nonfinite_steps
        try:
            async with open_transport(
                self._transport_config(), self.identity, self.admission, self.router.handle,
                codec=node_header_codec(), on_disconnect=self._peer_disconnected,
            ) as transport:  # fmt: skip
                self.address = cfg.network.advertise or transport.address
                # a client (network.reachable = false) announces an address nobody dials; its own
                # address stays the loopback one, for the local `geotrain status`
                announced = self.address if cfg.network.reachable else client_address(
                    self.identity.peer_id)  # fmt: skip
                self.membership = membership = MembershipService(
                    self.identity.peer_id, announced, self._bootstrap(),
                    cfg.gossip.probe_interval_s, transport, self.links, self.selector, self.rng,
                )  # fmt: skip
                try:
                    await self._serve(task_status, task, trainer, ckpt, store, transport,
                                      membership)  # fmt: skip
                finally:
                    self._close_metrics()
        except ListenError as exc:  # an operator's mistake, said as one: in use, not ours
            self._close_metrics()
            raise ConfigError(f"network.listen = {cfg.network.listen!r}: {exc}") from None
        log.info("node_stopped", step=trainer.step)

    async def _serve(self, task_status, task, trainer, ckpt, store, transport, membership) -> None:
        """The node's parts, in one nursery, from start to clean stop."""
        cfg = self.config
        async with trio.open_nursery() as nursery:
            algorithm = self._make_algorithm(trainer, membership, transport, nursery)
            self.algorithm = algorithm
            checkpointer = Checkpointer(
                store, cfg.gossip.algorithm, cfg.training.task, trainer, algorithm, self.links
            )
            if ckpt is not None:
                checkpointer.restore(ckpt)
                if isinstance(trainer, Trainer):
                    log.info("resumed", step=ckpt.step)
                else:  # (a loop that keeps checkpoints of its own lost newer work unawares)
                    log.info("resumed", step=ckpt.step, state_dir=str(cfg.state.dir),
                             detail="the model given to join is now this checkpoint's, and so "
                             "will the optimizer's and scheduler's state be at wrap: a loop "
                             "with a step counter or checkpoints of its own goes on from "
                             "swarm.step")  # fmt: skip
            if isinstance(trainer, Trainer):
                self._open_privacy_ledger(trainer)
                await self._replan_privacy(trainer)
            state_sync = StateSync(
                trainer, algorithm, cfg.gossip.algorithm, transport, membership, self.links,
                self.rng, chunk_numel=cfg.network.chunk_numel,
                max_chunk_numel=cfg.network.max_chunk_numel,
                untrusted=cfg.gossip.robust != "none",
            )  # fmt: skip
            self._reporter = StatusReporter(
                StatusSources(
                    self.identity.peer_id, self.address, cfg.gossip.algorithm,
                    cfg.training.task if task is not None else "own loop",
                    task.metric if task is not None else trainer.metric, trainer, transport,
                    membership, self.links, algorithm, self.progress,
                    None if self.memory is None else self.memory.total_gb * 1000,
                    reachable=cfg.network.reachable,
                    rejected_messages=lambda: self.rejected_messages,
                    sync_bytes=lambda: (state_sync.bytes_in, state_sync.bytes_out),
                ),
                self.state, cfg.state.status_every_s, lambda: self._running,
                # (0 turns the file off; any other size is at least a byte)
                metrics_max_bytes=math.ceil(cfg.state.metrics_max_mb * 1e6),
            )  # fmt: skip
            for part in (membership, state_sync, self._reporter, algorithm):
                self.router.add(part)
            # its model is not the swarm's yet: a peer's exchange would be refused by the norm
            # check and counted against that honest peer
            if self._will_fetch(ckpt, membership):
                self.router.hold(algorithm, "starting: fetching the swarm's model (state sync)")
            self._checkpointer, self._token = checkpointer, trio.lowlevel.current_trio_token()
            self._transport = transport
            self._write_node_info()
            await nursery.start(membership.run)
            nursery.start_soon(self._reporter.run)
            watch = CertificateWatch(transport, self.identity, self.admission,
                                     cfg.identity.certificate)  # fmt: skip
            nursery.start_soon(watch.run)
            log.info(
                "node_started", peer=self.identity.short_id, address=self.address,
                reachable=cfg.network.reachable,
                task=cfg.training.task if self.loop is None else "own loop",
                algorithm=cfg.gossip.algorithm,
                device=str(trainer.task_device), step=trainer.step,
                parameters=sum(p.numel() for p in trainer.params().values()),
                frozen=trainer.frozen_numel,
            )  # fmt: skip
            task_status.started(self.address)
            diverged = None
            try:
                await self._train(membership, state_sync, checkpointer, algorithm, ckpt)
            except Diverged as exc:  # a clean stop (status, leave), then the node fails with it
                diverged = exc
            except Exception:  # refused at join (models differ), a task's error...: the swarm
                # is told too, or its members keep choosing us until we are declared dead; then
                # the error goes on as it was (a forced stop's cancellation does not replace it)
                self._running = False
                with trio.move_on_after(STOP_GRACE_S):
                    try:
                        with contextlib.suppress(Exception):
                            await membership.leave(STOP_GRACE_S)
                        with contextlib.suppress(Exception):
                            await self._reporter.write()
                    except trio.Cancelled:
                        pass
                raise
            self._running = False  # from here on every status written says "stopped"
            await self._reporter.write()
            await membership.leave(STOP_GRACE_S)
            nursery.cancel_scope.cancel()
        if diverged is not None:
            raise diverged
        if self._mismatch is not None:
            raise self._mismatch

    def _bootstrap(self) -> list[str]:
        """network.bootstrap without this node's own address (listen or advertise: a config
        copied to every machine, the first one's included, names it), which is said: a node
        that dialled itself waited 30 s for a state sync nobody could answer. Called once, at
        start (the membership service keeps the result)."""
        net = self.config.network
        own = {a for a in (net.listen, net.advertise, self.address) if a}
        port = net.listen.rpartition(":")[2]
        host = net.listen.removeprefix("tcp://").rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "*"):  # listening everywhere: loopback reaches it too
            own |= {f"tcp://127.0.0.1:{port}", f"tcp://localhost:{port}", f"tcp://[::1]:{port}"}
        mine = [a for a in net.bootstrap if a in own]
        if mine:
            log.warning("bootstrap_is_self", addresses=mine,
                        detail="network.bootstrap names this node's own address: skipped" + (
                            "; with no other bootstrap this node starts a swarm of its own"
                            if len(mine) == len(net.bootstrap) else ""))  # fmt: skip
        return [a for a in net.bootstrap if a not in own]

    def _model_refused(self, error: ModelMismatch) -> None:
        """The swarm refuses our model (MismatchWatch): a clean stop, then the node fails."""
        self._mismatch = error
        log.error("model_mismatch", error=str(error))
        self.request_stop()

    def _peer_disconnected(self, peer_id: str) -> None:
        if self.algorithm is not None:
            self.algorithm.peer_disconnected(peer_id)

    def _make_algorithm(self, trainer, membership, transport: Transport, nursery) -> Algorithm:
        params = trainer.params()
        shapes = [(n, tuple(p.shape)) for n, p in params.items()]
        peers = PeerChoice(
            self.config.gossip, membership, self.links, self.selector, shapes,
            trainer.step_interval_s, client=not self.config.network.reachable,
            model_dtype=model_dtype(p.dtype for p in params.values()),
        )  # fmt: skip
        ctx = AlgorithmContext(
            trainer=trainer,
            gossip=self.config.gossip,
            settings=self.config.gossip.settings,
            peers=peers,
            network=MismatchWatch(transport, trainer.describe, self._model_refused),
            rng=self.rng,
            start_soon=nursery.start_soon,
            chunk_numel=self.config.network.chunk_numel,
            max_chunk_numel=self.config.network.max_chunk_numel,
        )
        return self.spec.runtime(ctx)

    async def _train(self, membership, state_sync, checkpointer, algorithm, ckpt) -> None:
        cfg = self.config
        t = cfg.training
        boot = ", ".join(cfg.network.bootstrap) or "none"
        self._starting = lambda: (f"waiting for peers: {membership.live_count()} of "
                                  f"{t.wait_for_peers} live (training.wait_for_peers; "
                                  f"network.bootstrap: {boot})")  # fmt: skip
        await membership.wait_for_peers(t.wait_for_peers, t.wait_for_peers_s, self._stop)
        if self._will_fetch(ckpt, membership):
            self._starting = lambda: "fetching the swarm's model from a peer (state sync)"
            try:
                await state_sync.fetch(self._stop)
            finally:
                self.router.release()
        cadence = {"eval_every": t.eval_every, "eval_every_s": t.eval_every_s,
                   "checkpoint_every": cfg.state.checkpoint_every,
                   "stop": self._stop}  # fmt: skip
        if self.loop is not None:
            self.steps, receive = trio.open_memory_channel(math.inf)
            if self._stop.is_set():  # asked to stop while it waited for peers (join timed out)
                self.steps.close()
            driver: TrainingDriver = LoopDriver(receive, self.trainer, algorithm, checkpointer,
                                                self.progress, max_steps=0, **cadence)
        else:
            driver = TrainingDriver(self.trainer, algorithm, checkpointer, self.progress,
                                    max_steps=t.max_steps, **cadence)  # fmt: skip
        if self._on_ready is not None:
            self._on_ready()
        await driver.run()
        await driver.finish(STOP_GRACE_S)
        private = getattr(self.trainer, "private", None)
        if private is not None:  # a clean stop: the steps counted ahead are given back
            await trio.to_thread.run_sync(private.settle)

    def _will_fetch(self, ckpt, membership: MembershipService) -> bool:
        """Whether the node fetches the swarm's state before its first step: it has nothing
        learned (no checkpoint, or one of step 0: a run stopped before its first step), state
        sync is on and there are peers to fetch from."""
        return ((ckpt is None or ckpt.step == 0) and self.config.gossip.state_sync
                and bool(membership.bootstrap))  # fmt: skip

    def _write_node_info(self) -> None:
        info = {"peer_id": self.identity.peer_id, "address": self.address, "pid": os.getpid()}
        try:
            write_atomically(self.state.node_info, json.dumps(info).encode())
        except OSError as exc:  # a full disk at start: one line, not a traceback
            raise self._state_dir_error(exc) from None

    def _state_dir_error(self, exc: OSError) -> ConfigError:
        return ConfigError(f"state.dir = {str(self.state.root)!r}: cannot keep the node's "
                           f"state there: {exc.strerror or exc}")  # fmt: skip


@asynccontextmanager
async def open_node(
    config: NodeConfig, *, identity: Identity | None = None, admission: Admission | None = None
) -> AsyncIterator[Node]:
    """Run a node inside the caller's trio program; yields it once it listens.

    Training runs in the background; leaving the block asks the node to stop and waits for its
    clean shutdown (exchange finished or abandoned, checkpoint written, swarm told).

    Args:
        config: the node's configuration.
        identity, admission: given directly, or (both None) loaded from `config.identity`.

    Raises:
        ConfigError: the identity files are wrong; MemoryBudgetError (a ConfigError): the config
            does not fit limits.memory_gb. ResumeError: the state directory holds another
            algorithm's checkpoint. ValueError: the task cannot be built.
    """
    if identity is None or admission is None:
        identity, admission = load_identity(config)
    node = Node(config, identity, admission)
    await node.prepare()
    interrupted, diverged = False, []
    async with trio.open_nursery() as nursery:

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            try:
                await node.run(task_status=task_status)
            except* Diverged as group:  # raised after the block, not in an exception group
                diverged.extend(leaf_errors(group))
                nursery.cancel_scope.cancel()  # the block ends with the node

        await nursery.start(run)
        watching = trio.CancelScope()

        async def on_ctrl_c() -> None:
            """Ctrl-C asks the node to stop cleanly (trio's own KeyboardInterrupt landed in
            whichever of the node's tasks ran, which took the node down without a checkpoint
            or a goodbye, and reached the caller wrapped in an exception group); once it has,
            the block is cancelled and KeyboardInterrupt raised. A second Ctrl-C is trio's
            again: at once. Left alone where SIGINT is not trio's (a program's own handler or
            signal receiver) or off the main thread."""
            nonlocal interrupted
            handler = signal.getsignal(signal.SIGINT)
            if not getattr(handler, "__qualname__", "").startswith("KIManager."):
                return
            with watching:
                try:
                    with trio.open_signal_receiver(signal.SIGINT) as signals:
                        async for _ in signals:
                            interrupted = True
                            log.warning("interrupted", signal="SIGINT",
                                        detail="the node stops cleanly (checkpoint, leave); "
                                        "the block then raises KeyboardInterrupt; Ctrl-C again "
                                        "stops at once")  # fmt: skip
                            node.request_stop()
                            break
                except RuntimeError:  # not the main thread: trio catches no signal there
                    return
            if interrupted:
                await node.wait_stopped()
                nursery.cancel_scope.cancel()  # the block too: a loop of its own ends

        nursery.start_soon(on_ctrl_c)
        try:
            yield node
        finally:
            watching.cancel()
            node.request_stop()
    if diverged:
        raise diverged[0]
    if interrupted:  # (raised here, outside the nursery: a plain KeyboardInterrupt)
        raise KeyboardInterrupt


def leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    """The errors inside trio's (nested) exception groups, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += leaf_errors(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out
