"""Partner choice: ring order, exponential hops, uniform spread, bandwidth preference and mixing."""

from __future__ import annotations

import collections
import random

import pytest

from geotrain.gossip._errors import LocalProtocolError
from geotrain.gossip._links import LinkTable
from geotrain.gossip._membership import Membership
from geotrain.gossip._membership_config import MembershipConfig
from geotrain.gossip._netsim import MemoryNetwork
from geotrain.gossip._partners import Candidates, PartnerConfig, PartnerSelector

MB = 1_000_000
PEERS = tuple(f"p{i:02d}" for i in range(16))


def _choices(selector, candidates, links, k, now=0.0, payload=10 * MB):
    return [selector.choose(candidates, links, payload, now + i) for i in range(k)]


def test_ring_alternates_between_the_next_and_previous_id():
    selector = PartnerSelector("ring", "p05", rng=random.Random(0))
    assert _choices(selector, PEERS, LinkTable(), 4) == ["p06", "p04", "p06", "p04"]
    edge = PartnerSelector("ring", "p15", rng=random.Random(0))
    assert _choices(edge, PEERS, LinkTable(), 2) == ["p00", "p14"]  # it wraps around


def test_exponential_hops_are_powers_of_two_then_repeat():
    selector = PartnerSelector("exponential", "p00", rng=random.Random(0))
    got = _choices(selector, PEERS, LinkTable(), 8)
    assert got == ["p01", "p02", "p04", "p08", "p01", "p02", "p04", "p08"]  # log2(16) = 4 hops


def test_a_selector_outside_the_candidates_still_finds_its_ring_place():
    selector = PartnerSelector("ring", "p05x", rng=random.Random(0))  # sorts between p05 and p06
    assert _choices(selector, PEERS, LinkTable(), 2) == ["p06", "p05"]


def test_no_candidate_but_self_means_no_partner():
    for policy in ("uniform", "ring", "exponential", "bandwidth"):
        selector = PartnerSelector(policy, "me", rng=random.Random(0))
        assert selector.choose(("me",), LinkTable(), 1, 0.0) is None
        assert selector.choose((), LinkTable(), 1, 0.0) is None


def test_uniform_spreads_over_everyone_but_self():
    selector = PartnerSelector("uniform", "p00", rng=random.Random(1))
    counts = collections.Counter(_choices(selector, PEERS, LinkTable(), 3000))
    assert set(counts) == set(PEERS) - {"p00"}
    assert max(counts.values()) < 2 * min(counts.values())


def _two_clusters(self_id: str, slow_factor: float) -> LinkTable:
    """p00-p07 on fast links from self, p08-p15 on links slow_factor times slower."""
    links = LinkTable()
    for i, peer in enumerate(PEERS):
        slow = i >= 8
        links.record_rtt(peer, 0.2 if slow else 0.02, now=0.0)
        seconds = (0.2 if slow else 0.02) + (slow_factor if slow else 1.0) * 0.1
        links.record_transfer(peer, 10 * MB, seconds, now=0.0)
    return links


def test_bandwidth_prefers_fast_links_but_keeps_exploring():
    links = _two_clusters("p00", slow_factor=20.0)
    config = PartnerConfig(exploration=0.1, long_range_every=8)
    selector = PartnerSelector("bandwidth", "p00", config, random.Random(2))
    picks = _choices(selector, PEERS, links, 4000)
    slow_share = sum(p >= "p08" for p in picks) / len(picks)
    # exploration (10%) and every 8th choice (12.5%) are uniform: about half of those are slow
    floor = (0.1 + 0.125 * 0.9) * 8 / 15
    assert floor * 0.8 < slow_share < floor * 1.3
    assert set(picks) == set(PEERS) - {"p00"}  # every link keeps being used: no partition


def test_bandwidth_never_partitions_the_gossip_graph():
    """Two clusters joined only by slow links: the graph of chosen edges stays connected."""
    edges = set()
    for i, me in enumerate(PEERS):
        links = _two_clusters(me, slow_factor=1000.0)
        selector = PartnerSelector("bandwidth", me, rng=random.Random(i))
        edges |= {(me, p) for p in _choices(selector, PEERS, links, 200)}
    reached, frontier = {"p00"}, ["p00"]
    while frontier:
        node = frontier.pop()
        for a, b in edges:
            for x, y in ((a, b), (b, a)):
                if x == node and y not in reached:
                    reached.add(y)
                    frontier.append(y)
    assert reached == set(PEERS)


def test_no_hot_spot_when_one_peer_looks_fastest():
    links = LinkTable()
    for peer in PEERS:
        links.record_rtt(peer, 0.05, now=0.0)
        links.record_transfer(peer, 10 * MB, 0.15, now=0.0)
    links.record_transfer("p07", 10 * MB, 0.051, now=0.0)  # p07 looks far faster than the rest
    config = PartnerConfig(max_share=0.25, share_window=16)
    selector = PartnerSelector("bandwidth", "p00", config, random.Random(3))
    picks = _choices(selector, PEERS, links, 1600)
    for start in range(0, 1600 - 16):
        assert picks[start : start + 16].count("p07") <= 4
    assert picks.count("p07") / len(picks) > 1 / 15  # still preferred over an even share


def test_failed_and_busy_partners_are_skipped_for_a_while():
    links = _two_clusters("p00", slow_factor=20.0)
    config = PartnerConfig(exploration=0.01, long_range_every=0, busy_cooldown_s=5.0)
    selector = PartnerSelector("bandwidth", "p00", config, random.Random(4))
    fast = [p for p in PEERS[1:8]]
    for peer in fast[:-1]:
        selector.record_outcome(peer, ok=False, now=0.0)
        selector.record_outcome(peer, ok=False, now=0.0)  # 2 failures: paused 2 * 5 s
    selector.record_busy(fast[-1], now=0.0)
    early = [selector.choose(PEERS, links, 10 * MB, 1.0) for _ in range(50)]
    assert not set(early) & set(fast)
    later = [selector.choose(PEERS, links, 10 * MB, 6.0) for _ in range(50)]
    assert fast[-1] in later  # busy is only a pause
    assert not set(later) & set(fast[:-1])  # still paused until t = 10 s
    selector.record_outcome(fast[0], ok=True, now=7.0)
    assert fast[0] in [selector.choose(PEERS, links, 10 * MB, 7.0) for _ in range(100)]


@pytest.mark.parametrize("policy", ["bandwidth", "uniform"])
def test_a_failed_only_peer_waits_out_its_pause_a_busy_one_does_not(policy):
    # with nobody else to choose, a busy peer is still taken (its exchange may succeed now),
    # but one that failed is not before its pause ends: a node whose only peer was gone
    # retried it at every step (373 "connection refused" lines in 5 s)
    config = PartnerConfig(busy_cooldown_s=5.0)
    selector = PartnerSelector(policy, "p00", config, random.Random(0))
    pair = ("p00", "p01")
    selector.record_busy("p01", now=0.0)
    assert selector.choose(pair, LinkTable(), MB, 1.0) == "p01"
    selector.record_outcome("p01", ok=False, now=2.0)
    assert [selector.choose(pair, LinkTable(), MB, t) for t in (2.5, 4.0, 6.9)] == [None] * 3
    assert selector.choose(pair, LinkTable(), MB, 7.1) == "p01"
    for t in (8.0, 14.0, 20.0):  # three more failures: paused 40 s, but the only peer there is
        selector.record_outcome("p01", ok=False, now=t)  # is tried again 5 s after each
    assert selector.choose(pair, LinkTable(), MB, 24.0) is None
    assert selector.choose(pair, LinkTable(), MB, 25.1) == "p01"


def test_payload_size_per_peer_changes_the_choice():
    links = _two_clusters("p00", slow_factor=20.0)
    config = PartnerConfig(exploration=0.01, long_range_every=0)
    selector = PartnerSelector("bandwidth", "p00", config, random.Random(5))
    # the slow cluster would carry far less (compressed harder): it now finishes first
    sizes = {p: (10_000 if p >= "p08" else 100 * MB) for p in PEERS}
    picks = [selector.choose(PEERS, links, sizes.__getitem__, float(i)) for i in range(300)]
    assert sum(p >= "p08" for p in picks) > 0.8 * len(picks)


def test_candidates_are_shared_and_sorted():
    view = Candidates(["b", "a", "c", "a"])
    assert view.ids == ("a", "b", "c")
    assert view.ring_peer("b", 1) == "c" and view.ring_peer("bb", 1) == "c"
    assert view.ring_peer("bb", -1) == "b" and view.ring_peer("z", 1) == "a"


def test_misuse_is_a_local_error_and_bad_config_names_the_field():
    with pytest.raises(LocalProtocolError):
        PartnerSelector("fastest", "me", rng=random.Random(0))
    with pytest.raises(LocalProtocolError):
        PartnerSelector("uniform", "me")
    with pytest.raises(ValueError, match="exploration"):
        PartnerConfig(exploration=0.0)


def test_candidates_from_membership_drop_a_crashed_peer():
    """The node's loop in small: live_peers() feeds the selector, probe RTTs feed the links."""
    net = MemoryNetwork(random.Random(9), delay_s=0.05)
    for i in range(6):
        node = Membership(f"m{i}", f"addr{i}", MembershipConfig(), random.Random(i))
        net.add(node, f"addr{i}")
        net.send(node.self_id, node.join([] if i == 0 else ["addr0"], 0.0))
    me = net.nodes["m0"]
    net.run_until(60.0)
    links = LinkTable()
    for sample in me.drain_rtt_samples():
        links.record_rtt(sample.peer_id, sample.rtt_s, sample.at)
    assert links.estimate("m1", 60.0).rtt_s == pytest.approx(0.1)  # 2 x 50 ms
    selector = PartnerSelector("uniform", "m0", rng=random.Random(0))
    assert {selector.choose(me.live_peers(), links, 1, 60.0) for _ in range(200)} == {
        "m1", "m2", "m3", "m4", "m5",
    }  # fmt: skip
    net.crashed.add("m3")
    net.run_until(60.0 + MembershipConfig().detection_bound_s(6))
    assert "m3" not in me.live_peers()
    assert "m3" not in {selector.choose(me.live_peers(), links, 1, 200.0) for _ in range(200)}
