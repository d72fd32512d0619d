"""Node configuration: TOML, overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from node._config import ConfigError, config_from_toml, load_config

GOOD = """
[identity]
key = "keys/me.key"
open_swarm = true

[network]
listen = "tcp://127.0.0.1:7001"
bootstrap = ["tcp://127.0.0.1:7000"]

[training]
task = "digits-mlp"
lr = 0.1
shard_index = 1
num_shards = 4
[training.params]
hidden = 128

[gossip]
policy = "uniform"
"""


def test_good_config_loads_with_paths_relative_to_the_file(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(GOOD)
    cfg = load_config(path)
    assert cfg.identity.key == tmp_path / "keys/me.key"
    assert cfg.network.bootstrap == ("tcp://127.0.0.1:7000",)
    assert cfg.training.lr == 0.1 and cfg.training.params == {"hidden": 128}
    assert cfg.gossip.policy == "uniform" and cfg.gossip.algorithm == "adpsgd"
    assert cfg.state.dir == Path("state")  # default, untouched


def test_overrides_take_toml_values_and_bare_strings():
    cfg = config_from_toml(
        GOOD,
        base=Path("/x"),
        overrides=["training.lr=0.5", "gossip.policy=ring", 'network.bootstrap=["tcp://h:1"]'],
    )
    assert cfg.training.lr == 0.5 and cfg.gossip.policy == "ring"
    assert cfg.network.bootstrap == ("tcp://h:1",)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.lr=-1", "training.lr = -1.0: expected > 0"),
        ("training.lr=fast", "training.lr = 'fast': expected a number"),
        ("training.shard_index=4", "training.shard_index = 4: expected 0..3"),
        ("gossip.policy=random", "gossip.policy = 'random': expected uniform or ring"),
        ("gossip.exchange_every=0", "gossip.exchange_every = 0: expected >= 1"),
        ("network.listen=localhost:7", "network.listen = 'localhost:7': expected an address"),
        ("training.speed=3", "training.speed = 3: expected one of the keys"),
        ("trainign.lr=3", "trainign = {'lr': 3}: expected one of the sections"),
        ("training.threads=true", "training.threads = True: expected an integer"),
        ("identity.allow=[\"abc\"]", "exactly one way to admit peers"),
        ("lr", "expected section.key=value"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_was_expected(override, message):
    with pytest.raises(ConfigError) as info:
        config_from_toml(GOOD, base=Path("/x"), overrides=[override])
    assert message in str(info.value)


def test_swarm_mode_needs_a_certificate():
    text = '[identity]\nswarm = "swarm.json"\n'
    with pytest.raises(ConfigError, match="identity.certificate"):
        config_from_toml(text, base=Path("/x"))


def test_broken_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        config_from_toml("[training\n", base=tmp_path)
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.toml")
