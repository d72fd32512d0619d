# The node daemon: one trio nursery holding the transport, membership, training, exchanges and
# status. Invariants: training runs in worker threads and never waits for the network; every
# request to a peer has a deadline; a bad message from a peer is answered with an error, counted
# and logged, and changes nothing; on stop (signal, max_steps) the node abandons what it cannot
# finish in STOP_GRACE_S, writes a checkpoint and tells the swarm it leaves.
from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, deque
from dataclasses import dataclass

import structlog
import torch
import trio

import compress
from gossip._codec_choice import choose_codec
from gossip._errors import RemoteProtocolError as GossipRemoteError
from gossip._links import LinkTable
from gossip._membership import Membership, Send
from gossip._membership_config import MembershipConfig
from gossip._partners import PartnerSelector

from ._admission import Admission
from ._algo_choco import ChocoRuntime
from ._algo_diloco import DilocoRuntime
from ._algo_dpsgd import DpsgdRuntime
from ._algo_selsync import SelsyncRuntime
from ._algorithm import AlgorithmContext, AlgorithmRuntime
from ._checkpoint import Checkpoint, CheckpointStore, write_atomically
from ._config import NodeConfig
from ._device import resolve_device
from ._exchange import ADPSGD_LADDER, ExchangeService
from ._identity import Identity
from ._messages import ErrorReply, Header, Ping, Pong
from ._protocol import (
    MAX_PROBE_BYTES,
    Delivered,
    Exchange,
    Gossip,
    Probe,
    ProbeReply,
    StateRequest,
    StatusReply,
    StatusRequest,
    node_header_codec,
    unwrap_gossip,
    wrap_gossip,
)
from ._statedir import StateDir
from ._status import NodeStatus, PeerStatus, append_metrics, write_status
from ._tasks import Task, TaskContext, resolve_task
from ._trainer import Trainer
from ._transport import PeerInfo, TransportConfig, TransportError, open_transport

STOP_GRACE_S = 5.0
PROBE_BYTES = 256 * 1024  # above the link table's smallest goodput sample, small on any link
STATE_SYNC_WAIT_S = 30.0
log = structlog.get_logger()


class ResumeError(Exception):
    """The state directory holds a checkpoint this configuration cannot continue from."""


@dataclass
class _Progress:
    metric: float | None = None
    metric_step: int | None = None


class Node:
    """One geotrain node. Build it, then `await node.run()` inside trio; `request_stop()` ends it.

    Args:
        config: the validated node configuration.
        identity: this node's key; admission: who may talk to it and its own credential.
    """

    def __init__(self, config: NodeConfig, identity: Identity, admission: Admission) -> None:
        self.config = config
        self.identity = identity
        self.admission = admission
        self.state = StateDir(config.state.dir)
        self.rejected_messages: Counter[str] = Counter()
        self._stop = trio.Event()
        self._progress = _Progress()
        self._step_times: deque[float] = deque(maxlen=50)
        self._wake_membership = trio.Event()
        self._exchange_running = False
        self.algo: AlgorithmRuntime | None = None
        self._checkpointed_step = -1
        self._running = True
        self._status_lock = trio.Lock()
        self._started = time.monotonic()
        g = config.gossip
        interval = g.probe_interval_s
        self.membership_config = MembershipConfig(
            probe_interval_s=interval, probe_timeout_s=0.4 * interval
        )
        seed = config.training.seed * 7919 + int.from_bytes(identity.public_key[:4], "big")
        self.rng = random.Random(seed)
        self.links = LinkTable()
        self.selector = PartnerSelector(g.policy, identity.peer_id, rng=self.rng)

    def request_stop(self) -> None:
        """Ask the node to stop (idempotent); `run()` returns after a clean shutdown."""
        self._stop.set()

    # -- set-up ---------------------------------------------------------------------------------
    def _build(self) -> tuple[Task, Trainer, Checkpoint | None]:
        t = self.config.training
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
        trainer = Trainer(task, optimizer=t.optimizer or "sgd", lr=t.lr, slowdown=t.slowdown)
        store = CheckpointStore(self.state.checkpoints, keep=self.config.state.keep)
        ckpt, skipped = store.load_latest()
        for reason in skipped:
            log.warning("checkpoint_skipped", reason=reason)
        if ckpt is not None and ckpt.algorithm != self.config.gossip.algorithm:
            raise ResumeError(
                f"{self.state.checkpoints} holds a checkpoint of algorithm {ckpt.algorithm!r} "
                f"(step {ckpt.step}); this node is configured for "
                f"{self.config.gossip.algorithm!r}: use another state.dir or the same algorithm"
            )
        self.store = store
        return task, trainer, ckpt

    def _make_algorithm(self) -> AlgorithmRuntime | None:
        """The runtime of a non-default algorithm (adpsgd runs on the exchange service alone)."""
        name = self.config.gossip.algorithm
        if name == "adpsgd":
            return None
        ctx = AlgorithmContext(
            trainer=self.trainer,
            config=self.config.gossip,
            links=self.links,
            request=self.transport.request,
            live_peers=self.membership.live_peers,
            address_of=self.membership.address_of,
            choose_partner=self._choose_partner,
            choose_codec=self._choose_codec,
            record_outcome=self.selector.record_outcome,
            record_busy=self.selector.record_busy,
            rng=self.rng,
            start_soon=lambda fn, *args: self._nursery.start_soon(fn, *args),
        )
        if name == "selsync":
            return SelsyncRuntime(ctx, self.exchange)
        runtimes = {"dpsgd": DpsgdRuntime, "choco": ChocoRuntime, "diloco": DilocoRuntime}
        return runtimes[name](ctx)

    def _restore(self, ckpt: Checkpoint) -> None:
        tensors = ckpt.tensors
        self.trainer.restore(tensors, ckpt.meta, ckpt.step)
        if self.algo is not None:
            algo = {k[5:]: v for k, v in tensors.items() if k.startswith("algo/")}
            self.algo.load_state(algo, ckpt.meta.get("algo") or {})
        ef = {k[3:]: v for k, v in tensors.items() if k.startswith("ef/")}
        self.exchange.feedback.load_state_dict(ef)
        links = ckpt.meta.get("links")
        if isinstance(links, dict):
            try:
                self.links.load_state_dict(links, trio.current_time())
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("link_state_ignored", reason=str(exc))

    async def _checkpoint(self) -> None:
        """Write a checkpoint: link state read here, tensors copied and written in a thread."""
        links = self.links.state_dict(self._now)

        def write() -> int:
            tensors, meta = self.trainer.state_tensors()
            tensors.update({f"ef/{k}": v for k, v in self.exchange.feedback_state().items()})
            if self.algo is not None:
                algo_tensors, meta["algo"] = self.algo.state()
                tensors.update({f"algo/{k}": v for k, v in algo_tensors.items()})
            meta["links"] = links
            meta["task"] = self.config.training.task
            step = meta["step"]
            self.store.save(Checkpoint(step, self.config.gossip.algorithm, tensors, meta))
            return step

        if self.trainer.step == self._checkpointed_step:
            return
        step = await trio.to_thread.run_sync(write)
        self._checkpointed_step = step
        log.info("checkpoint_written", step=step)

    # -- the run --------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until stopped. `task_status.started(address)` once the node listens."""
        self.state.create()
        task, self.trainer, ckpt = await trio.to_thread.run_sync(self._build)
        self.task = task
        net = self.config.network
        tcfg = TransportConfig(
            listen=net.listen,
            max_message_bytes=net.max_message_mb * 2**20,
            handshake_timeout_s=net.handshake_timeout_s,
        )
        async with open_transport(
            tcfg, self.identity, self.admission, self._handle, codec=node_header_codec()
        ) as transport:
            self.transport = transport
            self.address = net.advertise or transport.address
            self.membership = Membership(
                self.identity.peer_id,
                self.address,
                self.membership_config,
                self.rng,
                incarnation=int(time.time()),
            )
            self.exchange = ExchangeService(
                self.trainer,
                self.config.gossip,
                self.links,
                self._choose_partner,
                self._choose_codec,
                self.membership.address_of,
                transport.request,
                self.selector.record_outcome,
                self.selector.record_busy,
            )
            self.algo = self._make_algorithm()
            if ckpt is not None:
                self._restore(ckpt)
                log.info("resumed", step=ckpt.step)
            self._write_node_info()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._membership_loop)
                nursery.start_soon(self._status_loop)
                nursery.start_soon(self._probe_loop)
                log.info(
                    "node_started",
                    peer=self.identity.short_id,
                    address=self.address,
                    task=self.config.training.task,
                    algorithm=self.config.gossip.algorithm,
                    device=str(self.trainer.task_device),
                    step=self.trainer.step,
                )
                task_status.started(self.address)
                await self._wait_for_peers()
                if ckpt is None and self.config.gossip.state_sync and net.bootstrap:
                    await self._state_sync()
                await self._train_loop()
                await self._shutdown()
                nursery.cancel_scope.cancel()
        log.info("node_stopped", step=self.trainer.step)

    @property
    def _now(self) -> float:
        return trio.current_time()

    async def _train_loop(self) -> None:
        t, g = self.config.training, self.config.gossip
        while not self._stop.is_set() and not (t.max_steps and self.trainer.step >= t.max_steps):
            result = await trio.to_thread.run_sync(self.trainer.train_step)
            self._step_times.append(time.monotonic())
            step = result.step
            if self.algo is not None:
                await self.algo.after_step(result)
            elif step % g.exchange_every == 0 and not self._exchange_running:
                if self.membership.live_peers():
                    self._exchange_running = True
                    self._nursery.start_soon(self._run_exchange)
            if step % t.eval_every == 0:
                await self._evaluate()
            if step % self.config.state.checkpoint_every == 0:
                await self._checkpoint()

    async def _run_exchange(self) -> None:
        try:
            await self.exchange.exchange_once()
        finally:
            self._exchange_running = False

    async def _evaluate(self) -> None:
        self._progress.metric = await trio.to_thread.run_sync(self.trainer.evaluate)
        self._progress.metric_step = self.trainer.step

    async def _shutdown(self) -> None:
        with trio.move_on_after(STOP_GRACE_S):
            while self._exchange_running:
                await trio.sleep(0.01)
        await self._evaluate()
        await self._checkpoint()
        self._running = False  # from here on every status written says "stopped"
        await self._write_status()
        sends = self.membership.leave(self._now)
        with trio.move_on_after(min(STOP_GRACE_S, 2 * self.membership_config.probe_interval_s)):
            async with trio.open_nursery() as n:
                for send in sends:
                    n.start_soon(self._deliver, send)

    # -- partner and codec choice ---------------------------------------------------------------
    def _payload_nbytes(self, spec: str) -> int:
        shapes = [(n, tuple(p.shape)) for n, p in sorted(self.trainer.params().items())]
        return compress.expected_nbytes_named(shapes, compress.get_codec(spec))

    def _choose_partner(self, now: float) -> str | None:
        return self.selector.choose(
            self.membership.live_peers(),
            self.links,
            self._payload_nbytes(self._fixed_or("int8")),
            now,
        )

    def _fixed_or(self, spec: str) -> str:
        return spec if self.config.gossip.codec == "auto" else self.config.gossip.codec

    def _step_time(self) -> float:
        times = self._step_times
        if len(times) < 2:
            return 0.05
        return (times[-1] - times[0]) / (len(times) - 1)

    def _choose_codec(self, peer: str, now: float) -> str:
        if self.config.gossip.codec != "auto":
            return self.config.gossip.codec
        return choose_codec(
            self.links.estimate(peer, now),
            self.exchange.numel,
            self._step_time(),
            ADPSGD_LADDER,
            size_of=lambda spec, _n: self._payload_nbytes(spec),
            steps_per_exchange=self.config.gossip.exchange_every,
        )

    # -- membership -----------------------------------------------------------------------------
    async def _membership_loop(self) -> None:
        sends = self.membership.join(self.config.network.bootstrap, self._now)
        while True:
            for send in sends:
                self._nursery.start_soon(self._deliver, send)
            self._drain_membership()
            deadline = self.membership.next_deadline()
            with trio.move_on_at(deadline if deadline != float("inf") else self._now + 3600):
                await self._wake_membership.wait()
            self._wake_membership = trio.Event()
            sends = self.membership.tick(self._now)

    def _drain_membership(self) -> None:
        for sample in self.membership.drain_rtt_samples():
            self.links.record_rtt(sample.peer_id, sample.rtt_s, sample.at)
        for event in self.membership.drain_events():
            log.info(f"peer_{event.kind}", peer=event.peer_id[:12], incarnation=event.incarnation)

    async def _deliver(self, send: Send) -> None:
        try:
            await self.transport.request(
                send.address,
                wrap_gossip(send.message),
                deadline_s=self.membership_config.probe_interval_s,
                expect_peer=send.peer_id,
            )
        except TransportError as exc:
            log.debug("gossip_undelivered", address=send.address, reason=str(exc))

    async def _probe_loop(self) -> None:
        """Measure the links the partner policy looked at but knows too little about."""
        while True:
            await trio.sleep(self.membership_config.probe_interval_s)
            for peer in self.selector.probe_targets(self.links, self._now, limit=1):
                address = self.membership.address_of(peer)
                if address is not None:
                    await self._probe(peer, address)

    async def _probe(self, peer: str, address: str) -> None:
        started = self._now
        deadline = self.links.exchange_deadline(peer, PROBE_BYTES, started)
        try:
            reply, _, _ = await self.transport.request(
                address, Probe(), bytes(PROBE_BYTES), deadline_s=deadline, expect_peer=peer
            )
        except TransportError as exc:
            log.debug("probe_failed", peer=peer[:12], reason=str(exc))
            return
        if isinstance(reply, ProbeReply) and reply.received == PROBE_BYTES:
            self.links.record_transfer(peer, PROBE_BYTES, self._now - started, self._now)

    async def _wait_for_peers(self) -> None:
        want, limit = self.config.training.wait_for_peers, self.config.training.wait_for_peers_s
        if not want:
            return
        with trio.move_on_after(limit):
            while len(self.membership.live_peers()) < want and not self._stop.is_set():
                await trio.sleep(0.05)
            log.info("peers_ready", live_peers=len(self.membership.live_peers()))
            return
        log.warning("peers_not_ready", live_peers=len(self.membership.live_peers()), wanted=want)

    async def _state_sync(self) -> None:
        """Fetch the current model from a live peer before training (a late joiner)."""
        with trio.move_on_after(STATE_SYNC_WAIT_S):
            while not self._stop.is_set():
                peers = list(self.membership.live_peers())
                self.rng.shuffle(peers)
                for peer in peers:
                    address = self.membership.address_of(peer)
                    if address is None:
                        continue
                    step = await self.exchange.sync_state(peer, address, deadline_s=30.0)
                    if step is not None:
                        log.info("state_synced", peer=peer[:12], peer_step=step)
                        if self.algo is not None:
                            await trio.to_thread.run_sync(self.algo.model_replaced)
                        return
                await trio.sleep(0.2)
        log.warning("state_sync_skipped", reason="no peer answered; training from scratch")

    # -- requests from peers --------------------------------------------------------------------
    async def _handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        if self.algo is not None and isinstance(header, self.algo.headers):
            return await self.algo.handle(peer, header, payload)
        if isinstance(header, Exchange):
            return await self.exchange.handle_exchange(peer, header, payload)
        if isinstance(header, Gossip):
            try:
                message = unwrap_gossip(header)
                sends = self.membership.receive(message, peer.peer_id, self._now)
            except GossipRemoteError as exc:
                return self._bad_request(peer, "gossip", str(exc))
            for send in sends:
                self._nursery.start_soon(self._deliver, send)
            self._wake_membership.set()
            return Delivered(), b""
        if isinstance(header, Ping):
            return Pong(nonce=header.nonce), b""
        if isinstance(header, Probe):
            if len(payload) > MAX_PROBE_BYTES:
                return self._bad_request(peer, "probe", f"{len(payload)} bytes > {MAX_PROBE_BYTES}")
            return ProbeReply(received=len(payload)), b""
        if isinstance(header, StateRequest):
            return await self.exchange.handle_state_request(header)
        if isinstance(header, StatusRequest):  # any admitted peer may ask (`geotrain status`)
            return StatusReply(), json.dumps(self.status(self._running).to_json()).encode()
        return self._bad_request(peer, "unexpected", type(header).__name__)

    def _bad_request(self, peer: PeerInfo, kind: str, reason: str) -> tuple[Header, bytes]:
        self.rejected_messages[kind] += 1
        log.warning("message_rejected", peer=peer.short_id, kind=kind, reason=reason)
        return ErrorReply(code="bad_request", reason=reason[:500]), b""

    # -- status ---------------------------------------------------------------------------------
    def _write_node_info(self) -> None:
        info = {"peer_id": self.identity.peer_id, "address": self.address, "pid": os.getpid()}
        write_atomically(self.state.node_info, json.dumps(info).encode())

    def status(self, running: bool = True) -> NodeStatus:
        stats = self.transport.statistics()
        now = self._now
        peers = []
        for m in self.membership.members():
            est = self.links.estimate(m.peer_id, now)
            ex = self.exchange.peers.get(m.peer_id)
            peers.append(
                PeerStatus(
                    peer=m.peer_id[:12],
                    address=m.address,
                    state=str(m.state),
                    rtt_ms=est.rtt_s * 1000 if est.rtt_known else None,
                    goodput_mbit=est.goodput_bytes_per_s * 8e-6 if est.goodput_known else None,
                    codec=ex.codec if ex else None,
                    exchanges_ok=ex.ok if ex else 0,
                    exchanges_failed=ex.failed if ex else 0,
                )
            )
        times = self._step_times
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return NodeStatus(
            peer_id=self.identity.peer_id,
            address=self.address,
            algorithm=self.config.gossip.algorithm,
            task=self.config.training.task,
            metric_name=self.task.metric,
            elapsed_s=time.monotonic() - self._started,
            step=self.trainer.step,
            steps_per_s=rate,
            loss=self.trainer.last_loss,
            metric=self._progress.metric,
            metric_step=self._progress.metric_step,
            bytes_in=stats.bytes_in,
            bytes_out=stats.bytes_out,
            exchanges_ok=self.exchange.ok,
            exchanges_failed=self.exchange.failed,
            rejected_updates=self.exchange.rejected,
            algorithm_stats=self.algo.statistics() if self.algo is not None else {},
            pid=os.getpid(),
            running=running,
            peers=tuple(peers),
        )

    async def _write_status(self) -> None:
        """Snapshot here, on the loop; write (with fsync) in a worker thread."""
        status = self.status(self._running)
        record = status.to_json()
        record.pop("peers")
        record["t"] = time.time()
        record["live_peers"] = len(self.membership.live_peers())

        def write() -> None:
            write_status(self.state.status, status)
            append_metrics(self.state.metrics, record)

        async with self._status_lock:
            await trio.to_thread.run_sync(write)

    async def _status_loop(self) -> None:
        while True:
            await trio.sleep(self.config.state.status_every_s)
            await self._write_status()
