# The node: wiring. It builds its parts and runs them in one trio nursery: the transport
# (secure requests), the router, membership (who is alive, link probes), peer choice (partners,
# codecs, deadlines), the algorithm (exchanges), state sync, the checkpointer, the privacy
# ledger, the status reporter, metrics, the certificate and mismatch watches and the training
# driver; each lives in a module of its own. Invariants: training runs in worker threads and
# never waits for the network beyond an algorithm's deadline; a request from a peer reaches
# exactly the part that owns its message type (Router); on stop (signal, max_steps, leaving
# `open_node`) the node lets an exchange in flight finish for at most STOP_GRACE_S, writes a
# checkpoint and tells the swarm it leaves.
from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
import trio

from geotrain.gossip import LinkTable, PartnerSelector, client_address

from ._allocator import tune_allocator
from ._certificate_watch import CertificateWatch
from ._checkpointer import Checkpointer
from ._config import ConfigError, NodeConfig
from ._driver import LoopDriver, TrainingDriver
from ._limits import raise_open_files_limit
from ._membership_service import MembershipService
from ._memory import MemoryEstimate, estimate_memory, optimizer_state_copies
from ._metrics import MetricsServer, serve_node_metrics
from ._mismatch import MismatchWatch
from ._peer_choice import PeerChoice, model_dtype
from ._privacy_ledger import PrivacyLedger
from ._protocol import node_header_codec
from ._router import Router
from ._startup import bootstrap_peers, check_certificate, config_warnings, state_dir_moved
from ._state_hold import StateDirHold
from ._state_sync import ModelMismatch, StateSync
from ._status_report import Progress, StatusReporter, StatusSources
from ._training_setup import Prepared, build_training, say_estimate
from .algorithms import Algorithm, AlgorithmContext, get_algorithm
from .identity import Admission, Identity
from .state import NodeStatus, StateDir
from .training import Diverged, LoopTrainer
from .transport import ListenError, Transport, TransportConfig, open_transport

STOP_GRACE_S = 5.0
log = structlog.get_logger()


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
        self.router = Router()
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
        self._prepared: Prepared | None = None
        self._hold = StateDirHold(self.state)  # state.dir, held while this node runs on it
        self._ledger = PrivacyLedger(config.privacy, config.training.max_steps,
                                     self.state.privacy_ledger, self._hold.error)  # fmt: skip
        self._mismatch: ModelMismatch | None = None  # the swarm refused our model: stop, fail

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
        say_estimate(self.memory, limit, "your optimizer keeps more state than the Adam-sized "
                     "guess the check at join passed: the node may outgrow limits.memory_gb"
                     if over else "")  # fmt: skip

    # -- set-up ---------------------------------------------------------------------------------
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
        if self._prepared is not None:
            return
        check_certificate(self.admission.certificate, self.identity.peer_id,
                          self.config.identity.certificate, time.time())  # fmt: skip
        for warning in config_warnings(self.config, averages_models=self.spec.averages_models,
                                       own_loop=self.loop is not None):  # fmt: skip
            warning.log(log)
        tune_allocator()
        raise_open_files_limit()
        listen = self.config.metrics.listen
        if listen is not None and self.metrics is None:  # first: a port in use stops the node
            # before it writes a file
            self.metrics = serve_node_metrics(listen, self._metrics_snapshot,
                                              lambda: self._checkpointer)  # fmt: skip
        try:
            for warning in state_dir_moved(self.state.root, self.state.checkpoints, Path.cwd()):
                warning.log(log)
            self._hold.take()
            await trio.to_thread.run_sync(self._build_training)
        except BaseException:
            self._hold.give_up()  # (refused: leave no state dir)
            if self.metrics is not None:
                self.metrics.close()
            self.metrics = None  # (a prepare() tried again starts it again)
            raise

    def _build_training(self) -> Prepared:
        """build_training in a worker thread; the node takes its fitted config and estimate."""
        prepared = build_training(self.config, self.state, self.spec, self.loop, self._ledger)
        self._prepared, self.config, self.memory = prepared, prepared.config, prepared.memory
        self.trainer = prepared.trainer
        return prepared

    def _transport_config(self) -> TransportConfig:
        net = self.config.network
        return TransportConfig(
            listen=net.listen,
            max_message_bytes=net.max_message_mb * 2**20,
            handshake_timeout_s=net.handshake_timeout_s,
            max_pending_handshakes=net.max_pending_handshakes,
            connections_per_peer=net.connections_per_peer,
            # (parts stay the transport's 4 MiB: larger ones made exchanges on loopback faster
            # but left the allocator more free blocks, raising a large node's peak memory)
        )

    def _metrics_snapshot(self) -> NodeStatus:
        """The status, from the HTTP server's thread: a hop to the node's loop."""
        if self._token is None or self._reporter is None:
            raise RuntimeError("the node is not running (yet)")
        return trio.from_thread.run_sync(self._reporter.snapshot, trio_token=self._token)

    # -- the run --------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped. `task_status.started(address)` once the node listens."""
        try:
            await self._run(task_status)
        finally:
            self._hold.release()
            self._stopped.set()

    async def _run(self, task_status) -> None:
        await self.prepare()
        assert self._prepared is not None
        trainer, cfg = self._prepared.trainer, self.config
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
                bootstrap, warnings = bootstrap_peers(cfg.network, self.address)
                for warning in warnings:
                    warning.log(log)
                self.membership = MembershipService(
                    self.identity.peer_id, announced, bootstrap, cfg.gossip.probe_interval_s,
                    transport, self.links, self.selector, self.rng,
                )  # fmt: skip
                try:
                    await self._serve(task_status, transport)
                finally:
                    if self.metrics is not None:  # (kept: its port stays readable after)
                        self.metrics.close()
        except ListenError as exc:  # an operator's mistake, said as one: in use, not ours
            if self.metrics is not None:
                self.metrics.close()
            raise ConfigError(f"network.listen = {cfg.network.listen!r}: {exc}") from None
        log.info("node_stopped", step=trainer.step)

    async def _serve(self, task_status, transport: Transport) -> None:
        """The node's parts, in one nursery, from start to clean stop."""
        assert self._prepared is not None
        cfg, membership = self.config, self.membership
        task, trainer, ckpt = self._prepared.task, self._prepared.trainer, self._prepared.checkpoint
        async with trio.open_nursery() as nursery:
            algorithm = self._make_algorithm(trainer, transport, nursery)
            self.algorithm = algorithm
            checkpointer = Checkpointer(self._prepared.store, cfg.gossip.algorithm,
                                        cfg.training.task, trainer, algorithm, self.links)
            if ckpt is not None:
                checkpointer.restore(ckpt)  # (logged: resumed)
            await self._ledger.resume(trainer)
            state_sync = StateSync(
                trainer, algorithm, cfg.gossip.algorithm, transport, membership, self.links,
                self.rng, chunk_numel=cfg.network.chunk_numel,
                max_chunk_numel=cfg.network.max_chunk_numel,
                untrusted=cfg.gossip.robust != "none",
            )  # fmt: skip
            self._reporter = self._make_reporter(transport, algorithm, state_sync)
            for part in (membership, state_sync, self._reporter, algorithm):
                self.router.add(part)
            # its model is not the swarm's yet: a peer's exchange would be refused by the norm
            # check and counted against that honest peer
            if self._will_fetch():
                self.router.hold(algorithm, "starting: fetching the swarm's model (state sync)")
            self._checkpointer, self._token = checkpointer, trio.lowlevel.current_trio_token()
            self._transport = transport
            self._hold.write_node_info(self.identity.peer_id, self.address)
            await nursery.start(membership.run)
            nursery.start_soon(self._reporter.run)
            watch = CertificateWatch(transport, self.identity, self.admission,
                                     cfg.identity.certificate)  # fmt: skip
            nursery.start_soon(watch.run)
            log.info(
                "node_started", peer=self.identity.short_id, address=self.address,
                reachable=cfg.network.reachable,
                task=cfg.training.task if task is not None else "own loop",
                algorithm=cfg.gossip.algorithm,
                device=str(trainer.task_device), step=trainer.step,
                parameters=sum(p.numel() for p in trainer.params().values()),
                frozen=trainer.frozen_numel,
            )  # fmt: skip
            task_status.started(self.address)
            diverged = None
            try:
                await self._train(state_sync, checkpointer, algorithm)
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

    def _make_reporter(self, transport: Transport, algorithm: Algorithm,
                       state_sync: StateSync) -> StatusReporter:  # fmt: skip
        assert self._prepared is not None
        cfg, task, trainer = self.config, self._prepared.task, self._prepared.trainer
        sources = StatusSources(
            self.identity.peer_id, self.address, cfg.gossip.algorithm,
            cfg.training.task if task is not None else "own loop",
            task.metric if task is not None else trainer.metric, trainer, transport,
            self.membership, self.links, algorithm, self.progress,
            None if self.memory is None else self.memory.total_gb * 1000,
            reachable=cfg.network.reachable,
            rejected_messages=lambda: self.rejected_messages,
            sync_bytes=lambda: (state_sync.bytes_in, state_sync.bytes_out),
        )  # fmt: skip
        # (0 turns the metrics file off; any other size is at least a byte)
        return StatusReporter(sources, self.state, cfg.state.status_every_s,
                              lambda: self._running,
                              metrics_max_bytes=math.ceil(cfg.state.metrics_max_mb * 1e6))

    def _model_refused(self, error: ModelMismatch) -> None:
        """The swarm refuses our model (MismatchWatch): a clean stop, then the node fails."""
        self._mismatch = error
        log.error("model_mismatch", error=str(error))
        self.request_stop()

    def _peer_disconnected(self, peer_id: str) -> None:
        if self.algorithm is not None:
            self.algorithm.peer_disconnected(peer_id)

    def _make_algorithm(self, trainer: LoopTrainer, transport: Transport, nursery) -> Algorithm:
        params = trainer.params()
        shapes = [(n, tuple(p.shape)) for n, p in params.items()]
        peers = PeerChoice(
            self.config.gossip, self.membership, self.links, self.selector, shapes,
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

    async def _train(self, state_sync: StateSync, checkpointer: Checkpointer,
                     algorithm: Algorithm) -> None:  # fmt: skip
        cfg, membership = self.config, self.membership
        t = cfg.training
        boot = ", ".join(cfg.network.bootstrap) or "none"
        self._starting = lambda: (f"waiting for peers: {membership.arrived_count()} of "
                                  f"{t.wait_for_peers} showed up (training.wait_for_peers; "
                                  f"network.bootstrap: {boot})")  # fmt: skip
        await membership.wait_for_peers(t.wait_for_peers, t.wait_for_peers_s, self._stop)
        if self._will_fetch():
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
        await self._ledger.settle(self.trainer)  # a clean stop: steps counted ahead given back

    def _will_fetch(self) -> bool:
        """Whether the node fetches the swarm's state before its first step: it has nothing
        learned (no checkpoint, or one of step 0: a run stopped before its first step), state
        sync is on and there are peers to fetch from."""
        assert self._prepared is not None
        ckpt = self._prepared.checkpoint
        return ((ckpt is None or ckpt.step == 0) and self.config.gossip.state_sync
                and bool(self.membership.bootstrap))  # fmt: skip
