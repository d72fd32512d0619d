"""Testbed scenarios: built-ins, TOML files, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.gossip import SCENARIOS
from geotrain.testbed._linkspec import LinkSpec
from geotrain.testbed._scenario import (
    ScenarioError,
    builtin_scenarios,
    load_scenario,
    scenario_from_dict,
)

GOOD_TOML = """
name = "two"
task = "digits-mlp"
duration_s = 30
[[regions]]
name = "a"
peers = 2
[[regions]]
name = "b"
peers = 1
[links.inside]
delay_ms = 5
rate_mbit = 100
[[links.between]]
regions = ["a", "b"]
delay_ms = 40
jitter_ms = 2
loss = 0.01
rate_mbit = 20
[[stragglers]]
peer = 2
slowdown = 4.0
[[faults]]
at_s = 10
action = "partition"
regions = ["a", "b"]
[[faults]]
at_s = 5
action = "kill"
peer = 1
[[faults]]
at_s = 20
action = "degrade"
regions = ["b", "a"]
delay_ms = 100
rate_mbit = 5
"""


def test_builtins_load_and_geo3_uses_the_published_figures():
    scenarios = builtin_scenarios()
    assert {"demo", "geo3", "lan"} <= set(scenarios)
    geo3 = load_scenario("geo3")
    published = dict(SCENARIOS["geo3"].inter)[("oregon", "tokyo")]
    spec = geo3.matrix().spec("oregon", "tokyo")
    assert spec.delay_ms == pytest.approx(published.one_way_delay_s * 1000)
    assert spec.rate_mbit == pytest.approx(published.bandwidth_bps / 1e6)
    assert geo3.n_peers == 8 and geo3.slowdown(7) == 4.0
    for scenario in scenarios.values():  # every built-in survives its own JSON form
        assert scenario_from_dict(scenario.to_json()).to_json() == scenario.to_json()


def test_toml_file_loads_with_faults_sorted_and_peers_numbered_by_region(tmp_path: Path):
    path = tmp_path / "two.toml"
    path.write_text(GOOD_TOML)
    sc = load_scenario(str(path))
    assert sc.peer_regions == ("a", "a", "b")
    assert [f.at_s for f in sc.faults] == [5, 10, 20]
    matrix = sc.matrix()
    assert matrix.peer_spec(0, 2) == LinkSpec(delay_ms=40, jitter_ms=2, loss=0.01, rate_mbit=20)
    assert matrix.peer_spec(0, 1) == LinkSpec(delay_ms=5, rate_mbit=100)
    assert sc.faults[2].link == LinkSpec(delay_ms=100, rate_mbit=5)
    assert sc.slowdown(2) == 4.0 and sc.slowdown(0) == 1.0


def test_with_peers_spreads_round_robin_and_drops_what_no_longer_fits():
    sc = load_scenario("geo3").with_peers(4)
    assert [r.peers for r in sc.regions] == [2, 1, 1]
    assert sc.slowdowns == {}  # peer 7 is gone
    assert load_scenario("geo3").with_peers(2).n_peers == 2
    assert len(load_scenario("geo3").with_peers(2).regions) == 2
    with pytest.raises(ScenarioError, match="peers"):
        load_scenario("demo").with_peers(1)


def _base() -> dict:
    return json.loads(json.dumps(load_scenario("demo").to_json()))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["regions"][0].update(peers=0), "regions[virginia].peers"),
        (lambda d: d["links"].update(between=[]), "links.between"),
        (lambda d: d["links"]["between"][0].update(delay_ms=-1), "links.between[0]"),
        (lambda d: d["links"]["between"][0].update(speed=1), "links.between[0]"),
        (lambda d: d.update(stragglers=[{"peer": 9, "slowdown": 2}]), "stragglers.peer"),
        (lambda d: d.update(stragglers=[{"peer": 1, "slowdown": 0.5}]), "stragglers[1].slowdown"),
        (lambda d: d.update(faults=[{"at_s": 1, "action": "explode"}]), "faults.action"),
        (lambda d: d.update(faults=[{"at_s": 1, "action": "kill"}]), "faults.peer"),
        (lambda d: d.update(faults=[{"at_s": 1, "action": "kill", "peer": 0}]), "faults.peer"),
        (lambda d: d.update(faults=[{"at_s": -1, "action": "heal"}]), "faults.at_s"),
        (
            lambda d: d.update(faults=[{"at_s": 1, "action": "partition", "regions": ["x", "y"]}]),
            "faults.regions",
        ),
        (lambda d: d.update(faults=[{"at_s": 1, "action": "degrade", "regions": ["virginia",
                                                                             "oregon"]}]),
         "faults.link"),  # fmt: skip
        (lambda d: d.update(duration_s=0), "duration_s"),
        (lambda d: d.update(rate_scale=2), "rate_scale"),
        (lambda d: d.update(colour="red"), "<top level>"),
    ],
)
def test_invalid_scenarios_name_the_field(change, field):
    data = _base()
    change(data)
    with pytest.raises(ScenarioError) as info:
        scenario_from_dict(data)
    assert f"scenario.{field}" in str(info.value)


def test_unknown_name_and_bad_files_are_reported(tmp_path: Path):
    with pytest.raises(ScenarioError, match="built-in"):
        load_scenario("mars")
    with pytest.raises(ScenarioError, match="nope.toml"):
        load_scenario(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("regions = [")
    with pytest.raises(ScenarioError, match="bad.toml"):
        load_scenario(str(bad))


def test_rate_scale_scales_every_rate_and_nothing_else():
    data = _base()
    data["rate_scale"] = 0.5
    sc = scenario_from_dict(data)
    spec = sc.matrix().spec("virginia", "oregon")
    assert spec.rate_mbit == pytest.approx(395.0) and spec.delay_ms == 67.0
    assert sc.to_json()["links"]["between"][0]["rate_mbit"] == 790.0  # the spec, as written
