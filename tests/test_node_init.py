"""`geotrain node init`: a node folder that `node run` accepts, and clear refusals."""

from __future__ import annotations

import os
import stat

import pytest

from geotrain.node import load_config
from geotrain.node.cli._main import main


def test_it_writes_a_key_and_a_config_the_node_accepts(tmp_path, capsys):
    folder = tmp_path / "m2"
    code = main(["node", "init", str(folder), "--advertise", "tcp://198.18.0.2:7001",
                 "--bootstrap", "tcp://198.18.0.1:7000", "--shard", "1/3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    peer_id = out.splitlines()[0].removeprefix("peer_id ")
    assert f"geotrain swarm admit --swarm AUTHORITY_DIR {peer_id} --expires 30d" in out
    config = load_config(folder / "node.toml", ())
    assert config.network.listen == "tcp://0.0.0.0:7001"
    assert config.network.advertise == "tcp://198.18.0.2:7001"
    assert config.network.bootstrap == ("tcp://198.18.0.1:7000",)
    assert (config.training.shard_index, config.training.num_shards) == (1, 3)
    assert config.identity.certificate == folder / "member.cert.json"
    assert stat.S_IMODE(os.stat(folder / "node.key").st_mode) == 0o600


def test_refusals_name_the_problem_and_write_nothing(tmp_path, capsys):
    assert main(["node", "init", str(tmp_path / "a"), "--advertise", "here"]) == 2
    assert "network.advertise = 'here'" in capsys.readouterr().err
    for advertise in ("tcp://127.0.0.1", "tcp://0.0.0.0:7000", "tcp://h:99999"):  # were written
        assert main(["node", "init", str(tmp_path / "a"), "--advertise", advertise]) == 2
        assert f"network.advertise = '{advertise}': expected an address peers can dial" in (
            capsys.readouterr().err)  # fmt: skip
    assert main(["node", "init", str(tmp_path / "a"), "--advertise", "tcp://h:1",
                 "--task", "nosuch"]) == 2  # fmt: skip
    assert "task 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (argparse's refusal: exit 2)
        main(["node", "init", str(tmp_path / "a"), "--advertise", "tcp://h:1", "--shard", "3/3"])
    assert "with INDEX from 0 to COUNT - 1" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["node", "init", str(tmp_path / "b"), "--advertise", "tcp://h:1"]) == 0
    key = (tmp_path / "b" / "node.key").read_bytes()
    assert main(["node", "init", str(tmp_path / "b"), "--advertise", "tcp://h:2"]) == 1
    assert "already there, refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "b" / "node.key").read_bytes() == key


def test_a_client_folder_is_client_mode_with_its_bootstrap(tmp_path, capsys):
    """A home user behind NAT edited three lines of the reachable template by hand."""
    folder = tmp_path / "home"
    assert main(["node", "init", str(folder), "--client",
                 "--bootstrap", "tcp://198.18.0.1:7000"]) == 0  # fmt: skip
    config = load_config(folder / "node.toml", ())
    assert config.network.reachable is False and config.network.advertise is None
    assert config.network.listen == "tcp://127.0.0.1:0"
    assert config.network.bootstrap == ("tcp://198.18.0.1:7000",)
    capsys.readouterr()
    # a client needs a member to dial, and takes no address of its own
    assert main(["node", "init", str(tmp_path / "c"), "--client"]) == 2
    assert "network.bootstrap = []: expected at least one reachable peer" in capsys.readouterr().err
    assert main(["node", "init", str(tmp_path / "c"), "--client", "--advertise", "tcp://h:1",
                 "--bootstrap", "tcp://198.18.0.1:7000"]) == 2  # fmt: skip
    assert "--client: a client is dialled by nobody" in capsys.readouterr().err
    assert main(["node", "init", str(tmp_path / "c")]) == 2  # neither
    assert "--advertise tcp://HOST:PORT" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
