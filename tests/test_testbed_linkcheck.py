"""The link check: sizes its transfer from the spec, measures a real link between two namespaces,
and says which side failed when it cannot."""

from __future__ import annotations

import os

import pytest

from geotrain.testbed._linkcheck import bulk_bytes_for, measure_link
from geotrain.testbed._namespaces import NETWORK, NamespaceSet, run_ip


def test_the_transfer_is_sized_to_the_spec_rate():
    assert bulk_bytes_for(80, seconds=1.5) == 15_000_000  # 80 Mbit/s for 1.5 s
    assert bulk_bytes_for(0.1) == 1 << 20  # never below 1 MiB
    assert bulk_bytes_for(None) == 256 << 20  # unshaped: enough to see the headroom


root = pytest.mark.skipif(os.geteuid() != 0, reason=f"needs root (euid={os.geteuid()})")


def veth_between(nss: NamespaceSet) -> None:
    """A plain veth pair between peers 0 and 1: no emulation, the fastest link there is."""
    a, b = nss[0], nss[1]
    run_ip(["-n", a.name, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
            "netns", b.name])  # fmt: skip
    for ns, dev in ((a, "v0"), (b, "v1")):
        run_ip(["-n", ns.name, "addr", "add", f"{ns.address}/{NETWORK.prefixlen}", "dev", dev])
        run_ip(["-n", ns.name, "link", "set", dev, "up"])


@root
def test_an_unemulated_link_measures_fast_and_short():
    with NamespaceSet(2) as nss:
        veth_between(nss)
        m = measure_link(nss, 0, 1, bulk_bytes=32 << 20, pings=3)
    # a veth pair has no delay to speak of (tens of microseconds); the bounds leave room for a
    # 2-core box under heavy load, while a wrong unit (s vs ms, bytes vs bits) still fails
    assert 0 < m.measured_rtt_ms < 20
    assert 0 < m.connect_rtt_ms < 20
    assert m.measured_mbit > 100  # Gbit/s when the box is quiet
    assert m.bulk_bytes == 32 << 20


@root
def test_a_server_that_cannot_listen_is_reported_with_its_error():
    with NamespaceSet(2) as nss:  # no link and no address: nothing to bind to
        with pytest.raises(RuntimeError, match="server failed: .*Cannot assign requested address"):
            measure_link(nss, 0, 1, bulk_bytes=1 << 20, pings=1)


@root
def test_a_client_that_cannot_reach_the_server_is_reported_with_its_error():
    with NamespaceSet(2) as nss:
        veth_between(nss)
        run_ip(["-n", nss[0].name, "link", "set", "lo", "down"])
        run_ip(["-n", nss[0].name, "route", "flush", "dev", "v0"])
        with pytest.raises(RuntimeError, match="client failed: .*unreachable"):
            measure_link(nss, 0, 1, bulk_bytes=1 << 20, pings=1)
