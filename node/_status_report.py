# A node's status: one snapshot built from the parts that measure things (trainer, transport,
# membership, links, the algorithm's counters), written to status.json and metrics.jsonl every
# state.status_every_s and served to `geotrain status` over the network. Invariants: snapshots
# are taken on the event loop and written (with fsync) in a worker thread, one write at a time;
# this module measures nothing itself.
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
import trio

from geotrain.gossip import LinkTable

from ._limits import open_files
from ._membership_service import MembershipService
from ._memory import peak_rss_mb
from ._protocol import StatusReply, StatusRequest
from .algorithms import Algorithm
from .state import (
    METRICS_MAX_BYTES,
    NodeStatus,
    PeerStatus,
    StateDir,
    append_metrics,
    write_status,
)
from .training import Trainer
from .transport import Header, PeerInfo, Transport

log = structlog.get_logger()


@dataclass
class Progress:
    """The held-out metric as last evaluated, and at which step; the seconds spent in the node's
    own training steps since its first (compute emulation's padding counted as compute), for
    compute utilization. A loop of the user's own reports no step seconds (train_s stays None):
    its forward and backward passes happen outside what the node sees."""

    metric: float | None = None
    metric_step: int | None = None
    train_s: float | None = None
    samples: int | None = None  # training samples taken since start (None: not known)
    training_since: float | None = None  # trio clock at the first step's start
    eval_s: float = 0.0  # seconds in held-out evaluations since the first step

    def utilization(self, now: float, *, without_eval: bool = False) -> float | None:
        """The fraction of wall time since the first step spent in training steps (of the time
        not spent evaluating, `without_eval`: evaluations are the operator's measurement, at a
        cadence of their choosing; the testbed's every 10 s cost a charlm peer 5-6%)."""
        if self.train_s is None or self.training_since is None:
            return None
        wall = now - self.training_since - (self.eval_s if without_eval else 0.0)
        return min(1.0, self.train_s / wall) if wall > 0 else None


@dataclass
class StatusSources:
    """Everything a status snapshot reads (all owned by the node)."""

    peer_id: str
    address: str
    algorithm_name: str
    task_name: str
    metric_name: str
    trainer: Trainer
    transport: Transport
    membership: MembershipService
    links: LinkTable
    algorithm: Algorithm
    progress: Progress
    memory_estimate_mb: float | None = None
    reachable: bool = True  # network.reachable (False: client mode)
    # requests refused as malformed, by kind (the node's router and membership)
    rejected_messages: Callable[[], Mapping[str, int]] = dict
    # what state sync moved, in and out (StateSync.bytes_in, bytes_out)
    sync_bytes: Callable[[], tuple[int, int]] = lambda: (0, 0)


class StatusReporter:
    """Builds, writes and serves status snapshots.

    Args:
        sources: what a snapshot reads; state: where it is written; every_s: how often;
        running: whether the node still trains (False once it is shutting down).
    """

    handles = (StatusRequest,)

    def __init__(
        self, sources: StatusSources, state: StateDir, every_s: float, running: Callable[[], bool],
        metrics_max_bytes: int = METRICS_MAX_BYTES,
    ) -> None:
        self.sources = sources
        self._state = state
        self._every_s = every_s
        self._metrics_max_bytes = metrics_max_bytes  # (0: no metrics.jsonl)
        self._running = running
        self._started = time.monotonic()
        self._lock = trio.Lock()
        self.write_failures = 0  # status writes that failed (OSError: a full disk)

    def snapshot(self) -> NodeStatus:
        s = self.sources
        now = trio.current_time()
        exchanges = s.algorithm.counters.statistics()
        peers = []
        for m in s.membership.members():
            est = s.links.estimate(m.peer_id, now)
            ex = exchanges.peers.get(m.peer_id)
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
        stats = s.transport.statistics()
        interval = s.trainer.step_interval_s()
        files = open_files()
        synced = s.sync_bytes()
        return NodeStatus(
            peer_id=s.peer_id,
            address=s.address,
            algorithm=s.algorithm_name,
            task=s.task_name,
            metric_name=s.metric_name,
            held_out=getattr(s.trainer, "evaluates", True),
            elapsed_s=time.monotonic() - self._started,
            step=s.trainer.step,
            steps_per_s=1.0 / interval if interval else 0.0,
            loss=s.trainer.last_loss,
            nonfinite_losses=s.trainer.nonfinite_losses,
            metric=s.progress.metric,
            metric_step=s.progress.metric_step,
            bytes_in=stats.bytes_in,
            bytes_out=stats.bytes_out,
            sync_bytes_in=synced[0],
            sync_bytes_out=synced[1],
            exchanges_ok=exchanges.ok,
            exchanges_failed=exchanges.failed,
            exchange_last_s=exchanges.last_s,
            exchange_mean_s=exchanges.mean_s,
            rejected_updates=exchanges.rejected,
            rejected_by_reason=dict(exchanges.rejected_by_reason),
            frames_rejected=dict(stats.frames_rejected),
            handshakes_failed=dict(stats.handshakes_failed),
            messages_rejected=dict(s.rejected_messages()),
            steps_over_step_time=s.trainer.overran_steps,
            train_s=s.progress.train_s,
            samples=s.progress.samples,
            utilization=s.progress.utilization(now),
            eval_s=s.progress.eval_s if s.progress.train_s is not None else None,
            utilization_without_eval=s.progress.utilization(now, without_eval=True),
            algorithm_stats=s.algorithm.status_counters(),
            algorithm_gauges=tuple(sorted(s.algorithm.status_gauges())),
            **_privacy(s.trainer),
            pid=os.getpid(),
            running=self._running(),
            peers=tuple(peers),
            peak_rss_mb=peak_rss_mb(),
            open_files=files[0],
            open_files_limit=files[1],
            memory_estimate_mb=s.memory_estimate_mb,
            certificate_expires_at=s.transport.certificate_expires_at,
            not_dialled=s.membership.not_dialled_back(),
            bootstrap_unanswered=s.membership.unanswered_bootstrap(),
            status_every_s=self._every_s,
            reachable=s.reachable,
        )

    async def write(self) -> None:
        """Snapshot here, on the loop; write status.json and a metrics line in a worker thread."""
        status = self.snapshot()
        record = status.to_json()
        record.pop("peers")
        record["t"] = time.time()
        record["live_peers"] = self.sources.membership.live_count()  # client-mode peers too

        def write() -> None:
            write_status(self._state.status, status)
            if self._metrics_max_bytes:
                append_metrics(self._state.metrics, record, self._metrics_max_bytes)

        async with self._lock:
            try:
                await trio.to_thread.run_sync(write)
            except OSError as exc:  # a full disk: the node goes on (training is not stopped)
                self.write_failures += 1
                if self.write_failures % 600 == 1:  # the first, then about every 10 minutes
                    log.error("status_not_written", error=str(exc), failures=self.write_failures,
                              path=str(self._state.status),
                              hint="training goes on; status.json and metrics.jsonl are stale "
                              "until the disk has room again")  # fmt: skip

    async def run(self) -> None:
        """Write a snapshot every `every_s` seconds until cancelled."""
        while True:
            await trio.sleep(self._every_s)
            await self.write()

    async def handle(
        self, peer: PeerInfo, header: Header, payload: memoryview
    ) -> tuple[Header, bytes]:
        """Any admitted peer may ask (`geotrain status --node tcp://...`)."""
        return StatusReply(), json.dumps(self.snapshot().to_json()).encode()


def _privacy(trainer: object) -> dict:
    """The privacy fields of a status: the spent epsilon, the budget, whether it is spent."""
    private = getattr(trainer, "private", None)  # a Trainer with [privacy]; never a LoopTrainer
    if private is None:
        return {}
    stats = private.statistics()
    return {"privacy_epsilon": stats.epsilon_spent, "privacy_budget": stats.epsilon_budget,
            "privacy_exhausted": stats.exhausted}  # fmt: skip
