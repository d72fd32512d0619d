"""NAT in the testbed (scenario key `nat`): the scenario checks it; the firewall in a NAT peer's
namespace drops inbound connections and lets its own out; a run with peers behind NAT reaches the
target with client-mode nodes that nobody tried to dial (the firewall's DROP counter stays 0)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.testbed._linkspec import LinkMatrix, LinkSpec
from geotrain.testbed._namespaces import NamespaceSet, list_namespaces
from geotrain.testbed._nat import NatFirewall
from geotrain.testbed._netem import (
    BackendChoice,
    apply_commands,
    choose_backend,
    topology_commands,
)
from geotrain.testbed._run import RunOptions, run_testbed
from geotrain.testbed._scenario import ScenarioError, load_scenario, scenario_from_dict
from geotrain.testbed._userspace import UserspaceLinks

SMALL_NAT = {
    "name": "small-nat",
    "description": "4 peers, 2 regions, peers 2 and 3 behind NAT",
    "task": "digits-mlp",
    "duration_s": 60,
    "regions": [{"name": "east", "peers": 2}, {"name": "west", "peers": 2}],
    "links": {
        "inside": {"delay_ms": 2, "rate_mbit": 500},
        "between": [{"regions": ["east", "west"], "delay_ms": 10, "rate_mbit": 100}],
    },
    "nat": [3, 2],
}


@pytest.mark.parametrize("nat", [[0], [4], [2, 2], [True], "2", [1.5]])
def test_a_bad_nat_list_names_the_field(nat):
    with pytest.raises(ScenarioError, match=r"scenario\.nat"):
        scenario_from_dict({**SMALL_NAT, "nat": nat})


def test_nat_is_kept_sorted_written_out_and_cut_with_the_peer_count():
    sc = scenario_from_dict(SMALL_NAT)
    assert sc.nat == (2, 3) and sc.to_json()["nat"] == [2, 3]
    assert scenario_from_dict(sc.to_json()).nat == (2, 3)
    assert sc.with_peers(3).nat == (2,)
    assert load_scenario("geo3").nat == ()


def test_nat_without_iptables_is_refused_before_anything_is_made(tmp_path: Path, monkeypatch):
    # it was refused only after every namespace and link had been made (about 4 s)
    import geotrain.testbed._nat as nat
    import geotrain.testbed._run as run

    monkeypatch.setattr(nat, "IPTABLES", "iptables-that-is-not-installed")
    monkeypatch.setattr(run, "choose_backend", lambda *a, **k: BackendChoice("userspace", "test"))

    def made(*args, **kwargs):
        raise AssertionError("namespaces were made")

    monkeypatch.setattr(run, "NamespaceSet", made)
    options = RunOptions(
        scenario=scenario_from_dict(SMALL_NAT), out=tmp_path / "run", target=0.9,
        emulation="auto", baseline="none", link_check=False,
    )  # fmt: skip
    with pytest.raises(run.TestbedError, match="scenario.nat needs iptables"):
        run_testbed(options, echo=lambda line: None)
    assert not (tmp_path / "run").exists()


def _namespaces_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("NAT emulation needs root (network namespaces)")
    if shutil.which("iptables") is None:
        pytest.skip("NAT emulation needs iptables (Debian: apt-get install iptables)")
    if choose_backend("auto").backend == "none":
        pytest.skip(choose_backend("auto").reason)


LISTEN = (
    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('0.0.0.0', 7100)); s.listen(); "
    "s.settimeout(8); print('up', flush=True); c, _ = s.accept(); c.sendall(b'hi')"
)
CONNECT = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 7100), timeout=2); "
    "print(c.recv(2).decode())"
)


def _connects(nss: NamespaceSet, src: int, dst: int) -> bool:
    """Whether peer `src` can open a TCP connection to a listener in peer `dst`'s namespace."""
    listener = nss.popen(dst, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        dial = nss.run(src, [sys.executable, "-c", CONNECT, str(nss[dst].address)],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
        return dial.returncode == 0 and dial.stdout.strip() == "hi"
    finally:
        listener.kill()
        listener.wait()


@contextlib.contextmanager
def _linked(nss: NamespaceSet, backend: str):
    """The peers' links as the backend makes them: the userspace emulator's TUN devices, or
    the netem backend's veth pairs on a bridge (its topology; the netem qdiscs are left out, as
    this kernel has none: the firewall does not depend on them)."""
    if backend == "userspace":
        matrix = LinkMatrix.symmetric(("a", "a"), {"a": LinkSpec(delay_ms=1)}, {})
        with UserspaceLinks(nss, matrix):
            yield
    else:
        apply_commands(topology_commands(nss))
        yield


@pytest.mark.parametrize("backend", ["userspace", "veth"])
def test_the_nat_firewall_drops_inbound_connections_and_lets_outbound_ones_through(backend):
    _namespaces_or_skip()
    with NamespaceSet(2) as nss, _linked(nss, backend):
        assert _connects(nss, 0, 1)  # before NAT: peer 1 can be dialled
        with NatFirewall(nss, [1]) as nat:
            assert nat.inbound_attempts() == {1: 0}
            assert _connects(nss, 1, 0)  # behind NAT: it dials out, and the replies come back
            assert not _connects(nss, 0, 1)  # but nobody can dial it
            assert nat.inbound_attempts()[1] >= 1  # the counter saw that attempt
        assert _connects(nss, 0, 1)  # lifted: reachable again
        prefix = nss.run_prefix
    assert list_namespaces(prefix) == []


@pytest.mark.slow
def test_peers_behind_nat_reach_the_target_as_clients_and_are_never_dialled(tmp_path: Path):
    _namespaces_or_skip()
    out = tmp_path / "run"
    lines: list[str] = []
    options = RunOptions(
        scenario=scenario_from_dict(SMALL_NAT), out=out, target=0.9, emulation="auto",
        baseline="none", link_check=False, progress_every_s=5.0,
    )  # fmt: skip
    summary = run_testbed(options, echo=lines.append)
    log = "\n".join(lines)
    geotrain = summary["systems"][0]
    assert geotrain["time_to_target_s"] is not None, log
    run = json.loads((out / "run.json").read_text())
    # the firewall was up, and not one inbound connection attempt reached a NAT peer
    assert run["nat"] == {"peers": [2, 3], "firewall": True,
                          "inbound_attempts": {"2": 0, "3": 0}}, log  # fmt: skip
    for peer in (2, 3):
        config = (out / "geotrain" / f"peer-{peer:02d}.toml").read_text()
        assert "reachable = false" in config
        metrics = (out / "geotrain" / f"peer-{peer:02d}" / "metrics.jsonl").read_text()
        last = json.loads(metrics.splitlines()[-1])
        assert last["metric"] >= 0.9 and last["exchanges_ok"] > 0, last
