# Prometheus metrics of a node, served over HTTP when [metrics] listen is set. Invariants: the
# numbers are the status snapshot's (taken on the node's trio loop at scrape time, so a scrape
# never reads the node's state from another thread), named by Prometheus conventions (one
# geotrain_ prefix, base units, _total counters, 0-1 ratios); per-peer series are bounded: at
# most MAX_PEER_SERIES peers are named, the rest are summed under peer="other".
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from ._config import ConfigError
from .state import NodeStatus

MAX_PEER_SERIES = 16


class NodeCollector:
    """Turns a status snapshot into metric families (a prometheus_client custom collector).

    Args:
        snapshot: returns the node's status now (called in the HTTP server's thread; it must do
            the hop to the node's loop itself).
        checkpoint_age_s: seconds since the last checkpoint, or None before the first.
    """

    def __init__(
        self,
        snapshot: Callable[[], NodeStatus],
        checkpoint_age_s: Callable[[], float | None] = lambda: None,
        refusals: Callable[[], Mapping[str, Mapping[str, int]]] = dict,
    ) -> None:
        self._snapshot = snapshot
        self._checkpoint_age_s = checkpoint_age_s
        self._refusals = refusals

    def collect(self) -> Iterator:
        s = self._snapshot()
        info = GaugeMetricFamily("geotrain_node_info", "This node (value 1)",
                                 labels=["peer_id", "algorithm", "task", "metric"])  # fmt: skip
        info.add_metric([s.peer_id, s.algorithm, s.task, s.metric_name], 1.0)
        yield info
        yield CounterMetricFamily("geotrain_steps", "Local training steps", value=s.step)
        yield _gauge("geotrain_steps_per_second", "Recent local step rate", s.steps_per_s)
        if s.steps_per_s:
            yield _gauge("geotrain_step_seconds", "Recent seconds per step", 1 / s.steps_per_s)
        if s.loss is not None:
            yield _gauge("geotrain_loss", "Training loss of the last step", s.loss)
        if s.metric is not None:
            yield _gauge("geotrain_metric", f"Held-out {s.metric_name} at its last evaluation",
                         s.metric)  # fmt: skip
        traffic = CounterMetricFamily("geotrain_transport_bytes", "Bytes moved by the transport",
                                      labels=["direction"])  # fmt: skip
        traffic.add_metric(["in"], s.bytes_in)
        traffic.add_metric(["out"], s.bytes_out)
        yield traffic
        exchanges = CounterMetricFamily("geotrain_exchanges", "Exchanges by outcome",
                                        labels=["outcome"])  # fmt: skip
        for outcome, value in (("ok", s.exchanges_ok), ("failed", s.exchanges_failed),
                               ("rejected", s.rejected_updates)):  # fmt: skip
            exchanges.add_metric([outcome], value)
        yield exchanges
        yield from _peers(s)
        yield from _refusals(self._refusals())
        yield _gauge("geotrain_elapsed_seconds", "Seconds since the node started", s.elapsed_s)
        if s.peak_rss_mb is not None:
            yield _gauge("geotrain_memory_peak_bytes", "Peak resident memory of the process",
                         s.peak_rss_mb * 1e6)  # fmt: skip
        if s.memory_estimate_mb is not None:
            yield _gauge("geotrain_memory_estimate_bytes", "Memory the node estimated at start",
                         s.memory_estimate_mb * 1e6)  # fmt: skip
        if s.certificate_expires_at is not None:
            yield _gauge("geotrain_certificate_expiry_timestamp_seconds",
                         "When this node's membership certificate expires (POSIX seconds)",
                         s.certificate_expires_at)  # fmt: skip
        age = self._checkpoint_age_s()
        if age is not None:
            yield _gauge("geotrain_checkpoint_age_seconds", "Seconds since the last checkpoint",
                         age)  # fmt: skip
        for name, value in s.algorithm_stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metric = re.sub(r"[^a-zA-Z0-9_]", "_", f"geotrain_{s.algorithm}_{name}")
                yield _gauge(metric, f"{s.algorithm}: {name}", value)


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


def _peers(s: NodeStatus) -> Iterator:
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
    named = sorted(s.peers, key=lambda p: -(p.exchanges_ok + p.exchanges_failed))
    other = [0, 0]
    for i, p in enumerate(named):
        if i >= MAX_PEER_SERIES:
            other[0] += p.exchanges_ok
            other[1] += p.exchanges_failed
            continue
        if p.rtt_ms is not None:
            rtt.add_metric([p.peer], p.rtt_ms / 1000)
        if p.goodput_mbit is not None:
            goodput.add_metric([p.peer], p.goodput_mbit * 1e6 / 8)
        exchanged.add_metric([p.peer, "ok"], p.exchanges_ok)
        exchanged.add_metric([p.peer, "failed"], p.exchanges_failed)
    if len(named) > MAX_PEER_SERIES:
        exchanged.add_metric(["other", "ok"], other[0])
        exchanged.add_metric(["other", "failed"], other[1])
    yield rtt
    yield goodput
    yield exchanged


class MetricsServer:
    """The HTTP endpoint (prometheus_client's server, in its own thread) for one collector."""

    def __init__(self, listen: str, collector: NodeCollector) -> None:
        host, _, port = listen.rpartition(":")
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        try:
            self._server, self._thread = start_http_server(int(port), host, self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics.listen = {listen!r}: cannot listen there ({exc.strerror})"
                              ) from exc  # fmt: skip
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
