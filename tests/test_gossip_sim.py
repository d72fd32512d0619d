"""The averaging simulator and its command line, at small sizes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from geotrain.gossip import consensus_distance, sim
from geotrain.gossip._partners import POLICIES
from geotrain.gossip._scenarios import SCENARIOS
from geotrain.gossip._simulator import SimConfig, _Run, simulate


def test_json_has_the_promised_shape_and_every_policy_reaches_eps(capsys):
    assert sim.main(["--scenario", "geo3", "--peers", "16", "--json", "--max-rounds", "200"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scenario"] == "geo3" and report["peers"] == 16
    assert report["eps"] == pytest.approx(1e-4 * report["initial_distance"])
    assert [row["policy"] for row in report["policies"]] == list(POLICIES)
    for row in report["policies"]:
        assert {"policy", "rounds_to_eps", "time_to_eps_s", "bytes_total"} <= set(row)
        assert row["rounds_to_eps"] > 0 and row["time_to_eps_s"] > 0
        assert row["final_distance"] <= report["eps"]
        assert row["bytes_total"] >= 2 * 100_000_000 * row["exchanges"]


def test_the_text_table_names_every_policy(capsys):
    assert sim.main(["--peers", "8", "--policies", "uniform,ring"]) == 0
    out = capsys.readouterr().out
    assert "uniform" in out and "ring" in out and "bandwidth" not in out


def test_bad_arguments_exit_non_zero(capsys):
    assert sim.main(["--policies", "fastest"]) == 2
    assert sim.main(["--peers", "1"]) == 2
    assert "peers" in capsys.readouterr().err


def test_averaging_keeps_the_mean_and_the_tracked_distance_is_exact():
    run = _Run(SCENARIOS["geo3"], "uniform", SimConfig(peers=30, max_rounds=3, warmup_rounds=0))
    mean = np.asarray(run.rows).mean(axis=0)
    run.run()
    assert np.allclose(np.asarray(run.rows).mean(axis=0), mean)
    assert run.sq / run.n == pytest.approx(consensus_distance(np.asarray(run.rows)), rel=1e-9)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    config = SimConfig(peers=24)
    a = simulate(SCENARIOS["geo3"], "bandwidth", config)
    b = simulate(SCENARIOS["geo3"], "bandwidth", config)
    c = simulate(SCENARIOS["geo3"], "bandwidth", SimConfig(peers=24, seed=1))
    assert a == b
    assert a.time_to_eps_s != c.time_to_eps_s


def test_bandwidth_keeps_most_exchanges_inside_a_region_on_geo3():
    config = SimConfig(peers=48)
    uniform = simulate(SCENARIOS["geo3"], "uniform", config)
    bandwidth = simulate(SCENARIOS["geo3"], "bandwidth", config)
    assert uniform.cross_region_share > 0.5  # two thirds of random partners are far away
    assert bandwidth.cross_region_share < 0.4
    assert bandwidth.time_to_eps_s < uniform.time_to_eps_s


def test_a_policy_that_cannot_reach_eps_in_time_says_so():
    result = simulate(SCENARIOS["geo3"], "ring", SimConfig(peers=64, max_rounds=5))
    assert result.rounds_to_eps is None and result.time_to_eps_s is None
    assert result.final_distance > 1e-4
