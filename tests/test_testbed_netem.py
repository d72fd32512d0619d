"""The netem backend's tc commands (as text, and the htb/u32/veth part for real), netem detection,
and the choice of backend."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest

from geotrain.testbed._linkcheck import bulk_bytes_for, measure_link
from geotrain.testbed._linkspec import LinkMatrix, LinkSpec
from geotrain.testbed._namespaces import NamespaceSet, list_namespaces
from geotrain.testbed._netem import (
    BackendUnavailable,
    NetemLinks,
    SystemProbe,
    apply_commands,
    choose_backend,
    netem_available,
    shaping_commands,
    topology_commands,
    update_commands,
)

FAST = LinkSpec(delay_ms=1)
SLOW = LinkSpec(delay_ms=40, jitter_ms=2, loss=0.005, rate_mbit=50)
MATRIX = LinkMatrix.symmetric(("eu", "eu", "us"), {"eu": FAST, "us": FAST},
                              {frozenset({"eu", "us"}): SLOW})  # fmt: skip

root = pytest.mark.skipif(os.geteuid() != 0, reason=f"needs root (euid={os.geteuid()})")


def text(commands: list[list[str]]) -> list[str]:
    return [" ".join(c) for c in commands]


def test_shaping_gives_each_peer_one_class_and_netem_per_destination_region():
    nss = NamespaceSet(3, run_prefix="gt-abcdef-")  # not entered: building commands touches nothing
    p0 = [c for c in text(shaping_commands(nss, MATRIX)) if "gt-abcdef-p00 " in c]
    tc = "tc -n gt-abcdef-p00"
    assert p0 == [
        f"{tc} qdisc add dev eth0 root handle 1: htb",
        f"{tc} class add dev eth0 parent 1: classid 1:10 htb rate 100gbit ceil 100gbit",
        f"{tc} qdisc add dev eth0 parent 1:10 handle 10: netem delay 1ms limit 100000",
        f"{tc} class add dev eth0 parent 1: classid 1:11 htb rate 50mbit ceil 50mbit",
        f"{tc} qdisc add dev eth0 parent 1:11 handle 11: netem delay 40ms 2ms loss 0.5%"
        " limit 100000",
        f"{tc} filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 198.18.0.2/32"
        " flowid 1:10",
        f"{tc} filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 198.18.0.3/32"
        " flowid 1:11",
    ]


def test_topology_puts_one_veth_per_peer_on_the_hub_bridge():
    nss = NamespaceSet(2, run_prefix="gt-abcdef-")
    assert text(topology_commands(nss)) == [
        "ip netns add gt-abcdef-hub",
        "ip -n gt-abcdef-hub link add br0 type bridge",
        "ip -n gt-abcdef-hub link set br0 up",
        "ip -n gt-abcdef-p00 link add eth0 type veth peer name h00 netns gt-abcdef-hub",
        "ip -n gt-abcdef-hub link set h00 master br0 up",
        "ip -n gt-abcdef-p00 addr add 198.18.0.1/15 dev eth0",
        "ip -n gt-abcdef-p00 link set eth0 up",
        "ip -n gt-abcdef-p01 link add eth0 type veth peer name h01 netns gt-abcdef-hub",
        "ip -n gt-abcdef-hub link set h01 master br0 up",
        "ip -n gt-abcdef-p01 addr add 198.18.0.2/15 dev eth0",
        "ip -n gt-abcdef-p01 link set eth0 up",
    ]


def test_a_partition_changes_only_the_links_between_the_two_regions():
    nss = NamespaceSet(3, run_prefix="gt-abcdef-")
    cut = text(update_commands(nss, MATRIX, MATRIX.partitioned("eu", "us")))
    assert len(cut) == 3 * 2  # each peer: its one class toward the other region, class + netem
    assert all("classid 1:11" in c or "handle 11:" in c for c in cut if "p02" not in c)
    assert all("classid 1:10" in c or "handle 10:" in c for c in cut if "p02" in c)
    assert sum("netem delay 40ms 2ms loss 100% limit 100000" in c for c in cut) == 3
    assert update_commands(nss, MATRIX, MATRIX) == []


def test_netem_detection_reports_the_kernels_answer_and_leaves_nothing():
    ok, reason = netem_available()
    if not ok:
        assert reason.startswith(("tc netem: ", "cannot create", "the `ip`/`tc` tools"))
        assert len(reason) > len("tc netem: ")
    assert not [n for n in list_namespaces("gt-") if n.endswith("-probe")]


@root
@pytest.mark.slow
def test_the_generated_htb_u32_and_veth_commands_work_and_shape_the_rate():
    # Everything but the netem qdiscs runs on kernels without sch_netem, so this always runs.
    spec = LinkSpec(rate_mbit=40)
    matrix = LinkMatrix.uniform(2, spec)
    with NamespaceSet(2) as nss:
        apply_commands(topology_commands(nss))
        apply_commands([c for c in shaping_commands(nss, matrix) if "netem" not in c])
        m = measure_link(nss, 0, 1, bulk_bytes=bulk_bytes_for(40, seconds=1.5))
    assert list_namespaces(nss.run_prefix) == []  # the hub carries the run prefix too
    assert m.measured_mbit == pytest.approx(40, rel=0.10)


NETEM_OK, NETEM_WHY = netem_available()


@root
@pytest.mark.slow
@pytest.mark.skipif(not NETEM_OK, reason=f"this kernel has no netem: {NETEM_WHY}")
def test_netem_links_delay_and_shape_within_ten_percent():
    spec = LinkSpec(delay_ms=25, rate_mbit=80)
    with NamespaceSet(2) as nss, NetemLinks(nss, LinkMatrix.uniform(2, spec)):
        m = measure_link(nss, 0, 1, bulk_bytes=bulk_bytes_for(80, seconds=1.5))
    assert m.measured_rtt_ms == pytest.approx(50, rel=0.10)
    assert m.measured_mbit == pytest.approx(80, rel=0.10)


@dataclass
class FakeHost:
    root: bool = True
    userns: tuple[bool, str] = (True, "unshare -rn works")
    has_netem: tuple[bool, str] = (False, "tc netem: Error: Specified qdisc kind is unknown.")
    has_tun: tuple[bool, str] = (True, "/dev/net/tun opens")
    has_namespaces: tuple[bool, str] = (True, "named network namespaces work")

    def is_root(self) -> bool:
        return self.root

    def user_namespace(self) -> tuple[bool, str]:
        return self.userns

    def netem(self) -> tuple[bool, str]:
        return self.has_netem

    def tun(self) -> tuple[bool, str]:
        return self.has_tun

    def namespaces(self) -> tuple[bool, str]:
        return self.has_namespaces


def test_auto_prefers_netem_then_userspace_then_says_loudly_there_is_none():
    assert choose_backend("auto", FakeHost(has_netem=(True, "ok"))).backend == "netem"
    chosen = choose_backend("auto", FakeHost())
    assert chosen.backend == "userspace" and "qdisc kind is unknown" in chosen.reason
    none = choose_backend("auto", FakeHost(has_tun=(False, "/dev/net/tun: No such device")))
    assert none.backend == "none" and none.reason.startswith("NO LINK EMULATION")
    assert "No such device" in none.reason
    no_ns = choose_backend("auto", FakeHost(has_namespaces=(False, "ip: Operation not permitted")))
    assert no_ns.backend == "none" and "no network namespaces" in no_ns.reason


def test_access_links_take_the_userspace_emulator_even_where_netem_works():
    netem_host = FakeHost(has_netem=(True, "ok"))
    chosen = choose_backend("auto", netem_host, access_links=True)
    assert chosen.backend == "userspace" and "access links" in chosen.reason
    with pytest.raises(BackendUnavailable, match="netem cannot emulate the scenario's access"):
        choose_backend("netem", netem_host, access_links=True)


def test_without_root_a_user_namespace_is_tried_before_falling_back():
    chosen = choose_backend("auto", FakeHost(root=False))
    assert (chosen.backend, chosen.user_namespace) == ("userspace", True)
    refused = FakeHost(root=False, userns=(False, "unshare -rn: Operation not permitted"))
    fallback = choose_backend("auto", refused)
    assert fallback.backend == "none" and "Operation not permitted" in fallback.reason


def test_an_explicit_backend_that_cannot_run_is_an_error_not_a_silent_fallback():
    with pytest.raises(BackendUnavailable, match="qdisc kind is unknown"):
        choose_backend("netem", FakeHost())
    with pytest.raises(BackendUnavailable, match="No such device"):
        choose_backend("userspace", FakeHost(has_tun=(False, "/dev/net/tun: No such device")))
    with pytest.raises(ValueError, match="emulation='tc'"):
        choose_backend("tc", FakeHost())
    assert choose_backend("none", FakeHost()).backend == "none"


class UnprivilegedView(SystemProbe):
    """This machine as a non-root user would probe it: everything inside `unshare -rmn`."""

    def is_root(self) -> bool:
        return False


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_probes_inside_a_user_namespace_give_the_same_answers():
    mine, theirs = SystemProbe(), UnprivilegedView()
    if not theirs.user_namespace()[0]:
        pytest.skip(f"no user namespaces here: {theirs.user_namespace()[1]}")
    assert theirs.namespaces() == (True, "named network namespaces work (user ns)")
    if os.geteuid() == 0:  # as root, the user namespace must see the same kernel
        assert theirs.netem()[0] == mine.netem()[0]
        assert theirs.tun()[0] == mine.tun()[0]


@root
def test_this_machine_gets_a_backend_with_a_reason():
    chosen = choose_backend()
    assert chosen.backend in ("netem", "userspace", "none") and chosen.reason
    assert (chosen.backend == "netem") == NETEM_OK
