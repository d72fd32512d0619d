"""The node's membership service and client-mode peers: nothing is ever sent to a client's
address; what a client is owed waits in its mailbox and goes back in the Delivered that answers
its next message, the answer to that message first, within one header's room."""

from __future__ import annotations

import random

from geotrain.gossip import LinkTable, PartnerSelector, Ping, Send, client_address
from geotrain.node._membership_service import MembershipService
from geotrain.node._protocol import MAX_CARRIED, Delivered, unwrap_gossip, wrap_gossip
from geotrain.node.transport import PeerInfo

CLIENT = "gtclient"


class NoNetwork:
    """A transport that must not be used: any request fails the test."""

    requests: list[str]

    def __init__(self) -> None:
        self.requests = []

    async def request(self, address, header, payload=b"", *, deadline_s, expect_peer=None):
        self.requests.append(address)
        raise AssertionError(f"dialled {address}")


def ping_from_client(seq: int):
    return wrap_gossip(Ping(seq, client_address(CLIENT)))


def service(transport) -> MembershipService:
    rng = random.Random(0)
    return MembershipService(
        "gtreach0", "tcp://r0:1", (), 1.0, transport, LinkTable(),
        PartnerSelector("uniform", "gtreach0", rng=rng), rng,
    )  # fmt: skip


async def test_messages_for_a_client_wait_for_its_next_message_and_come_back_with_the_answer():
    network = NoNetwork()
    svc = service(network)
    for seq in range(1, MAX_CARRIED + 5):  # more than fit: the newest MAX_CARRIED are kept
        await svc._deliver(Send(client_address(CLIENT), CLIENT, Ping(seq, "tcp://r0:1")))
    assert network.requests == []  # nobody dials a client
    peer = PeerInfo(CLIENT, b"", "tcp://127.0.0.1:5", "inbound")
    reply, _ = await svc.handle(peer, ping_from_client(99), memoryview(b""))
    assert isinstance(reply, Delivered)
    carried = [unwrap_gossip(m) for m in reply.messages]
    assert len(carried) == MAX_CARRIED
    assert type(carried[0]).__name__ == "Ack" and carried[0].seq == 99  # its answer first
    assert [m.seq for m in carried[1:]] == list(range(5, MAX_CARRIED + 4))  # then its mail
    assert network.requests == []
    # what did not fit waits for the client's next message; then the mailbox is empty
    reply, _ = await svc.handle(peer, ping_from_client(100), memoryview(b""))
    assert [unwrap_gossip(m).seq for m in reply.messages] == [100, MAX_CARRIED + 4]
    reply, _ = await svc.handle(peer, ping_from_client(101), memoryview(b""))
    assert [unwrap_gossip(m).seq for m in reply.messages] == [101]


async def test_a_reachable_peer_gets_an_empty_delivered():
    svc = service(NoNetwork())
    peer = PeerInfo("gtreach1", b"", "tcp://r1:1", "inbound")
    reply, _ = await svc.handle(peer, wrap_gossip(Ping(7, "tcp://r1:1")), memoryview(b""))
    assert reply == Delivered()  # its Ack travels as a request of its own, as before


async def test_news_of_a_member_at_an_address_no_node_has_is_refused_and_never_dialled():
    """A member gossiped at ipc:///path (any URL nng knows) was taken, dialled (a local Unix
    socket got nng's header) and spread to the swarm; a node's address is tcp://HOST:PORT."""
    from geotrain.gossip import MemberUpdate, PeerList
    from geotrain.node.transport import ErrorReply

    network = NoNetwork()
    svc = service(network)
    peer = PeerInfo("gtevil01", b"", "tcp://r1:1", "inbound")
    fine = MemberUpdate("gtfine01", "tcp://[::1]:7000", "alive", 1)
    for bad in ("ipc:///tmp/x.sock", "inproc://x", "ws://r2:80", "tcp://r2"):
        # the entry goes, the message stays (an older node may still hold such a member) ...
        news = PeerList("tcp://r1:1", (MemberUpdate("gtfake01", bad, "alive", 1), fine))
        reply, _ = await svc.handle(peer, wrap_gossip(news), memoryview(b""))
        assert not isinstance(reply, ErrorReply), (bad, reply)
        # ... but a sender at such an address is refused whole
        reply, _ = await svc.handle(peer, wrap_gossip(Ping(1, bad)), memoryview(b""))
        assert isinstance(reply, ErrorReply) and "a node's address is tcp://HOST:PORT" in (
            reply.reason), (bad, reply)  # fmt: skip
    members = {m.peer_id for m in svc.membership.members()}
    assert "gtfake01" not in members and "gtfine01" in members
    assert svc.rejected["gossip"] == 8 and network.requests == []


async def test_a_flood_of_bad_gossip_is_counted_whole_and_logged_within_a_quota(monkeypatch):
    """An admitted peer's 2000 bad messages wrote 2000 warnings in 3 s (600 lines a second)."""
    from structlog.testing import capture_logs

    from geotrain.node import _log_quota
    from geotrain.node.transport import ErrorReply

    svc = service(NoNetwork())
    peer = PeerInfo("gtevil01", b"", "tcp://r1:1", "inbound")
    flood = _log_quota.WARNINGS_PER_MINUTE + 30
    with capture_logs() as logs:
        for seq in range(flood):
            reply, _ = await svc.handle(peer, wrap_gossip(Ping(seq, "ipc:///x")),
                                        memoryview(b""))  # fmt: skip
            assert isinstance(reply, ErrorReply)
        monkeypatch.setattr(_log_quota, "_clock", lambda: 1e9)  # a minute later
        await svc.handle(peer, wrap_gossip(Ping(0, "ipc:///x")), memoryview(b""))
    said = [e for e in logs if e["event"] == "message_rejected"]
    assert svc.rejected["gossip"] == flood + 1  # every one counted ...
    assert len(said) == _log_quota.WARNINGS_PER_MINUTE + 1  # ... the log within its quota
    assert said[-1]["left_out"] == 30 and said[-1]["log_level"] == "warning"


class InstantProbes:
    """A transport whose answers take no time at all (a free link on the virtual clock)."""

    async def request(self, address, header, payload=b"", *, deadline_s, expect_peer=None):
        from geotrain.node._protocol import ProbeReply

        return ProbeReply(received=len(payload)), b"", None


async def test_a_probe_answered_in_no_time_leaves_the_link_unmeasured_and_the_node_running(
    autojump_clock,
):
    links = LinkTable()
    rng = random.Random(0)
    svc = MembershipService(
        "gtreach0", "tcp://r0:1", (), 1.0, InstantProbes(), links,
        PartnerSelector("uniform", "gtreach0", rng=rng), rng,
    )  # fmt: skip
    await svc._probe("gtreach1", "tcp://r1:1")  # took 0 s: no goodput sample, no error
    assert not links.estimate("gtreach1", 0.0).goodput_known


async def test_waiting_for_peers_counts_one_that_came_and_left_before_the_last_arrived():
    """Three peers of a short run: the first waits for two. The second joined, finished its steps
    and left before the third joined; the first counts both and starts, where waiting for two
    live at once waited out wait_for_peers_s (300 s) for a peer that had come and gone."""
    import trio

    from geotrain.gossip import Leave

    svc = service(NoNetwork())
    early = PeerInfo("gtearly1", b"", "tcp://r1:1", "inbound")
    await svc.handle(early, wrap_gossip(Ping(1, "tcp://r1:1")), memoryview(b""))
    assert svc.live_count() == 1
    await svc.handle(early, wrap_gossip(Leave("tcp://r1:1", 0)), memoryview(b""))
    assert svc.live_count() == 0 and svc.arrived_count() == 1
    stop = trio.Event()
    with trio.move_on_after(0.5) as waited:  # not yet: one of two showed up
        await svc.wait_for_peers(2, 10.0, stop)
    assert waited.cancelled_caught
    late = PeerInfo("gtlate01", b"", "tcp://r2:1", "inbound")
    await svc.handle(late, wrap_gossip(Ping(2, "tcp://r2:1")), memoryview(b""))
    with trio.fail_after(1.0):
        await svc.wait_for_peers(2, 10.0, stop)
    assert svc.live_count() == 1 and svc.arrived_count() == 2
