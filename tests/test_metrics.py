"""Prometheus metrics: a running node scraped over HTTP, parsed with prometheus_client's parser."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

import geotrain
from geotrain.node import Admission, Identity, config_from_toml

CONFIG = """
[identity]
open_swarm = true
[training]
task = "synthetic-linreg"
threads = 1
eval_every = 10
[gossip]
probe_interval_s = 0.2
exchange_every = 2
[state]
status_every_s = 0.2
checkpoint_every = 20
[metrics]
listen = "127.0.0.1:0"
"""


def config(tmp_path: Path, name: str, *overrides: str):
    return config_from_toml(
        CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path / name}"', *overrides]
    )


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_a_running_node_serves_its_numbers(tmp_path):
    admission = Admission.open_swarm("geotrain")
    async with geotrain.open_node(config(tmp_path, "a"), identity=Identity.generate(),
                                  admission=admission) as a:  # fmt: skip
        async with geotrain.open_node(
            config(tmp_path, "b", f'network.bootstrap=["{a.address}"]'),
            identity=Identity.generate(), admission=admission,
        ):  # fmt: skip
            with trio.fail_after(60):
                while a.status().exchanges_ok < 3 or a.status().step < 40:
                    await trio.sleep(0.1)
            samples = await trio.to_thread.run_sync(scrape, a.metrics.port)
    names = {name for name, _ in samples}
    assert samples[("geotrain_steps_total", ())] >= 40
    # every step took one batch (synthetic-linreg: 32 samples, and what is left at the end of
    # each pass over its training samples), counted from the batches
    import math

    from geotrain.node.training import TaskContext, resolve_task

    steps, taken = samples[("geotrain_steps_total", ())], samples[("geotrain_samples_total", ())]
    epoch = resolve_task("synthetic-linreg")(TaskContext()).train_size
    passes, rest = divmod(int(taken), epoch)
    batches = passes * math.ceil(epoch / 32) + rest / 32
    assert rest % 32 == 0 and steps - 2 <= batches <= steps + 2, (steps, taken)
    assert samples[("geotrain_exchanges_total", (("outcome", "ok"),))] >= 3
    assert samples[("geotrain_transport_bytes_total", (("direction", "out"),))] > 0
    assert samples[("geotrain_members", (("state", "alive"),))] == 1
    info = [labels for name, labels in samples if name == "geotrain_node_info"]
    assert dict(info[0])["algorithm"] == "adpsgd" and dict(info[0])["metric"] == "mse"
    assert {"geotrain_loss", "geotrain_metric", "geotrain_checkpoint_age_seconds",
            "geotrain_memory_peak_bytes", "geotrain_peer_exchanges_total"} <= names  # fmt: skip
    peer_rows = [labels for name, labels in samples if name == "geotrain_peer_exchanges_total"]
    assert peer_rows and all(dict(labels)["outcome"] in ("ok", "failed") for labels in peer_rows)
    codecs = [dict(labels) for name, labels in samples if name == "geotrain_peer_codec_info"]
    assert codecs and all(c["codec"] == "none" for c in codecs), codecs  # loopback: uncompressed


async def test_compute_utilization_is_the_share_of_wall_time_in_training_steps(tmp_path):
    # compute emulation pins each step to 40 ms: a node alone spends nearly all its time in steps
    # (no checkpoints: a write on a disk that earlier tests keep busy is time outside steps)
    cfg = config(tmp_path, "u", "training.step_time_ms=40", "training.wait_for_peers=0",
                 "training.eval_every=10", "state.checkpoint_every=100000")  # fmt: skip
    async with geotrain.open_node(cfg, identity=Identity.generate(),
                                  admission=Admission.open_swarm("geotrain")) as node:  # fmt: skip
        with trio.fail_after(60):
            while node.status().step < 30:
                await trio.sleep(0.05)
        await trio.sleep(0.3)
        status = node.status()
        samples = await trio.to_thread.run_sync(scrape, node.metrics.port)
    # at least the pinned time of every step it finished (the step count moves before a step's
    # padding ends), at most that plus the real compute
    assert 0.04 * (status.step - 1) <= status.train_s <= 0.04 * status.step + 1.5, status
    assert 0.5 < status.utilization <= 1.0, status  # what the loop adds around steps is small
    # evaluations (every 10 steps here) are counted, and left out of the second figure
    assert status.eval_s > 0 and status.utilization < status.utilization_without_eval <= 1.0
    assert samples[("geotrain_train_seconds_total", ())] > 0
    assert 0.5 < samples[("geotrain_compute_utilization", ())] <= 1.0


async def test_refusals_are_counted_by_reason(tmp_path):
    # a's bootstrap peer belongs to another swarm: every handshake a tries is refused
    async with geotrain.open_node(config(tmp_path, "x"), identity=Identity.generate(),
                                  admission=Admission.open_swarm("elsewhere")) as x:  # fmt: skip
        async with geotrain.open_node(
            config(tmp_path, "a", f'network.bootstrap=["{x.address}"]'),
            identity=Identity.generate(), admission=Admission.open_swarm("geotrain"),
        ) as a:  # fmt: skip
            with trio.fail_after(60):
                while True:
                    samples = await trio.to_thread.run_sync(scrape, a.metrics.port)
                    failed = {dict(labels)["reason"]: v for (name, labels), v in samples.items()
                              if name == "geotrain_handshakes_failed_total"}  # fmt: skip
                    if failed:
                        break
                    await trio.sleep(0.2)
    assert sum(failed.values()) >= 1, failed
    assert samples.get(("geotrain_members", (("state", "alive"),)), 0) == 0  # never admitted


async def test_a_metrics_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = config(tmp_path, "c", f'metrics.listen="127.0.0.1:{port}"')
        with pytest.raises(geotrain.ConfigError, match=f"metrics.listen = '127.0.0.1:{port}': "
                           "cannot listen there"):  # fmt: skip
            async with geotrain.open_node(cfg, identity=Identity.generate(),
                                          admission=Admission.open_swarm("geotrain")):  # fmt: skip
                pass
    assert not (tmp_path / "c").exists()  # refused before anything started


def test_a_bad_metrics_address_names_the_field(tmp_path):
    with pytest.raises(geotrain.ConfigError, match="metrics.listen = 'nowhere'"):
        config(tmp_path, "d", 'metrics.listen="nowhere"')


def test_a_library_node_serves_the_same_metrics(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    swarm = geotrain.join(config(tmp_path, "lib"), model, identity=Identity.generate(),
                          admission=Admission.open_swarm("geotrain"))  # fmt: skip
    with swarm:
        opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(25):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
        assert swarm.metrics_port is not None
        samples = scrape(swarm.metrics_port)
    assert samples[("geotrain_steps_total", ())] == 25
    assert samples[("geotrain_loss", ())] >= 0
    # the user's forward and backward passes happen outside the node: no utilization claimed
    assert ("geotrain_compute_utilization", ()) not in samples
    with pytest.raises(OSError):  # closed with the swarm
        scrape(swarm.metrics_port)


def test_rejections_by_reason_and_codecs_are_labelled_with_bounded_values():
    from prometheus_client import CollectorRegistry, generate_latest

    from geotrain.node._metrics import MAX_PEER_SERIES, NodeCollector
    from geotrain.node.state._status import NodeStatus, PeerStatus

    peers = tuple(
        PeerStatus(peer=f"peer{i:03d}", address=f"tcp://10.0.0.{i}:7000", state="alive",
                   rtt_ms=10.0, goodput_mbit=100.0, codec="topk:0.01" if i % 2 else "int8",
                   exchanges_ok=100 - i, exchanges_failed=0)
        for i in range(MAX_PEER_SERIES + 5)
    )  # fmt: skip
    status = NodeStatus(
        peer_id="me", address="tcp://10.0.0.99:7000", algorithm="adpsgd", task="t",
        metric_name="accuracy", elapsed_s=1.0, step=5, steps_per_s=1.0, loss=None, metric=None,
        metric_step=None, bytes_in=0, bytes_out=0, exchanges_ok=3, exchanges_failed=0,
        rejected_updates=3, pid=1, peers=peers, rejected_by_reason={"norm": 2, "decode": 1},
        sync_bytes_in=4096,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: status))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("geotrain_updates_rejected_total", (("reason", "norm"),))] == 2
    assert samples[("geotrain_updates_rejected_total", (("reason", "decode"),))] == 1
    assert samples[("geotrain_state_sync_bytes_total", (("direction", "in"),))] == 4096
    assert samples[("geotrain_state_sync_bytes_total", (("direction", "out"),))] == 0
    codecs = {dict(labels)["peer"]: dict(labels)["codec"]
              for name, labels in samples if name == "geotrain_peer_codec_info"}  # fmt: skip
    # the busiest peers are named, no more than MAX_PEER_SERIES of them
    assert len(codecs) == MAX_PEER_SERIES and codecs["peer001"] == "topk:0.01"
    assert codecs["peer000"] == "int8" and f"peer{MAX_PEER_SERIES:03d}" not in codecs


def _peer(i: int, ok: int, failed: int = 0):
    from geotrain.node.state._status import PeerStatus

    return PeerStatus(peer=f"peer{i:03d}", address=f"tcp://10.0.0.{i}:7000", state="alive",
                      rtt_ms=10.0, goodput_mbit=100.0, codec="int8", exchanges_ok=ok,
                      exchanges_failed=failed)  # fmt: skip


def test_named_peers_keep_their_labels_and_the_others_counter_only_grows():
    from geotrain.node._metrics import PeerLabels

    labels = PeerLabels(limit=3)
    named, other = labels.update(tuple(_peer(i, 10 * (5 - i)) for i in range(5)))
    assert [p.peer for p in named] == ["peer000", "peer001", "peer002"] and other == (20 + 10, 0)
    # peer 4 overtakes them all: the named keep their labels, 4's new exchanges go to other
    named, other = labels.update((_peer(0, 50), _peer(1, 40), _peer(2, 30), _peer(3, 20),
                                  _peer(4, 90, 2)))  # fmt: skip
    assert [p.peer for p in named] == ["peer000", "peer001", "peer002"] and other == (110, 2)
    # peer 1 is forgotten: its label goes to the busiest unnamed (4); other does not go down
    named, other = labels.update((_peer(0, 51), _peer(2, 30), _peer(3, 21), _peer(4, 95, 2)))
    assert [p.peer for p in named] == ["peer000", "peer002", "peer004"] and other == (111, 2)
    # peer 3 is forgotten and comes back with a counter from zero: its new exchanges still count
    labels.update((_peer(0, 51), _peer(2, 30), _peer(4, 95)))
    named, other = labels.update((_peer(0, 51), _peer(2, 30), _peer(3, 4), _peer(4, 95)))
    assert other == (115, 2)


def test_algorithm_counts_are_counters_and_levels_are_gauges():
    from prometheus_client import CollectorRegistry, generate_latest

    from geotrain.node._metrics import NodeCollector
    from geotrain.node.algorithms.selsync import SelsyncStatistics
    from geotrain.node.state._status import NodeStatus

    stats = SelsyncStatistics(steps=40, communicated_steps=10, comm_fraction=0.25,
                              last_relative_change=0.002)  # fmt: skip
    gauges = {f.name for f in dataclasses.fields(stats) if f.metadata.get("gauge")}
    status = NodeStatus(
        peer_id="me", address="tcp://10.0.0.99:7000", algorithm="selsync", task="t",
        metric_name="accuracy", elapsed_s=1.0, step=40, steps_per_s=1.0, loss=None, metric=None,
        metric_step=None, bytes_in=0, bytes_out=0, exchanges_ok=3, exchanges_failed=0,
        rejected_updates=0, pid=1, algorithm_stats=dataclasses.asdict(stats),
        algorithm_gauges=tuple(sorted(gauges)), not_dialled=True,
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: status))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["geotrain_selsync_steps"].type == "counter"
    assert families["geotrain_selsync_communicated_steps"].samples[0].name.endswith("_total")
    assert families["geotrain_selsync_communicated_steps"].samples[0].value == 10
    assert families["geotrain_selsync_comm_fraction"].type == "gauge"
    assert families["geotrain_selsync_comm_fraction"].samples[0].value == 0.25
    assert families["geotrain_selsync_last_relative_change"].type == "gauge"
    assert families["geotrain_not_dialled_back"].samples[0].value == 1.0  # behind NAT, reachable


async def test_a_checkpoint_that_cannot_be_written_is_logged_counted_and_training_goes_on(
    tmp_path, monkeypatch
):
    """A full disk at a checkpoint stopped the node (its work since the last checkpoint lost):
    now the failure is logged and counted, the older checkpoint and no partial file stay,
    training goes on, and the next write that succeeds is a checkpoint again."""
    import errno

    from structlog.testing import capture_logs

    from geotrain.node.state import _checkpoint

    real_write, calls, seen = _checkpoint.write_checkpoint, [], []
    folder = tmp_path / "d" / "checkpoints"
    scraped = threading.Event()  # the node stops at max_steps: it holds step 20 until scraped

    def write(f, ckpt):
        calls.append(ckpt.step)
        if len(calls) == 4:
            scraped.wait(60)
        if len(calls) in (2, 3):  # the first succeeds, the next two find the disk full
            f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        seen.append(sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp")))
        return real_write(f, ckpt)

    monkeypatch.setattr(_checkpoint, "write_checkpoint", write)
    cfg = config(tmp_path, "d", "state.checkpoint_every=5", "training.max_steps=30")
    with capture_logs() as logs:
        admission, key = Admission.open_swarm("geotrain"), Identity.generate()
        async with geotrain.open_node(cfg, identity=key, admission=admission) as node:
            with trio.fail_after(60):
                while len(calls) < 4:  # the second failure counted; held at the 4th write
                    await trio.sleep(0.02)
            try:
                samples = await trio.to_thread.run_sync(scrape, node.metrics.port)
            finally:
                scraped.set()
            with trio.fail_after(60):
                await node.wait_stopped()
            final = node.status()
    assert final.step == 30
    failed = [e for e in logs if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == calls[1:3] == [10, 15]
    assert "No space left" in failed[0]["error"] and failed[0]["log_level"] == "error"
    assert samples[("geotrain_checkpoint_failures_total", ())] == 2
    assert seen[1] == ["ckpt-0000000005.safetensors"]  # kept through both failures, nothing else
    assert sorted(p.name for p in folder.iterdir()) == [
        f"ckpt-{s:010d}.safetensors" for s in (20, 25, 30)]  # fmt: skip


async def test_a_status_that_cannot_be_written_is_logged_once_and_the_node_goes_on(
    tmp_path, monkeypatch
):
    """A full disk under state.dir stopped the node at its next status write (node_failed,
    OSError: No space left on device); a full disk at start was a traceback too."""
    import errno

    from structlog.testing import capture_logs

    from geotrain.node import ConfigError, _status_report

    real, calls = _status_report.write_status, []

    def write_status(path, status):
        calls.append(1)
        if len(calls) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, status)

    monkeypatch.setattr(_status_report, "write_status", write_status)
    cfg = config(tmp_path, "f", "training.max_steps=30", "training.step_time_ms=20")
    with capture_logs() as logs:
        admission, key = Admission.open_swarm("geotrain"), Identity.generate()
        async with geotrain.open_node(cfg, identity=key, admission=admission) as node:
            with trio.fail_after(60):
                await node.wait_stopped()
            final = node.status()
    assert final.step == 30 and len(calls) > 2
    said = [e for e in logs if e["event"] == "status_not_written"]
    assert len(said) == 1 and "No space left" in said[0]["error"]
    assert (tmp_path / "f" / "status.json").exists()  # written again once there was room

    from geotrain.node.state import _files

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "write_atomically", full)
    import geotrain.node._state_hold as state_hold

    monkeypatch.setattr(state_hold, "write_atomically", full)
    with pytest.RaisesGroup(pytest.RaisesExc(ConfigError, match=r"state.dir = '.*/g': cannot "
                                             r"keep the node's state there: No space left"),
                            flatten_subgroups=True, allow_unwrapped=True):  # fmt: skip
        async with geotrain.open_node(config(tmp_path, "g"), identity=key, admission=admission):
            pass


def test_the_metrics_file_is_rotated_past_its_size_keeping_one_old_file(tmp_path):
    """metrics.jsonl grew without end (about 80 MB a node a day at the default cadence)."""
    from geotrain.node.state import append_metrics

    path = tmp_path / "metrics.jsonl"
    for i in range(10):
        append_metrics(path, {"t": i, "pad": "x" * 40}, max_bytes=200)
    lines = [json.loads(x)["t"] for x in path.read_text().splitlines()]
    old = [json.loads(x)["t"] for x in (tmp_path / "metrics.jsonl.1").read_text().splitlines()]
    assert lines and old and old[-1] + 1 == lines[0] and lines[-1] == 9  # nothing lost between
    assert path.stat().st_size < 200 + 100 and len(list(tmp_path.iterdir())) == 2


class _OneGauge:
    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("geotrain_up", "a gauge", value=1.0)


def test_idle_connections_to_the_metrics_port_cost_no_thread_each():
    # a client that opens hundreds of connections and sends nothing: the node serves at most
    # MAX_SCRAPES at once (one thread each) and closes the rest at once; a silent one is closed
    # after SCRAPE_TIMEOUT_S (10 s); once they are gone, scrapes are answered again
    import threading
    import time

    from geotrain.node import _metrics

    server = _metrics.MetricsServer("127.0.0.1:0", _OneGauge())
    before = threading.active_count()
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        deadline = time.monotonic() + 10
        while server.refused < 200 - _metrics.MAX_SCRAPES and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused == 200 - _metrics.MAX_SCRAPES
        assert threading.active_count() <= before + _metrics.MAX_SCRAPES
        idle[-1].settimeout(5)
        assert idle[-1].recv(1) == b""  # (refused: closed unanswered)
        idle[0].settimeout(_metrics.SCRAPE_TIMEOUT_S + 10)
        assert idle[0].recv(1) == b""  # (served, silent: closed after the timeout)
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        numbers = scrape(server.port)
        assert numbers[("geotrain_up", ())] == 1.0
        assert numbers[("geotrain_metrics_connections_refused_total", ())] == server.refused
    finally:
        for s in idle:
            s.close()
        server.close()


async def test_a_diverged_node_stops_and_keeps_its_last_good_checkpoints(tmp_path):
    """A node whose loss went NaN trained on for 1000 steps, wrote NaN checkpoints over its good
    ones (keep = 3) and exited 0 (a stranger's task): a restart could only resume NaN. Now a
    checkpoint of a non-finite model is refused, logged and counted, and after
    training.max_nonfinite_steps bad steps in a row the node stops with Diverged."""
    from structlog.testing import capture_logs

    from geotrain.node.state import CheckpointStore
    from geotrain.node.state._checkpoint import read_checkpoint
    from geotrain.node.training import Diverged

    # SGD at 10^6 on a linear regression: the weights overflow to inf, then NaN, in a few steps
    cfg = config(tmp_path, "n", "training.lr=1e6", "training.max_steps=500",
                 "state.checkpoint_every=1", "training.max_nonfinite_steps=20")  # fmt: skip
    admission, key = Admission.open_swarm("geotrain"), Identity.generate()
    with capture_logs() as logs:
        with pytest.raises(Diverged, match="20 steps in a row"):  # not in a group: catchable
            async with geotrain.open_node(cfg, identity=key, admission=admission) as node:
                with trio.fail_after(60):
                    await node.wait_stopped()
    status = json.loads((tmp_path / "n" / "status.json").read_text())
    assert status["nonfinite_losses"] >= 20 and status["step"] < 100  # stopped, not at 500
    refused = [e for e in logs if e["event"] == "checkpoint_refused"]
    assert refused and refused[0]["log_level"] == "error"
    paths = CheckpointStore(tmp_path / "n" / "checkpoints").paths()
    assert paths  # the good ones, from before the weights went non-finite
    for path in paths:
        ckpt = read_checkpoint(path)
        assert ckpt.step < refused[0]["step"]
        assert all(torch.isfinite(t).all() for t in ckpt.tensors.values() if t.is_floating_point())


async def test_a_bootstrap_naming_the_node_itself_is_said_and_skipped(tmp_path):
    """One config copied to every machine, the first one's included: the first node dialled
    itself and waited 30 s for a state sync nobody could answer, with no word why."""
    from structlog.testing import capture_logs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = f"tcp://127.0.0.1:{port}"
    cfg = config(tmp_path, "s", f'network.listen="{me}"', f'network.bootstrap=["{me}"]',
                 "training.max_steps=5")  # fmt: skip
    with capture_logs() as logs:
        admission, key = Admission.open_swarm("geotrain"), Identity.generate()
        async with geotrain.open_node(cfg, identity=key, admission=admission) as node:
            with trio.fail_after(60):
                await node.wait_stopped()
    said = [e for e in logs if e["event"] == "bootstrap_is_self"]
    assert len(said) == 1 and said[0]["addresses"] == [me]
    assert "starts a swarm of its own" in said[0]["detail"]
    assert not [e for e in logs if e["event"].startswith(("state_sync", "bootstrap_unanswered"))]


def test_the_plain_status_shows_small_traffic_and_the_algorithm_s_own_counters():
    # a frugal node moves tens of kB: "0.03 MB / 0.00 MB" told nothing, and diloco's rounds
    # were shown only by --json and --watch
    from geotrain.node.state import render_status
    from geotrain.node.state._status import NodeStatus

    status = NodeStatus(
        peer_id="me", address="tcp://10.0.0.99:7000", algorithm="diloco", task="t",
        metric_name="accuracy", elapsed_s=1.0, step=40, steps_per_s=1.0, loss=None, metric=None,
        metric_step=None, bytes_in=31_500, bytes_out=2_900, exchanges_ok=3, exchanges_failed=0,
        rejected_updates=0, pid=1, algorithm_stats={"outer_steps": 2, "partners_missing": 1,
                                                    "last_partner": None, "mode": "fast"},
    )  # fmt: skip
    shown = render_status(status.to_json())
    assert "traffic   in 31.5 kB  out 2.9 kB" in shown
    assert "diloco    outer_steps 2  partners_missing 1  last_partner None  mode fast" in shown
    assert "stale" not in shown  # (asked over the network, or no age known: fresh)
    # a laptop's lid closed on a running node: its status file kept showing it stepping, unsaid
    import dataclasses

    data = status.to_json()
    assert "stale     written 65 s ago by a node that said it was running" in render_status(
        data, age_s=65.2)  # fmt: skip
    assert "stale" not in render_status(data, age_s=2.0)
    slow = dataclasses.replace(status, status_every_s=60.0).to_json()  # written every minute
    assert "stale" not in render_status(slow, age_s=65.0)
    assert "stale" in render_status(slow, age_s=200.0)
    stopped = dataclasses.replace(status, running=False).to_json()  # its last status: not stale
    assert "stale" not in render_status(stopped, age_s=65.0)
    # the README said status shows the peak memory: only --json and --watch did
    assert "process" not in shown  # (an older node's status: neither figure)
    used = dataclasses.replace(status, peak_rss_mb=431.4, memory_estimate_mb=520.0,
                               open_files=19, open_files_limit=65536)  # fmt: skip
    assert ("process   memory peak 431 MB (estimated 520 MB)  open files 19 of 65536"
            in render_status(used.to_json()))  # fmt: skip
    flooded = dataclasses.replace(used, open_files=250, open_files_limit=256)
    assert "open files 250 of 256  NEAR THE LIMIT" in render_status(flooded.to_json())


def test_connections_that_trickle_a_byte_at_a_time_do_not_hold_the_metrics_port(monkeypatch):
    """MAX_SCRAPES connections each sending a byte every few seconds held every slot for as
    long as they went on: the timeout was per read. A whole connection gets SCRAPE_TIMEOUT_S."""
    import time

    from geotrain.node import _metrics

    monkeypatch.setattr(_metrics, "SCRAPE_TIMEOUT_S", 1.5)
    server = _metrics.MetricsServer("127.0.0.1:0", _OneGauge())
    trickling = []
    try:
        for _ in range(_metrics.MAX_SCRAPES):
            trickling.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # a byte each 0.5 s: no read waits 1.5 s
            for s in trickling:
                with contextlib.suppress(OSError):
                    s.send(b"G")
            time.sleep(0.5)
        numbers = scrape(server.port)  # the trickling ones were cut at 1.5 s
        assert numbers[("geotrain_up", ())] == 1.0
    finally:
        for s in trickling:
            s.close()
        server.close()
