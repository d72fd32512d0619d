"""Prometheus metrics: a running node scraped over HTTP, parsed with prometheus_client's parser."""

from __future__ import annotations

import socket
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
    assert samples[("geotrain_exchanges_total", (("outcome", "ok"),))] >= 3
    assert samples[("geotrain_transport_bytes_total", (("direction", "out"),))] > 0
    assert samples[("geotrain_members", (("state", "alive"),))] == 1
    info = [labels for name, labels in samples if name == "geotrain_node_info"]
    assert dict(info[0])["algorithm"] == "adpsgd" and dict(info[0])["metric"] == "mse"
    assert {"geotrain_loss", "geotrain_metric", "geotrain_checkpoint_age_seconds",
            "geotrain_memory_peak_bytes", "geotrain_peer_exchanges_total"} <= names  # fmt: skip
    peer_rows = [labels for name, labels in samples if name == "geotrain_peer_exchanges_total"]
    assert peer_rows and all(dict(labels)["outcome"] in ("ok", "failed") for labels in peer_rows)


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
    with pytest.raises(OSError):  # closed with the swarm
        scrape(swarm.metrics_port)
