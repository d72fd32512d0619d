"""Scenarios: the published AWS figures, complete link matrices, round-robin regions."""

from __future__ import annotations

import pytest

from geotrain.gossip._scenarios import SCENARIOS, LinkProfile, Scenario


def test_geo3_uses_the_published_figures():
    geo3 = SCENARIOS["geo3"]
    assert geo3.link("oregon", "oregon") == geo3.intra
    assert geo3.intra.one_way_delay_s == 0.010 and geo3.intra.bandwidth_bps == 2e9
    oregon_virginia = geo3.link("oregon", "virginia")
    assert (oregon_virginia.one_way_delay_s, oregon_virginia.bandwidth_bps) == (0.067, 0.79e9)
    assert geo3.link("tokyo", "oregon").bandwidth_bps == 0.523e9
    assert "derived" in geo3.link("tokyo", "virginia").source  # said plainly: not measured


def test_every_scenario_is_fast_inside_and_slower_between_regions():
    for scenario in SCENARIOS.values():
        for a in scenario.regions:
            for b in scenario.regions:
                if a != b:
                    link = scenario.link(a, b)
                    assert link.bandwidth_bps < scenario.intra.bandwidth_bps
                    assert link.one_way_delay_s >= scenario.intra.one_way_delay_s


def test_peers_are_spread_round_robin():
    geo3 = SCENARIOS["geo3"]
    assert [geo3.region_of(i) for i in range(4)] == ["virginia", "oregon", "tokyo", "virginia"]


def test_a_scenario_missing_a_pair_is_refused():
    with pytest.raises(ValueError, match="no link between a and c"):
        link = LinkProfile(0.01, 1e9)
        Scenario("x", "", ("a", "b", "c"), link, ((("a", "b"), link), (("b", "c"), link)))
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LinkProfile(0.01, 0.0)
