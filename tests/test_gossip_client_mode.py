"""Client-mode members in gossip's Membership (sans-I/O): nobody sends anything to a client's
address except answers to what it sent (which node/ carries back on the client's own request);
a client is live while it talks, and suspected, then dead, once it stops."""

from __future__ import annotations

import random

from geotrain.gossip import (
    Membership,
    MembershipConfig,
    MemberState,
    client_address,
    is_client_address,
)

CFG = MembershipConfig(probe_interval_s=1.0, probe_timeout_s=0.4)
IDS = ("gtreach0", "gtreach1", "gtclient")


class Swarm:
    """Two reachable members and one client, messages delivered at once; what a reachable member
    sends to the client's address only reaches it as the answer to the client's own message."""

    def __init__(self) -> None:
        self.addresses = {"gtreach0": "tcp://r0:1", "gtreach1": "tcp://r1:1",
                          "gtclient": client_address("gtclient")}  # fmt: skip
        self.nodes = {p: Membership(p, a, CFG, random.Random(i))
                      for i, (p, a) in enumerate(self.addresses.items())}  # fmt: skip
        self.by_address = {a: p for p, a in self.addresses.items()}
        self.dialled_client = 0  # sends to the client's address not answering its own message
        self.client_silent = False
        self.now = 0.0

    def start(self) -> None:
        self.deliver("gtreach0", self.nodes["gtreach0"].join([], self.now))
        self.deliver("gtreach1", self.nodes["gtreach1"].join(["tcp://r0:1"], self.now))
        self.deliver("gtclient", self.nodes["gtclient"].join(["tcp://r0:1"], self.now))

    def deliver(self, sender: str, sends, answering: str | None = None) -> None:
        for send in sends:
            to = self.by_address.get(send.address)
            if is_client_address(send.address) and to != answering:
                self.dialled_client += 1  # node/ would put it in the client's mailbox
                continue
            if to is None or (sender == "gtclient" and self.client_silent):
                continue
            replies = self.nodes[to].receive(send.message, sender, self.now)
            # the answers to the client's message travel back on its own request
            self.deliver(to, replies, answering=sender if sender == "gtclient" else None)

    def run_until(self, t: float) -> None:
        while self.now < t:
            self.now = round(self.now + 0.1, 6)
            for peer, node in self.nodes.items():
                if peer == "gtclient" and self.client_silent:
                    continue
                self.deliver(peer, node.tick(self.now))


def test_a_client_is_live_to_the_reachable_members_and_never_sent_to_unasked():
    swarm = Swarm()
    swarm.start()
    swarm.run_until(60.0)
    r0, r1, client = (swarm.nodes[p] for p in IDS)
    for reachable in (r0, r1):
        assert "gtclient" in reachable.live_peers()  # it talks to both, so both verified it
        assert "gtclient" not in reachable.dialable_peers()
        assert reachable.live_count() == 2
    assert client.live_peers() == client.dialable_peers() == ("gtreach0", "gtreach1")
    assert swarm.dialled_client == 0  # no probe, verification, help or exchange to it unasked
    # the client's probes were answered on its own requests: it measured round trips
    assert {s.peer_id for s in client.drain_rtt_samples()} == {"gtreach0", "gtreach1"}


def test_a_silent_client_is_suspected_then_declared_dead():
    swarm = Swarm()
    swarm.start()
    swarm.run_until(20.0)
    r0 = swarm.nodes["gtreach0"]
    assert {m.peer_id: m.state for m in r0.members()}["gtclient"] is MemberState.ALIVE
    swarm.client_silent = True
    silence = CFG.client_silence_s(3)
    swarm.run_until(20.0 + silence + 1.0)
    state = {m.peer_id: m.state for m in r0.members()}
    assert state["gtclient"] in (MemberState.SUSPECT, MemberState.DEAD)
    swarm.run_until(20.0 + silence + 1.0 + CFG.suspicion_timeouts(3)[1] + 1.0)
    assert {m.peer_id: m.state for m in r0.members()}["gtclient"] is MemberState.DEAD
    assert "gtclient" not in r0.live_peers() and r0.live_count() == 1
    assert swarm.dialled_client == 0


def test_a_client_known_second_hand_counts_as_live_but_is_not_pinged():
    swarm = Swarm()
    swarm.start()
    swarm.run_until(30.0)
    r1 = swarm.nodes["gtreach1"]
    # a third reachable member that only hears of the client through r1
    late = Membership("gtreach2", "tcp://r2:1", CFG, random.Random(9))
    swarm.nodes["gtreach2"], swarm.addresses["gtreach2"] = late, "tcp://r2:1"
    swarm.by_address["tcp://r2:1"] = "gtreach2"
    swarm.deliver("gtreach2", late.join(["tcp://r1:1"], swarm.now))
    swarm.client_silent = True  # the client dials nobody new: r2 knows it only second-hand
    swarm.run_until(33.0)
    assert "gtclient" not in late.live_peers() and late.live_count() == 3
    assert r1.dialable_peers() == ("gtreach0", "gtreach2")
    assert swarm.dialled_client == 0
