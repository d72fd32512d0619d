"""WAN goodput mechanisms: a stream keeps more chunks in flight as the link's bandwidth-delay
product grows, and spreads them over more connections to the peer, both within their bounds.
Speeds are the benchmark's (python -m geotrain.testbed.bench_goodput); nothing here is timed."""

from __future__ import annotations

import os
import shutil

import pytest

from geotrain.node.algorithms import (
    CHUNKS_IN_FLIGHT,
    WINDOW_BYTES,
    chunks_in_flight,
    slow_start_s,
    window_chunks,
)
from geotrain.node.transport import TransportConfig

MiB = 2**20


def test_chunks_in_flight_grow_with_the_bandwidth_delay_product_and_stay_bounded():
    chunk = 8 * MiB
    # 100 Mbit/s at 80 ms holds 1 MB: the least window is plenty
    assert chunks_in_flight(0.080, 100e6 / 8, chunk) == CHUNKS_IN_FLIGHT
    # 1 Gbit/s at 150 ms holds 18.75 MB: three of them in 8 MiB chunks, and one more
    assert chunks_in_flight(0.150, 1e9 / 8, chunk) == 8
    widths = [chunks_in_flight(0.150, mbit * 1e6 / 8, chunk) for mbit in (100, 300, 600, 1000)]
    assert widths == sorted(widths) and widths[0] < widths[-1]
    # bounded by bytes in flight, however fat the link: WINDOW_BYTES of chunks ...
    assert chunks_in_flight(0.3, 100e9 / 8, chunk) == WINDOW_BYTES // chunk
    assert chunks_in_flight(0.3, 100e9 / 8, MiB) == WINDOW_BYTES // MiB
    # ... or the least window of chunks too big for it
    assert chunks_in_flight(0.3, 100e9 / 8, 64 * MiB) == CHUNKS_IN_FLIGHT
    # an unknown link (the defaults: 0.3 s, 10 Mbit/s) gets the least window
    assert chunks_in_flight(0.3, 10e6 / 8, chunk) == CHUNKS_IN_FLIGHT
    # never wider than the stream: 4 KiB chunks on a fat link would count 16,384 of them in
    # flight, and each chunk's deadline would wait for 64 MiB of bytes a 3-chunk stream never sends
    assert chunks_in_flight(0.3, 100e9 / 8, 4096) == WINDOW_BYTES // 4096
    assert chunks_in_flight(0.3, 100e9 / 8, 4096, chunks=3) == 3
    assert chunks_in_flight(0.3, 10e6 / 8, chunk, chunks=1) == 1
    # a stream's window grows beyond 32 MiB only within 1/32 of its bytes (memory: ~8 buffers a
    # chunk in flight): a 10^8 model keeps 4 chunks of 8 MiB on the fattest link, a 10^9 one 8
    assert chunks_in_flight(0.150, 1e9 / 8, chunk, chunks=48) == 4
    assert chunks_in_flight(0.150, 1e9 / 8, chunk, chunks=477) == 8
    assert window_chunks(chunk, 48 * chunk) == 4 and window_chunks(chunk, 477 * chunk) == 8
    assert window_chunks(MiB, 32 * MiB) == 32  # a small model on small chunks: all of them
    assert window_chunks(4096, 4096) == CHUNKS_IN_FLIGHT  # what the estimate counts at least


def test_a_deadline_allows_for_slow_start_by_round_trips():
    assert slow_start_s(0.150, 10 * 1448) == 0.0
    assert slow_start_s(0.150, 64 * MiB) == pytest.approx(0.150 * 12.18, rel=0.01)
    assert slow_start_s(0.0, 64 * MiB) == 0.0


def test_connections_per_peer_is_checked():
    with pytest.raises(ValueError, match="connections_per_peer"):
        TransportConfig(connections_per_peer=0)
    with pytest.raises(ValueError, match="requests_per_connection"):
        TransportConfig(requests_per_connection=0)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/net/tun"),
                    reason="needs root and /dev/net/tun (namespaces, the userspace emulator)")
def test_a_state_sync_on_a_long_fat_link_spreads_over_more_connections(tmp_path):
    """The same state sync across one emulated link (1 Gbit/s, 100 ms), told the link is long and
    fat, then thin: the long fat one keeps a wide window and so dials more connections, up to
    connections_per_peer and no more; the thin one gets by with fewer."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2")
    from geotrain.node import Identity
    from geotrain.testbed._linkspec import LinkMatrix, LinkSpec
    from geotrain.testbed._namespaces import NamespaceSet
    from geotrain.testbed._userspace import UserspaceLinks
    from geotrain.testbed.bench_goodput import run_nodes

    keys = (str(tmp_path / "client.key"), str(tmp_path / "server.key"))
    for path in keys:
        Identity.generate().save(path)
    link = LinkMatrix.uniform(2, LinkSpec(delay_ms=50.0, rate_mbit=1000.0))
    runs = {}
    with NamespaceSet(2) as nss, UserspaceLinks(nss, link):
        # 32 chunks of 1 MiB: the fat link's window (37 chunks: all of them) needs 16
        # connections of 2 requests each, the thin one's (4 chunks) 2
        for name, mbit in (("fat", 1000.0), ("thin", 1.0)):
            runs[name] = run_nodes(nss, keys, "sync", mb=32 * MiB / 1e6, rtt_ms=100.0, mbit=mbit,
                                   connections=3, chunk_mb=1.0)  # fmt: skip
    assert runs["fat"]["ok"] and runs["thin"]["ok"], runs
    assert runs["fat"]["connections"] == 3  # as many as allowed, not one more
    assert runs["thin"]["connections"] <= 2
    assert runs["thin"]["connections"] < runs["fat"]["connections"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_the_testbed_namespaces_keep_the_window_after_idle():
    from geotrain.testbed._namespaces import NamespaceSet

    with NamespaceSet(1) as nss:
        done = nss.run(0, ["sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "0"
