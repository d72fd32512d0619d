# Prometheus metrics of a node, served over HTTP when [metrics] listen is set. Invariants: the
# numbers are the status snapshot's (taken on the node's trio loop at scrape time, so a scrape
# never reads the node's state from another thread), named by Prometheus conventions (one
# geotrain_ prefix, base units, _total counters, 0-1 ratios); per-peer series are bounded: at
# most MAX_PEER_SERIES peers are named (PeerLabels: a named peer keeps its label while the node
# knows it, so its series do not come and go between scrapes), and exchanges with the others are
# counted under peer="other", which never decreases (a counter).
from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import structlog
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from ._config import ConfigError
from .state import NodeStatus, PeerStatus

MAX_PEER_SERIES = 16
# Scrapes served at once (one thread each), and how long a connection may stay silent: more
# connections than this are closed at once, so a client that opens hundreds and sends nothing
# costs the node neither threads nor memory, only the scrapes that come meanwhile
MAX_SCRAPES = 8
SCRAPE_TIMEOUT_S = 10.0

log = structlog.get_logger()


class NodeCollector:
    """Turns a status snapshot into metric families (a prometheus_client custom collector).

    Args:
        snapshot: returns the node's status now (called in the HTTP server's thread; it must do
            the hop to the node's loop itself).
        checkpoint_age_s: seconds since the last checkpoint, or None before the first.
        checkpoint_failures: checkpoint writes that failed (a full disk).
    """

    def __init__(
        self,
        snapshot: Callable[[], NodeStatus],
        checkpoint_age_s: Callable[[], float | None] = lambda: None,
        checkpoint_failures: Callable[[], int] = lambda: 0,
    ) -> None:
        self._snapshot = snapshot
        self._checkpoint_failures = checkpoint_failures
        self._checkpoint_age_s = checkpoint_age_s
        self._labels = PeerLabels()

    def collect(self) -> Iterator:
        s = self._snapshot()
        info = GaugeMetricFamily("geotrain_node_info", "This node (value 1)",
                                 labels=["peer_id", "algorithm", "task", "metric"])  # fmt: skip
        info.add_metric([s.peer_id, s.algorithm, s.task, s.metric_name], 1.0)
        yield info
        yield CounterMetricFamily("geotrain_steps", "Local training steps", value=s.step)
        if s.samples is not None:
            yield CounterMetricFamily("geotrain_samples", "Training samples taken by this process",
                                      value=s.samples)  # fmt: skip
        yield _gauge("geotrain_steps_per_second", "Recent local step rate", s.steps_per_s)
        if s.steps_per_s:
            yield _gauge("geotrain_step_seconds", "Recent seconds per step", 1 / s.steps_per_s)
        if s.loss is not None:
            yield _gauge("geotrain_loss", "Training loss of the last step", s.loss)
        if s.metric is not None:
            yield _gauge("geotrain_metric", f"Held-out {s.metric_name} at its last evaluation",
                         s.metric)  # fmt: skip
        if s.train_s is not None:
            yield CounterMetricFamily("geotrain_train_seconds",
                                      "Seconds spent in the node's own training steps",
                                      value=s.train_s)  # fmt: skip
        if s.utilization is not None:
            yield _gauge("geotrain_compute_utilization",
                         "Share of wall time since the first step spent in training steps",
                         s.utilization)  # fmt: skip
        traffic = CounterMetricFamily("geotrain_transport_bytes", "Bytes moved by the transport",
                                      labels=["direction"])  # fmt: skip
        traffic.add_metric(["in"], s.bytes_in)
        traffic.add_metric(["out"], s.bytes_out)
        yield traffic
        synced = CounterMetricFamily("geotrain_state_sync_bytes",
                                     "Bytes of model, optimizer and buffer values that state sync "
                                     "moved (a part of the transport's)",
                                     labels=["direction"])  # fmt: skip
        synced.add_metric(["in"], s.sync_bytes_in)
        synced.add_metric(["out"], s.sync_bytes_out)
        yield synced
        exchanges = CounterMetricFamily("geotrain_exchanges", "Exchanges by outcome",
                                        labels=["outcome"])  # fmt: skip
        for outcome, value in (("ok", s.exchanges_ok), ("failed", s.exchanges_failed),
                               ("rejected", s.rejected_updates)):  # fmt: skip
            exchanges.add_metric([outcome], value)
        yield exchanges
        rejected = CounterMetricFamily("geotrain_updates_rejected",
                                       "Peers' updates refused by a check, by reason",
                                       labels=["reason"])  # fmt: skip
        for reason, n in sorted(s.rejected_by_reason.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield from _peers(s, self._labels)
        yield from _refusals({"handshakes": s.handshakes_failed, "frames": s.frames_rejected,
                              "messages": s.messages_rejected})  # fmt: skip
        yield _gauge("geotrain_elapsed_seconds", "Seconds since the node started", s.elapsed_s)
        if s.peak_rss_mb is not None:
            yield _gauge("geotrain_memory_peak_bytes", "Peak resident memory of the process",
                         s.peak_rss_mb * 1e6)  # fmt: skip
        if s.memory_estimate_mb is not None:
            yield _gauge("geotrain_memory_estimate_bytes",
                         "Memory the node estimated it needs (at start; a loop's own at wrap())",
                         s.memory_estimate_mb * 1e6)  # fmt: skip
        if s.open_files is not None:
            yield _gauge("geotrain_open_files", "File descriptors the process has open (idle "
                         "connections to the node's port hold one each)", s.open_files)
        if s.open_files_limit is not None:
            yield _gauge("geotrain_open_files_limit", "The process's soft limit on open files",
                         s.open_files_limit)  # fmt: skip
        if s.privacy_epsilon is not None:
            yield _gauge("geotrain_privacy_epsilon_spent",
                         "Differential privacy: epsilon spent on this node's data",
                         s.privacy_epsilon)  # fmt: skip
            yield _gauge("geotrain_privacy_epsilon_budget", "Differential privacy: the budget",
                         s.privacy_budget or 0.0)  # fmt: skip
        yield _gauge("geotrain_not_dialled_back", "1: peers accept this node's connections but "
                     "none could dial it back (behind NAT? set network.reachable = false)",
                     float(s.not_dialled))  # fmt: skip
        if s.certificate_expires_at is not None:
            yield _gauge("geotrain_certificate_expiry_timestamp_seconds",
                         "When this node's membership certificate expires (POSIX seconds)",
                         s.certificate_expires_at)  # fmt: skip
        age = self._checkpoint_age_s()
        if age is not None:
            yield _gauge("geotrain_checkpoint_age_seconds", "Seconds since the last checkpoint",
                         age)  # fmt: skip
        yield CounterMetricFamily("geotrain_checkpoint_failures", "Checkpoint writes that failed "
                                  "(a full disk): the older checkpoints stay",
                                  value=self._checkpoint_failures())  # fmt: skip
        for name, value in s.algorithm_stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metric = re.sub(r"[^a-zA-Z0-9_]", "_", f"geotrain_{s.algorithm}_{name}")
                if name in s.algorithm_gauges:
                    yield _gauge(metric, f"{s.algorithm}: {name}", value)
                else:  # a count that only grows: exposed as <metric>_total
                    yield CounterMetricFamily(metric, f"{s.algorithm}: {name}", value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


REFUSALS = {  # what the node refused from the network: family, help, label
    "handshakes": ("geotrain_handshakes_failed", "Connections refused at the handshake", "reason"),
    "frames": ("geotrain_frames_rejected", "Frames refused by the transport", "reason"),
    "messages": ("geotrain_messages_rejected", "Requests refused as malformed", "kind"),
}


def _refusals(counts: Mapping[str, Mapping[str, int]]) -> Iterator:
    for key, (name, documentation, label) in REFUSALS.items():
        family = CounterMetricFamily(name, documentation, labels=[label])
        for value, n in sorted(counts.get(key, {}).items()):
            family.add_metric([value], n)
        yield family


class PeerLabels:
    """Which peers get series of their own, and the exchanges of the others (peer="other").

    A peer keeps its label while the node knows it; a free label goes to the busiest peer
    without one. "other" adds up what the unnamed peers exchanged while they were unnamed, from
    their counters' increases, so it only grows, whoever comes, goes or gets a label. Scrapes
    may come from several HTTP threads: one lock.
    """

    def __init__(self, limit: int = MAX_PEER_SERIES) -> None:
        self.limit = limit
        self._named: list[str] = []
        self._seen: dict[str, tuple[int, int]] = {}  # unnamed peer -> (ok, failed) last scrape
        self._other = [0, 0]
        self._lock = threading.Lock()

    def update(self, peers: tuple[PeerStatus, ...]) -> tuple[list[PeerStatus], tuple[int, int]]:
        """The named peers (in label order) and the "other" totals (ok, failed), now."""
        with self._lock:
            present = {p.peer: p for p in peers}
            self._named = [n for n in self._named if n in present]
            free = self.limit - len(self._named)
            if free > 0:
                waiting = [p for p in peers if p.peer not in self._named]
                waiting.sort(key=lambda p: -(p.exchanges_ok + p.exchanges_failed))
                self._named += [p.peer for p in waiting[:free]]
            named = set(self._named)
            seen = {}
            for p in peers:
                if p.peer in named:
                    continue
                ok, failed = self._seen.get(p.peer, (0, 0))
                # a counter below its last value started again (the peer was forgotten)
                self._other[0] += p.exchanges_ok - ok if p.exchanges_ok >= ok else p.exchanges_ok
                self._other[1] += (p.exchanges_failed - failed if p.exchanges_failed >= failed
                                   else p.exchanges_failed)  # fmt: skip
                seen[p.peer] = (p.exchanges_ok, p.exchanges_failed)
            self._seen = seen
            return [present[n] for n in self._named], (self._other[0], self._other[1])

    @property
    def has_other(self) -> bool:
        return bool(self._seen) or any(self._other)


def _peers(s: NodeStatus, labels: PeerLabels) -> Iterator:
    members = GaugeMetricFamily("geotrain_members", "Known members by state", labels=["state"])
    counts: dict[str, int] = {}
    for p in s.peers:
        counts[p.state] = counts.get(p.state, 0) + 1
    for state, n in sorted(counts.items()):
        members.add_metric([state], n)
    yield members
    rtt = GaugeMetricFamily("geotrain_peer_rtt_seconds", "Smoothed RTT to a peer", labels=["peer"])
    goodput = GaugeMetricFamily("geotrain_peer_goodput_bytes_per_second",
                                "Measured goodput to a peer", labels=["peer"])  # fmt: skip
    exchanged = CounterMetricFamily("geotrain_peer_exchanges", "Exchanges with a peer",
                                    labels=["peer", "outcome"])  # fmt: skip
    codec = GaugeMetricFamily("geotrain_peer_codec_info",
                              "The codec of the latest exchange with a peer (value 1)",
                              labels=["peer", "codec"])  # fmt: skip
    named, other = labels.update(s.peers)
    for p in named:
        if p.rtt_ms is not None:
            rtt.add_metric([p.peer], p.rtt_ms / 1000)
        if p.goodput_mbit is not None:
            goodput.add_metric([p.peer], p.goodput_mbit * 1e6 / 8)
        if p.codec is not None:
            codec.add_metric([p.peer, p.codec], 1)
        exchanged.add_metric([p.peer, "ok"], p.exchanges_ok)
        exchanged.add_metric([p.peer, "failed"], p.exchanges_failed)
    if labels.has_other:
        exchanged.add_metric(["other", "ok"], other[0])
        exchanged.add_metric(["other", "failed"], other[1])
    yield rtt
    yield goodput
    yield exchanged
    yield codec


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # (a silent connection's read fails after this and it closes)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base's signature)
        """No line per request on stderr (the node logs through structlog)."""


class _BoundedServer(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server with at most MAX_SCRAPES connections served at
    once; the others are closed unanswered and counted (`refused`)."""

    request_queue_size = 64  # (connections waiting to be served or refused)

    def __init__(self, *args, **kwargs) -> None:
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self.refused = 0
        self._deadlines: dict[socket.socket, float] = {}  # served connections: cut at
        self._watch_lock = threading.Lock()
        self._stopping = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._watch, name="geotrain-metrics-deadlines",
                         daemon=True).start()  # fmt: skip

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if (self.refused & (self.refused - 1)) == 0:  # 1, 2, 4, 8...: said, not flooded
                log.warning("metrics_connections_refused", refused=self.refused,
                            limit=MAX_SCRAPES)  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        # a whole connection gets SCRAPE_TIMEOUT_S, not each read: a byte every few seconds
        # held a slot for ever, and MAX_SCRAPES such connections held the endpoint
        with self._watch_lock:
            self._deadlines[request] = time.monotonic() + SCRAPE_TIMEOUT_S
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._watch_lock:
                self._deadlines.pop(request, None)
            self._slots.release()

    def _watch(self) -> None:
        """One thread for all connections: cut those past their deadline."""
        while not self._stopping.wait(0.25):
            now = time.monotonic()
            with self._watch_lock:
                late = [r for r, at in self._deadlines.items() if at <= now]
            for request in late:
                _cut(request)

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()

    def handle_error(self, request, client_address) -> None:
        """A client that went away or stayed silent: nothing to print."""


def _cut(request: socket.socket) -> None:
    """End a connection past its time (its thread's next read or write fails)."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _RefusedConnections:
    """geotrain_metrics_connections_refused_total: the endpoint's own refusals."""

    def __init__(self, server: _BoundedServer) -> None:
        self._server = server

    def collect(self) -> Iterator:
        yield CounterMetricFamily(
            "geotrain_metrics_connections_refused",
            f"connections to this endpoint closed unanswered ({MAX_SCRAPES} were being served)",
            value=self._server.refused)


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 host, else IPv4."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return socket.AF_INET
    return infos[0][0] if infos else socket.AF_INET


class MetricsServer:
    """The HTTP endpoint (prometheus_client's WSGI app, served in its own thread, at most
    MAX_SCRAPES connections at once) for one collector."""

    def __init__(self, listen: str, collector: NodeCollector) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")  # ([::1]:9400)
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        server_class = type("_Server", (_BoundedServer,),
                            {"address_family": _family(host, int(port))})  # fmt: skip
        try:
            self._server = make_server(host, int(port), make_wsgi_app(self.registry),
                                       server_class, handler_class=_QuietHandler)  # fmt: skip
        except OSError as exc:
            raise ConfigError(f"metrics.listen = {listen!r}: cannot listen there ({exc.strerror})"
                              ) from exc  # fmt: skip
        self.registry.register(_RefusedConnections(self._server))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="geotrain-metrics")  # fmt: skip
        self._thread.start()
        self.port = self._server.server_port

    @property
    def refused(self) -> int:
        """Connections closed unanswered because MAX_SCRAPES were being served."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_node_metrics(
    listen: str,
    snapshot: Callable[[], NodeStatus],
    checkpointer: Callable[[], Any],
) -> MetricsServer:
    """Serve a node's metrics at `listen` (logged: metrics_listening).

    Args:
        snapshot: the node's status (called in the HTTP server's thread; it hops to the loop).
        checkpointer: the node's Checkpointer once it runs, else None (its age and failures).

    Raises:
        ConfigError: the port is taken or the address is not this machine's.
    """

    def age() -> float | None:
        at = getattr(checkpointer(), "written_at", None)
        return None if at is None else time.monotonic() - at

    def failures() -> int:
        return getattr(checkpointer(), "failures", 0)

    server = MetricsServer(listen, NodeCollector(snapshot, age, failures))
    log.info("metrics_listening", address=f"{listen.rpartition(':')[0]}:{server.port}")
    return server
