"""The link check: sizes its transfer from the spec, measures a real link between two namespaces,
and says which side failed when it cannot."""

from __future__ import annotations

import os

import pytest

from geotrain.testbed._html import _off_spec_warning
from geotrain.testbed._linkcheck import bulk_bytes_for, measure_link, off_spec
from geotrain.testbed._namespaces import NETWORK, NamespaceSet, run_ip
from geotrain.testbed._summary import links_off_spec


def test_the_transfer_is_sized_to_the_spec_rate():
    assert bulk_bytes_for(80, seconds=1.5) == 15_000_000  # 80 Mbit/s for 1.5 s
    assert bulk_bytes_for(0.1) == 1 << 20  # never below 1 MiB
    assert bulk_bytes_for(None) == 256 << 20  # unshaped: enough to see the headroom


def checked(spec_rtt, rtt, spec_mbit, mbit) -> dict:
    return {"src": "a", "dst": "b", "spec_rtt_ms": spec_rtt, "measured_rtt_ms": rtt,
            "spec_mbit": spec_mbit, "measured_mbit": mbit}  # fmt: skip


def test_a_link_more_than_a_tenth_off_its_spec_is_flagged():
    # the default demo's 2 Gbit/s link as one busy run measured it
    assert off_spec(checked(20, 20.4, 2000, 1341)) == ["1341 Mbit/s, spec 2000 (-33%)"]
    assert off_spec(checked(150, 170, 100, 95)) == ["RTT 170 ms, spec 150 (+13%)"]
    assert off_spec(checked(20, 20.4, 1000, 1120)) == ["1120 Mbit/s, spec 1000 (+12%)"]
    # within a tenth, a tiny RTT within a millisecond, unshaped, or not measured: not flagged
    assert off_spec(checked(150, 164, 100, 91)) == []
    assert off_spec(checked(0, 0.6, None, 3100)) == []
    assert off_spec(checked(20, None, 100, None)) == []


def test_the_summary_and_the_report_name_the_links_off_spec():
    links = [checked(20, 20.4, 2000, 1341), checked(134, 134.5, 790, 780)]
    off = links_off_spec(links)
    assert off == [{"src": "a", "dst": "b", "misses": ["1341 Mbit/s, spec 2000 (-33%)"]}]
    box = _off_spec_warning(off)
    assert 'class="off-spec"' in box and "1341 Mbit/s, spec 2000 (-33%)" in box
    assert _off_spec_warning(links_off_spec(links[1:])) == ""


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
