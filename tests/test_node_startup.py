"""The node's start-up checks, without a node: each returns the warnings a config, a certificate
or a state directory calls for (or refuses with a ConfigError), and nothing where all is well."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import structlog

from geotrain.node import ConfigError, config_from_toml
from geotrain.node._config import NetworkConfig, TrainingConfig
from geotrain.node._startup import (
    StartupWarning,
    bootstrap_peers,
    check_certificate,
    codec_drops_model_values,
    config_warnings,
    loop_unused_training,
    preset_overridden,
    state_dir_moved,
    unasked_task_params,
    unused_gossip_settings,
)
from geotrain.node.training import TaskContext

BASE = """
[identity]
key = "me.key"
open_swarm = true
[training]
task = "digits-mlp"
[gossip]
"""


def gossip(text: str = "", *overrides: str):
    return config_from_toml(BASE + text, base=Path("/x"), overrides=list(overrides)).gossip


def events(warnings: list[StartupWarning]) -> list[str]:
    return [w.event for w in warnings]


def test_a_settings_table_of_another_algorithm_is_named():
    found = unused_gossip_settings(gossip('algorithm = "adpsgd"\n[gossip.choco]\ngamma = 0.5'))
    assert events(found) == ["gossip_settings_unused"]
    assert found[0].fields["tables"] == ["gossip.choco"]
    assert found[0].fields["algorithm"] == "adpsgd"
    assert unused_gossip_settings(gossip('algorithm = "choco"\n[gossip.choco]\ngamma = 0.5')) == []


def test_training_settings_a_loop_of_ones_own_does_not_read_are_named():
    found = loop_unused_training(TrainingConfig(lr=0.5, seed=3, eval_every=7))
    assert events(found) == ["training_settings_unused"]
    assert found[0].fields["settings"] == ["training.lr"]  # (seed and eval_every are read)
    assert loop_unused_training(TrainingConfig()) == []
    # the task and what `node init --shard` writes are left alone: a shared node.toml has them
    assert loop_unused_training(TrainingConfig(task="digits-mlp", shard_index=1,
                                               num_shards=2)) == []  # fmt: skip


def test_a_preset_overridden_is_a_warning_for_the_algorithm_and_news_for_a_setting():
    algorithm = preset_overridden(gossip('preset = "frugal"\nalgorithm = "adpsgd"'))
    assert events(algorithm) == ["gossip_preset_overridden"] and algorithm[0].level == "warning"
    assert "algorithm" in algorithm[0].fields["overridden"]
    setting = preset_overridden(gossip('preset = "frugal"\ncodec = "int8"'))
    assert events(setting) == ["gossip_preset_overridden"] and setting[0].level == "info"
    assert preset_overridden(gossip('preset = "frugal"')) == []


@pytest.mark.parametrize(("codec", "averages_models", "said"), [
    ("sign", True, True), ("topk:0.01", True, True), ("int8", True, False),
    ("auto", True, False), ("sign", False, False)])  # fmt: skip
def test_a_codec_that_drops_values_is_named_for_whole_model_averaging(codec, averages_models,
                                                                      said):  # fmt: skip
    found = codec_drops_model_values(gossip(f'codec = "{codec}"'), averages_models)
    assert events(found) == (["codec_drops_model_values"] if said else [])


def test_config_warnings_gathers_the_checks_in_order_and_the_loops_only_for_a_loop():
    config = config_from_toml(BASE + 'codec = "sign"\n[gossip.choco]\ngamma = 0.5',
                              base=Path("/x"), overrides=["training.lr=0.5"])  # fmt: skip
    daemon = config_warnings(config, averages_models=True, own_loop=False)
    assert events(daemon) == ["gossip_settings_unused", "codec_drops_model_values"]
    loop = config_warnings(config, averages_models=True, own_loop=True)
    assert events(loop) == ["gossip_settings_unused", "training_settings_unused",
                            "codec_drops_model_values"]  # fmt: skip
    plain = config_from_toml(BASE, base=Path("/x"))
    assert config_warnings(plain, averages_models=True, own_loop=True) == []


def test_checkpoints_in_the_working_directorys_state_are_pointed_to(tmp_path: Path):
    work, home = tmp_path / "work", tmp_path / "home"
    (work / "state" / "checkpoints").mkdir(parents=True)
    root = home / "state"
    assert state_dir_moved(root, root / "checkpoints", work) == []  # nothing there to find
    (work / "state" / "checkpoints" / "ckpt-10.safetensors").write_bytes(b"")
    found = state_dir_moved(root, root / "checkpoints", work)
    assert events(found) == ["state_dir_moved"]
    assert found[0].fields["found"] == str(work / "state")
    # not when the node resumes anyway, runs there, or chose a state.dir of another name
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "ckpt-3.safetensors").write_bytes(b"")
    assert state_dir_moved(root, root / "checkpoints", work) == []
    assert state_dir_moved(work / "state", work / "state" / "checkpoints", work) == []
    assert state_dir_moved(home / "mine", home / "mine" / "checkpoints", work) == []


def test_bootstrap_leaves_out_the_nodes_own_addresses():
    net = NetworkConfig(listen="tcp://0.0.0.0:7000",
                        bootstrap=("tcp://127.0.0.1:7000", "tcp://10.0.0.2:7000"))  # fmt: skip
    dial, found = bootstrap_peers(net, "tcp://10.0.0.1:7000")
    assert dial == ["tcp://10.0.0.2:7000"]
    assert events(found) == ["bootstrap_is_self"]
    assert found[0].fields["addresses"] == ["tcp://127.0.0.1:7000"]
    assert "swarm of its own" not in found[0].fields["detail"]
    alone = NetworkConfig(listen="tcp://127.0.0.1:7000", bootstrap=("tcp://127.0.0.1:7000",))
    dial, found = bootstrap_peers(alone, None)
    assert dial == [] and "starts a swarm of its own" in found[0].fields["detail"]
    # the advertised address is the node's own too; another port is another node
    other = NetworkConfig(listen="tcp://127.0.0.1:7000", advertise="tcp://1.2.3.4:7000",
                          bootstrap=("tcp://1.2.3.4:7000", "tcp://127.0.0.1:7001"))  # fmt: skip
    assert bootstrap_peers(other, None)[0] == ["tcp://127.0.0.1:7001"]
    assert bootstrap_peers(NetworkConfig(listen="tcp://127.0.0.1:7000"), None) == ([], [])


def test_an_expired_certificate_is_refused_with_how_to_renew_it():
    cert = types.SimpleNamespace(expires_at=1_000.0)
    check_certificate(None, "gtpeer", None, now=5_000.0)  # (no certificate: nothing to check)
    check_certificate(cert, "gtpeer", Path("/x/me.cert"), now=999.0)
    with pytest.raises(ConfigError, match=r"identity.certificate = '/x/me.cert': expired at"):
        check_certificate(cert, "gtpeer", Path("/x/me.cert"), now=1_000.0)


def test_task_parameters_nobody_asked_for_are_refused_for_a_builtin_and_said_for_a_plugin():
    ctx = TaskContext(params={"hidden": 64, "hiddden": 32})
    ctx.param("hidden", 128, int)
    with pytest.raises(ConfigError, match=r"training.params.hiddden"):
        unasked_task_params("digits-mlp", ctx)
    found = unasked_task_params("my_tasks:tiny", ctx)
    assert events(found) == ["task_params_unused"] and found[0].fields["unused"] == ["hiddden"]
    ctx = TaskContext(params={"hidden": 64})
    ctx.param("hidden", 128, int)
    assert unasked_task_params("digits-mlp", ctx) == []


def test_a_warning_logs_at_its_level():
    with structlog.testing.capture_logs() as logs:
        StartupWarning("gossip_preset_overridden", {"preset": "frugal"}, "info").log(
            structlog.get_logger())
        StartupWarning("bootstrap_is_self", {"addresses": []}).log(structlog.get_logger())
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("gossip_preset_overridden", "info"), ("bootstrap_is_self", "warning")]
