"""The userspace link emulator: its packet decisions (pure, exact times) and the real thing
(TUN devices in two namespaces, TCP across, within 10% of the spec)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

from geotrain.testbed._linkcheck import bulk_bytes_for, measure_link
from geotrain.testbed._linkspec import AccessLink, LinkMatrix, LinkSpec
from geotrain.testbed._namespaces import NamespaceSet, list_devices, list_namespaces
from geotrain.testbed._tun import tun_available
from geotrain.testbed._userspace import PacketScheduler, UserspaceConfig, UserspaceLinks

ADDRS = [ipaddress.IPv4Address(f"198.18.0.{i + 1}").packed for i in range(3)]


def packet(src: int, dst: int, size: int = 1000, tag: int = 0) -> bytes:
    """A minimal IPv4 packet of `size` bytes; `tag` marks it so order can be checked."""
    header = bytes([0x45, 0]) + size.to_bytes(2, "big") + tag.to_bytes(2, "big") + bytes(6)
    return header + ADDRS[src] + ADDRS[dst] + bytes(size - 20)


def tag_of(p: bytes) -> int:
    return int.from_bytes(p[4:6], "big")


def scheduler(spec: LinkSpec, **config) -> PacketScheduler:
    return PacketScheduler(ADDRS, LinkMatrix.uniform(3, spec), UserspaceConfig(**config))


# ---- LinkSpec / LinkMatrix -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"jitter_ms": float("nan")}, "jitter_ms"),
        ({"loss": 1.5}, "loss"),
        ({"rate_mbit": 0}, "rate_mbit"),
    ],
)
def test_a_bad_link_spec_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LinkSpec.{field}="):
        LinkSpec(**kwargs)


def test_a_matrix_must_cover_every_region_pair():
    with pytest.raises(ValueError, match=r"no spec for region pairs \[\('b', 'a'\)"):
        LinkMatrix(("a", "b"), ("a", "b"), {("a", "a"): LinkSpec(), ("a", "b"): LinkSpec(),
                                            ("b", "b"): LinkSpec()})  # fmt: skip


def test_a_peer_uses_the_spec_of_its_region_toward_the_other_region():
    fast, slow = LinkSpec(delay_ms=1), LinkSpec(delay_ms=100, rate_mbit=50)
    m = LinkMatrix.symmetric(("eu", "eu", "us"), {"eu": fast, "us": fast},
                             {frozenset({"eu", "us"}): slow})  # fmt: skip
    assert m.peer_spec(0, 1) == fast
    assert m.peer_spec(0, 2) == slow and m.peer_spec(2, 1) == slow


def test_partition_cuts_both_ways_and_the_old_matrix_heals():
    m = LinkMatrix.symmetric(("a", "b"), {"a": LinkSpec(), "b": LinkSpec()},
                             {frozenset({"a", "b"}): LinkSpec(delay_ms=30)})  # fmt: skip
    cut = m.partitioned("a", "b")
    assert cut.spec("a", "b").partitioned and cut.spec("b", "a").partitioned
    assert cut.spec("a", "b").delay_ms == 30 and not cut.spec("a", "a").partitioned
    assert sorted(m.changed_pairs(cut)) == [("a", "b"), ("b", "a")]
    assert cut.changed_pairs(m) == m.changed_pairs(cut)  # going back to `m` heals the same links


def test_a_matrix_survives_the_trip_to_the_emulator_process():
    m = LinkMatrix.symmetric(("a", "b", "b"), {"a": LinkSpec(), "b": LinkSpec(jitter_ms=1)},
                             {frozenset({"a", "b"}): LinkSpec(3, 1, 0.25, 12.5)})  # fmt: skip
    assert LinkMatrix.from_json(json.loads(json.dumps(m.to_json()))) == m


# ---- PacketScheduler (no I/O, exact times) ---------------------------------------------------


def test_a_packet_is_delivered_after_the_one_way_delay():
    s = scheduler(LinkSpec(delay_ms=25))
    s.send(0, packet(0, 1), now=10.0)
    assert s.next_due() == pytest.approx(10.025)
    assert s.pop_due(10.0249) == []
    assert [dst for dst, _ in s.pop_due(10.025)] == [1]


def test_rate_paces_packets_back_to_back():
    s = scheduler(LinkSpec(delay_ms=10, rate_mbit=8))  # 1 byte per microsecond
    for i in range(3):
        s.send(0, packet(0, 1, size=1000, tag=i), now=0.0)
    times = []
    while (t := s.next_due()) is not None:
        times.append(t)
        s.pop_due(t)
    assert times == pytest.approx([0.011, 0.012, 0.013])  # serialization + delay


def test_jitter_never_reorders_a_link():
    s = scheduler(LinkSpec(delay_ms=20, jitter_ms=15), seed=7)
    for i in range(200):
        s.send(0, packet(0, 2, tag=i), now=i * 0.0001)
    delivered = [tag_of(p) for _, p in s.pop_due(1.0)]
    assert delivered == list(range(200))


def test_loss_one_drops_everything_and_is_counted():
    s = scheduler(LinkSpec(loss=1.0))
    for _ in range(50):
        s.send(0, packet(0, 1), now=0.0)
    assert s.next_due() is None
    assert s.statistics().links[0].lost == 50


def test_loss_drops_about_its_share_reproducibly():
    def lost(seed):
        s = scheduler(LinkSpec(loss=0.2), seed=seed)
        for _ in range(5000):
            s.send(0, packet(0, 1), now=0.0)
        return s.statistics().links[0].lost

    assert 900 < lost(1) < 1100
    assert lost(1) == lost(1)


def test_a_full_queue_drops_like_a_router():
    s = scheduler(LinkSpec(rate_mbit=8), queue_min_bytes=10_000, mtu=1280)  # 10 ms of queue
    for _ in range(50):
        s.send(0, packet(0, 1, size=1000), now=0.0)
    stats = s.statistics().links[0]
    assert (stats.packets, stats.overflowed) == (10, 40)
    s.pop_due(1.0)
    s.send(0, packet(0, 1, size=1000), now=1.0)  # drained: accepted again
    assert s.statistics().links[0].packets == 11


def test_a_changed_matrix_applies_to_later_packets():
    s = scheduler(LinkSpec(delay_ms=5))
    s.send(0, packet(0, 1), now=0.0)
    s.set_matrix(LinkMatrix.uniform(3, LinkSpec(delay_ms=50)))
    s.send(0, packet(0, 1), now=0.001)
    assert [t for t, *_ in sorted(s._heap)] == pytest.approx([0.005, 0.051])


def test_packets_to_unknown_addresses_or_not_ipv4_are_counted_not_delivered():
    s = scheduler(LinkSpec())
    s.send(0, packet(0, 1)[:16] + bytes([10, 0, 0, 1]) + bytes(980), now=0.0)
    s.send(0, b"\x60" + bytes(59), now=0.0)  # IPv6
    assert s.next_due() is None and s.statistics().unroutable == 2


def test_links_are_per_source_peer_and_destination_region():
    m = LinkMatrix(("a", "b"), ("a", "a", "b"),
                   {(x, y): LinkSpec(rate_mbit=8) for x in "ab" for y in "ab"})  # fmt: skip
    s = PacketScheduler(ADDRS, m, UserspaceConfig())
    s.send(0, packet(0, 2, size=1000), now=0.0)
    s.send(1, packet(1, 2, size=1000), now=0.0)  # another source: its own clock
    s.send(0, packet(0, 1, size=1000), now=0.0)  # another destination region: its own clock
    assert [t for t, *_ in sorted(s._heap)] == pytest.approx([0.001, 0.001, 0.001])


def _homes(spec: LinkSpec, *access: AccessLink | None) -> PacketScheduler:
    m = LinkMatrix.uniform(3, spec)
    return PacketScheduler(ADDRS, LinkMatrix(m.regions, m.peer_regions, m.links, access),
                           UserspaceConfig())  # fmt: skip


def _drain(s: PacketScheduler) -> list[tuple[float, int, int]]:
    """(time, destination, tag) of every delivery, in order."""
    out = []
    while (t := s.next_due()) is not None:
        out += [(t, dst, tag_of(p)) for dst, p in s.pop_due(t)]
    return out


@pytest.mark.parametrize(("kwargs", "field"), [({"up_mbit": 0}, "up_mbit"),
                                               ({"down_mbit": float("inf")}, "down_mbit"),
                                               ({"delay_ms": -2}, "delay_ms")])  # fmt: skip
def test_a_bad_access_link_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=f"AccessLink.{field}="):
        AccessLink(**kwargs)


def test_access_links_survive_the_trip_and_set_the_end_to_end_path():
    m = LinkMatrix.uniform(3, LinkSpec(delay_ms=40, rate_mbit=1000))
    m = LinkMatrix(m.regions, m.peer_regions, m.links,
                   (None, AccessLink(20, 100, 8), AccessLink(None, 50, 2)))  # fmt: skip
    assert LinkMatrix.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.path_spec(1, 2) == LinkSpec(delay_ms=50, rate_mbit=20)  # the home's uplink
    assert m.path_spec(2, 1) == LinkSpec(delay_ms=50, rate_mbit=100)  # its downlink
    assert m.path_spec(0, 2) == LinkSpec(delay_ms=42, rate_mbit=50)
    with pytest.raises(ValueError, match="2 entries for 3 peers"):
        LinkMatrix(m.regions, m.peer_regions, m.links, (None, None))


def test_a_peers_uplink_paces_everything_it_sends_whoever_receives_it():
    # peer 0's uplink: 8 Mbit/s (1 byte per microsecond); the region link is unshaped, 10 ms
    s = _homes(LinkSpec(delay_ms=10), AccessLink(up_mbit=8, delay_ms=5), None, None)
    for i, dst in enumerate((1, 2, 1)):
        s.send(0, packet(0, dst, size=1000, tag=i), now=0.0)
    got = _drain(s)
    # back to back through one uplink, to two receivers: 1, 2, 3 ms of serialization + 15 ms
    assert [t for t, _, _ in got] == pytest.approx([0.016, 0.017, 0.018])
    assert [(dst, tag) for _, dst, tag in got] == [(1, 0), (2, 1), (1, 2)]


def test_a_downlink_is_shared_by_all_senders_in_order_of_arrival():
    # peer 2's downlink: 8 Mbit/s; peers 0 and 1 send at once over unshaped 10 ms links
    s = _homes(LinkSpec(delay_ms=10), None, None, AccessLink(down_mbit=8))
    s.send(0, packet(0, 2, size=1000, tag=0), now=0.0)
    s.send(1, packet(1, 2, size=1000, tag=1), now=0.0)
    s.send(0, packet(0, 2, size=1000, tag=2), now=0.0)
    assert [t for t, _, _ in _drain(s)] == pytest.approx([0.011, 0.012, 0.013])


def test_a_far_senders_packet_does_not_hold_up_a_near_ones_on_the_downlink():
    # peer 0 is 100 ms from peer 2, peer 1 is 1 ms from it; peer 2's downlink is 8 Mbit/s
    far, near = LinkSpec(delay_ms=100), LinkSpec(delay_ms=1)
    m = LinkMatrix(("far", "near"), ("far", "near", "near"),
                   {("far", "far"): near, ("far", "near"): far, ("near", "far"): far,
                    ("near", "near"): near}, (None, None, AccessLink(down_mbit=8)))  # fmt: skip
    s = PacketScheduler(ADDRS, m, UserspaceConfig())
    s.send(0, packet(0, 2, size=1000, tag=0), now=0.0)  # reaches the downlink at 100 ms
    s.send(1, packet(1, 2, size=1000, tag=1), now=0.0)  # reaches it at 1 ms: goes first
    assert [(round(t, 6), tag) for t, _, tag in _drain(s)] == [(0.002, 1), (0.101, 0)]


def test_a_full_access_link_drops_and_counts():
    s = PacketScheduler(ADDRS, LinkMatrix(("all",), ("all",) * 3, {("all", "all"): LinkSpec()},
                                          (AccessLink(up_mbit=8), None, None)),
                        UserspaceConfig(access_queue_s=0.01, queue_min_bytes=1280,
                                        mtu=1280))  # fmt: skip
    for _ in range(50):  # 10 ms of buffer at 1 byte per microsecond: 10 packets of 1000 bytes
        s.send(0, packet(0, 1, size=1000), now=0.0)
    assert s.statistics().access_overflowed == 40 and len(_drain(s)) == 10


# ---- the real emulator -----------------------------------------------------------------------

tun_ok, tun_why = tun_available()
needs_root_and_tun = pytest.mark.skipif(
    os.geteuid() != 0 or not tun_ok,
    reason=f"needs root and /dev/net/tun (euid={os.geteuid()}; {tun_why})",
)


def tcp_reaches(nss: NamespaceSet, src: int, dst: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection from peer `src` to a listener in `dst` completes in time."""
    server = nss.popen(dst, [sys.executable, "-c", LISTEN, str(nss[dst].address)],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        ready, port = server.stdout.readline().split()
        assert ready == "ready"
        client = nss.run(src, [sys.executable, "-c", CONNECT, str(nss[dst].address), port,
                               str(timeout_s)], capture_output=True, text=True)  # fmt: skip
        return client.returncode == 0
    finally:
        server.kill()
        server.wait()
        server.stdout.close()  # type: ignore[union-attr]


LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print("ready", s.getsockname()[1], flush=True)
s.accept()
"""
CONNECT = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).sendall(b"x")
"""


@needs_root_and_tun
@pytest.mark.slow
def test_measured_rtt_and_throughput_are_within_ten_percent_of_the_spec():
    spec = LinkSpec(delay_ms=25, rate_mbit=80)
    with NamespaceSet(2) as nss, UserspaceLinks(nss, LinkMatrix.uniform(2, spec)) as links:
        m = measure_link(nss, 0, 1, bulk_bytes=bulk_bytes_for(80, seconds=1.5))
        stats = links.statistics()
    assert m.measured_rtt_ms == pytest.approx(50, rel=0.10)
    assert m.connect_rtt_ms == pytest.approx(50, rel=0.10)
    assert m.measured_mbit == pytest.approx(80, rel=0.10)
    assert sum(link.bytes for link in stats.links) >= m.bulk_bytes


@needs_root_and_tun
@pytest.mark.slow
def test_a_home_uplink_and_downlink_are_what_tcp_measures():
    # a home (peer 1: 20 Mbit/s up, 60 down, 5 ms last mile) behind a fast 20 ms region link
    m = LinkMatrix.uniform(2, LinkSpec(delay_ms=20, rate_mbit=400))
    m = LinkMatrix(m.regions, m.peer_regions, m.links, (None, AccessLink(20, 60, 5)))
    with NamespaceSet(2) as nss, UserspaceLinks(nss, m):
        up = measure_link(nss, 1, 0, bulk_bytes=bulk_bytes_for(20, seconds=1.5))
        down = measure_link(nss, 0, 1, bulk_bytes=bulk_bytes_for(60, seconds=1.5))
    assert up.measured_rtt_ms == pytest.approx(50, rel=0.10)  # 2 x (20 + 5)
    assert up.measured_mbit == pytest.approx(20, rel=0.10)
    assert down.measured_mbit == pytest.approx(60, rel=0.10)


@needs_root_and_tun
@pytest.mark.slow
def test_a_partition_stops_traffic_and_healing_restores_it():
    m = LinkMatrix.symmetric(("a", "b"), {"a": LinkSpec(), "b": LinkSpec()},
                             {frozenset({"a", "b"}): LinkSpec(delay_ms=5)})  # fmt: skip
    with NamespaceSet(2) as nss, UserspaceLinks(nss, m) as links:
        assert tcp_reaches(nss, 0, 1)
        links.set_matrix(m.partitioned("a", "b"))
        assert not tcp_reaches(nss, 0, 1, timeout_s=0.5)
        a_to_b = [s for s in links.statistics().links if (s.src_peer, s.dst_region) == (0, "b")]
        assert a_to_b[0].lost > 0
        links.set_matrix(m)
        assert tcp_reaches(nss, 0, 1)


@needs_root_and_tun
def test_the_devices_go_away_with_the_emulator():
    with NamespaceSet(2) as nss:
        with UserspaceLinks(nss, LinkMatrix.uniform(2, LinkSpec())):
            inside = nss.run(0, ["ip", "-o", "link", "show", nss[0].name], capture_output=True)
            assert inside.returncode == 0
        gone = nss.run(0, ["ip", "-o", "link", "show", nss[0].name], capture_output=True)
        assert gone.returncode != 0
        assert list_devices(nss.run_prefix) == []


@needs_root_and_tun
def test_the_emulator_exits_when_its_owner_dies():
    with NamespaceSet(2) as nss:
        links = UserspaceLinks(nss, LinkMatrix.uniform(2, LinkSpec()))
        links.start()
        proc = links._proc
        assert proc is not None
        proc.stdin.close()  # what the kernel does to the pipe when the owner is SIGKILLed
        assert proc.wait(timeout=10) == 0
        links.close()


@needs_root_and_tun
def test_a_crash_inside_the_block_leaves_no_namespace_device_or_emulator():
    with pytest.raises(RuntimeError, match="crash"), NamespaceSet(3) as nss:
        prefix = nss.run_prefix
        with UserspaceLinks(nss, LinkMatrix.uniform(3, LinkSpec(delay_ms=1))) as links:
            emulator = links._proc
            raise RuntimeError("crash")
    assert emulator is not None and emulator.poll() is not None
    assert list_namespaces(prefix) == [] and list_devices(prefix) == []
