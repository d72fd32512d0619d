"""Link estimates: RTT smoothing, goodput from transfers, deadlines, probes, checkpoints."""

from __future__ import annotations

import json
import math

import pytest

from geotrain.gossip._errors import LocalProtocolError
from geotrain.gossip._links import LinkConfig, LinkTable

MB = 1_000_000


def test_rtt_follows_rfc6298():
    links = LinkTable()
    links.record_rtt("a", 0.100, now=0.0)
    est = links.estimate("a", now=0.0)
    assert (est.rtt_s, est.rttvar_s) == pytest.approx((0.100, 0.050))
    links.record_rtt("a", 0.200, now=1.0)
    est = links.estimate("a", now=1.0)
    # rttvar = 3/4 * 0.05 + 1/4 * |0.1 - 0.2|; srtt = 7/8 * 0.1 + 1/8 * 0.2
    assert est.rttvar_s == pytest.approx(0.0625)
    assert est.rtt_s == pytest.approx(0.1125)


def test_goodput_comes_from_transfers_with_the_rtt_taken_out():
    links = LinkTable()
    links.record_rtt("a", 0.2, now=0.0)
    links.record_transfer("a", 100 * MB, seconds=1.2, now=1.0)  # 1.0 s of it moved the bytes
    est = links.estimate("a", now=1.0)
    assert est.goodput_known
    assert est.goodput_bytes_per_s == pytest.approx(100 * MB)
    assert links.expected_transfer_time("a", 50 * MB, now=1.0) == pytest.approx(0.2 + 0.5)


def test_pings_alone_do_not_make_a_goodput_estimate():
    links = LinkTable()
    for i in range(10):
        links.record_rtt("a", 0.05, now=float(i))
        links.record_transfer("a", 100, seconds=0.05, now=float(i))  # tiny, latency-bound
    est = links.estimate("a", now=10.0)
    assert not est.goodput_known
    assert est.goodput_bytes_per_s == links.config.default_goodput_bytes_per_s
    assert links.needs_probe("a", now=10.0)


def test_goodput_tracks_a_link_that_slows_down():
    links = LinkTable()
    links.record_transfer("a", 100 * MB, seconds=1.0, now=0.0)
    for i in range(20):
        links.record_transfer("a", 100 * MB, seconds=10.0, now=float(i + 1))
    assert links.estimate("a", now=21.0).goodput_bytes_per_s == pytest.approx(10 * MB, rel=0.05)


def test_unknown_links_get_a_conservative_deadline_that_then_learns():
    cfg = LinkConfig()
    links = LinkTable(cfg)
    unknown = links.exchange_deadline("a", 10 * MB, now=0.0)
    # 10 MB at the default 10 Mbit/s is 8 s; the deadline allows twice that and more
    assert unknown >= 2 * (8.0 + cfg.default_rtt_s)
    links.record_rtt("a", 0.02, now=0.0)
    links.record_transfer("a", 10 * MB, seconds=0.12, now=0.0)  # 100 MB/s
    learned = links.exchange_deadline("a", 10 * MB, now=1.0)
    assert learned < unknown / 10
    assert learned >= cfg.deadline_floor_s


def test_deadline_is_clamped_and_backs_off_after_failures():
    cfg = LinkConfig(deadline_floor_s=2.0, deadline_cap_s=60.0)
    links = LinkTable(cfg)
    links.record_rtt("a", 0.01, now=0.0)
    links.record_transfer("a", 100 * MB, seconds=1.01, now=0.0)
    assert links.exchange_deadline("a", 1000, now=0.0) == 2.0
    assert links.exchange_deadline("a", 100_000 * MB, now=0.0) == 60.0
    base = links.exchange_deadline("a", 200 * MB, now=0.0)
    links.record_failure("a", now=1.0)
    assert links.exchange_deadline("a", 200 * MB, now=1.0) == pytest.approx(base * 1.5)
    assert links.estimate("a", now=1.0).failures == 1
    links.record_transfer("a", 1000, seconds=0.1, now=2.0)
    assert links.estimate("a", now=2.0).failures == 0


def test_a_stale_estimate_asks_for_a_probe():
    links = LinkTable(LinkConfig(stale_after_s=60.0))
    assert links.needs_probe("a", now=0.0)
    links.record_rtt("a", 0.05, now=0.0)
    links.record_transfer("a", 10 * MB, seconds=1.0, now=0.0)
    assert not links.needs_probe("a", now=59.0)
    assert links.needs_probe("a", now=61.0)
    assert links.estimate("a", now=61.0).age_s == pytest.approx(61.0)
    assert math.isinf(links.estimate("never", now=0.0).age_s)


def test_state_dict_round_trips_through_json_with_ages():
    links = LinkTable()
    links.record_rtt("a", 0.05, now=100.0)
    links.record_transfer("a", 10 * MB, seconds=1.0, now=100.0)
    links.record_failure("b", now=100.0)
    text = json.dumps(links.state_dict(now=110.0))
    restored = LinkTable()
    restored.load_state_dict(json.loads(text), now=5.0)  # a new process: its clock restarted
    for peer in ("a", "b"):
        assert restored.estimate(peer, now=5.0) == links.estimate(peer, now=110.0)


def test_a_corrupt_state_is_refused_and_changes_nothing():
    links = LinkTable()
    links.record_rtt("a", 0.05, now=0.0)
    before = links.state_dict(now=0.0)
    bad_states = [
        {"version": 99, "peers": {}},
        {"version": 1, "peers": {"x": {"srtt": -1}}},
        {"version": 1, "peers": {"x": {"srtt": 0.1, "goodput": "fast", "rttvar": 0, "age": 1,
                                       "failures": 0}}},
    ]  # fmt: skip
    for state in bad_states:
        with pytest.raises(ValueError):
            links.load_state_dict(state, now=0.0)
    assert links.state_dict(now=0.0) == before


def test_bad_measurements_are_our_bug():
    links = LinkTable()
    with pytest.raises(LocalProtocolError):
        links.record_rtt("a", float("nan"), now=0.0)
    with pytest.raises(LocalProtocolError):
        links.record_transfer("a", 10, seconds=0.0, now=0.0)


def test_a_bad_config_names_the_field():
    with pytest.raises(ValueError, match="deadline_cap_s"):
        LinkConfig(deadline_floor_s=10.0, deadline_cap_s=1.0)
