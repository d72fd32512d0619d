"""Membership on injected time: join, peer exchange, failure detection, refutation, healing."""

from __future__ import annotations

import random

import pytest

from gossip._errors import LocalProtocolError, RemoteProtocolError
from gossip._membership import Membership, Send
from gossip._membership_config import MembershipConfig
from gossip._membership_table import MemberState
from gossip._messages import MemberUpdate, PeerList, Ping
from gossip._netsim import MemoryNetwork

CONFIG = MembershipConfig()


def _swarm(n: int, seed: int, delay_s: float = 0.05, jitter_s: float = 0.02):
    """n nodes that join through node 0 only, with a seeded network."""
    net = MemoryNetwork(random.Random(seed), delay_s=delay_s, jitter_s=jitter_s)
    for i in range(n):
        node = Membership(f"p{i}", f"addr{i}", CONFIG, random.Random(seed * 1000 + i))
        net.add(node, f"addr{i}")
        net.send(node.self_id, node.join([] if i == 0 else ["addr0"], net.now))
    return net


def _view(net: MemoryNetwork, peer: str) -> dict[str, MemberState]:
    return {m.peer_id: m.state for m in net.nodes[peer].members()}


def _all_see_alive(net: MemoryNetwork, peers) -> bool:
    return all(
        all(_view(net, p).get(q) is MemberState.ALIVE for q in peers if q != p) for p in peers
    )


def test_peers_learn_the_whole_swarm_beyond_their_bootstrap_list():
    net = _swarm(12, seed=1)
    peers = list(net.nodes)
    net.run_until(60.0, stop=lambda: _all_see_alive(net, peers))
    assert _all_see_alive(net, peers)
    assert all(net.nodes[p].joined for p in peers)


def test_a_crashed_peer_is_declared_dead_by_all_within_the_bound():
    net = _swarm(10, seed=2)
    peers = list(net.nodes)
    net.run_until(40.0, stop=lambda: _all_see_alive(net, peers))
    crash_at = net.now
    net.crashed.add("p7")
    rest = [p for p in peers if p != "p7"]
    bound = CONFIG.detection_bound_s(len(peers))
    net.run_until(
        crash_at + bound, stop=lambda: all(_view(net, p)["p7"] is MemberState.DEAD for p in rest)
    )
    assert all(_view(net, p)["p7"] is MemberState.DEAD for p in rest)
    assert net.now - crash_at <= bound
    # nobody else was hurt by the crash
    assert all(_view(net, p)[q] is MemberState.ALIVE for p in rest for q in rest if q != p)


def test_a_peer_on_a_lossy_link_is_not_declared_dead():
    net = _swarm(10, seed=3)
    peers = list(net.nodes)
    net.run_until(40.0, stop=lambda: _all_see_alive(net, peers))
    net.loss["p4"] = 0.3  # 30% of every message to or from p4 is dropped, seeded
    events = []
    t_end = net.now + 600.0
    while net.now < t_end:
        net.run_until(net.now + 10.0)
        for p in peers:
            events += [(p, e) for e in net.nodes[p].drain_events()]
    kinds_about_p4 = {e.kind for _, e in events if e.peer_id == "p4"}
    assert "suspected" in kinds_about_p4  # the loss was felt ...
    assert "dead" not in kinds_about_p4  # ... but p4 always refuted in time
    assert all(_view(net, p)["p4"] is not MemberState.DEAD for p in peers if p != "p4")


def test_a_suspected_live_peer_refutes_with_a_higher_incarnation():
    net = _swarm(6, seed=4)
    peers = list(net.nodes)
    net.run_until(30.0, stop=lambda: _all_see_alive(net, peers))
    victim = net.nodes["p3"]
    before = victim.incarnation
    rumour = MemberUpdate("p3", "addr3", "suspect", before, origin="p1")
    net.send("p1", [Send("addr3", "p3", Ping(999_999, "addr1", (rumour,)))])
    net.run_until(net.now + 30.0)
    assert victim.incarnation == before + 1
    assert "refuted" in {e.kind for e in victim.drain_events()}
    assert all(_view(net, p)["p3"] is MemberState.ALIVE for p in peers if p != "p3")
    assert all(net.nodes[p].members()[0] for p in peers)


def test_a_partitioned_swarm_re_merges_after_healing():
    net = _swarm(8, seed=5)
    peers = list(net.nodes)
    net.run_until(40.0, stop=lambda: _all_see_alive(net, peers))
    left, right = peers[:4], peers[4:]
    net.partition([left, right])
    net.run_until(net.now + 400.0)
    assert all(_view(net, p)[q] is MemberState.DEAD for p in left for q in right)
    net.heal()
    net.run_until(net.now + 300.0, stop=lambda: _all_see_alive(net, peers))
    assert _all_see_alive(net, peers)


def test_a_graceful_leave_reaches_everyone_and_is_not_a_failure():
    net = _swarm(8, seed=6)
    peers = list(net.nodes)
    net.run_until(40.0, stop=lambda: _all_see_alive(net, peers))
    net.send("p5", net.nodes["p5"].leave(net.now))
    rest = [p for p in peers if p != "p5"]
    net.run_until(net.now + 30.0)
    assert all(_view(net, p)["p5"] is MemberState.LEFT for p in rest)
    assert net.nodes["p5"].tick(net.now) == []
    assert net.nodes["p5"].next_deadline() == float("inf")


def test_bad_input_from_a_peer_raises_and_changes_nothing():
    node = Membership("me", "addr-me", CONFIG, random.Random(0))
    node.join([], 0.0)
    too_many = tuple(MemberUpdate(f"x{i}", "a", "alive", 0) for i in range(1000))
    bad = [
        PeerList("addr-x", too_many),
        Ping(1, "addr-x", (MemberUpdate("x", "a", "zombie", 0),)),
        Ping(-1, "addr-x"),
        Ping(1, "a" * 10_000),
        Ping(1, "addr-x", (MemberUpdate("x", "a", "alive", -3),)),
        "not a message",
    ]
    for msg in bad:
        with pytest.raises(RemoteProtocolError):
            node.receive(msg, "x", 1.0)
    with pytest.raises(RemoteProtocolError):
        node.receive(Ping(1, "addr-me"), "me", 1.0)
    assert node.members() == []


def test_misuse_by_our_own_code_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        Membership("", "addr", CONFIG, random.Random(0))
    node = Membership("me", "addr-me", CONFIG, random.Random(0))
    node.leave(0.0)
    with pytest.raises(LocalProtocolError):
        node.join(["addr0"], 1.0)


def test_timers_scale_with_swarm_size():
    small, large = CONFIG.suspicion_timeouts(10), CONFIG.suspicion_timeouts(10_000)
    assert large[0] == pytest.approx(4 * small[0])  # log10(10_000) / log10(10)
    confirmed = CONFIG.suspicion_timeout(100, CONFIG.indirect_probes)
    assert confirmed == pytest.approx(CONFIG.suspicion_timeouts(100)[0])
    assert CONFIG.suspicion_timeout(100, 0) == pytest.approx(CONFIG.suspicion_timeouts(100)[1])
    assert CONFIG.retransmits(10_000) > CONFIG.retransmits(10)


@pytest.mark.parametrize(
    ("field", "value"),
    [("probe_interval_s", 0.0), ("probe_timeout_s", 5.0), ("max_piggyback", 0)],
)
def test_a_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MembershipConfig(**{field: value})


def test_peer_exchange_samples_stay_within_their_size():
    node = Membership("me", "addr-me", MembershipConfig(peer_exchange_size=1), random.Random(0))
    node.join([], 0.0)
    members = tuple(MemberUpdate(f"x{i}", f"a{i}", "alive", 0) for i in range(5))
    out = node.receive(PeerList("a0", members, want_reply=True), "x0", 1.0)
    assert [len(send.message.members) for send in out] == [1]  # only this node's own record
    big = Membership("me", "addr-me", MembershipConfig(peer_exchange_size=3), random.Random(0))
    big.join([], 0.0)
    out = big.receive(PeerList("a0", members, want_reply=True), "x0", 1.0)
    listed = out[0].message.members
    assert len(listed) == 3 and listed[0].peer_id == "me" and listed[1].peer_id == "x0"
