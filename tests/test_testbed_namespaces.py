"""Peer namespaces: made with the run's prefix, and removed with everything inside them on exit,
on an exception, and (through cleanup_leftovers) after the owner was SIGKILLed."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from geotrain.testbed._namespaces import (
    NamespaceSet,
    cleanup_leftovers,
    list_devices,
    list_namespaces,
    namespace_pids,
    new_run_prefix,
    peer_address,
    process_running,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason=f"network namespaces need root (euid={os.geteuid()})"
)


def leftovers(run_prefix: str) -> tuple[list[str], list[str]]:
    return list_namespaces(run_prefix), list_devices(run_prefix)


def test_addresses_come_from_the_benchmark_range_only():
    assert [str(peer_address(i)) for i in (0, 1, 254, 255)] == [
        "198.18.0.1", "198.18.0.2", "198.18.0.255", "198.18.1.0",
    ]  # fmt: skip
    benchmark = ipaddress.IPv4Network("198.18.0.0/15")
    assert peer_address(131_000) in benchmark
    with pytest.raises(ValueError, match="peer index"):
        peer_address(131_070)


def test_a_namespace_set_refuses_names_that_cannot_be_device_names():
    with pytest.raises(ValueError, match="exceed 15 characters"):
        NamespaceSet(2, run_prefix="gt-much-too-long-")


def test_cleanup_refuses_an_empty_prefix():
    with pytest.raises(ValueError, match="empty prefix"):
        cleanup_leftovers("")


def test_namespaces_exist_inside_the_block_with_loopback_up_and_are_gone_after():
    with NamespaceSet(3) as nss:
        prefix = nss.run_prefix
        assert list_namespaces(prefix) == [f"{prefix}p00", f"{prefix}p01", f"{prefix}p02"]
        lo = nss.run(1, ["ip", "-o", "link", "show", "lo"], capture_output=True, text=True)
        assert "UP" in lo.stdout.split("<", 1)[1].split(">", 1)[0].split(",")
    assert leftovers(prefix) == ([], [])


def test_an_exception_in_the_block_still_removes_namespaces_and_processes():
    with pytest.raises(RuntimeError, match="boom"), NamespaceSet(2) as nss:
        prefix = nss.run_prefix
        started = nss.popen(0, ["sleep", "600"])
        stray = nss.run(1, ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"],
                        capture_output=True, text=True)  # fmt: skip
        stray_pid = int(stray.stdout)
        assert stray_pid in namespace_pids(nss[1].name)
        raise RuntimeError("boom")
    assert started.poll() is not None
    assert not process_running(stray_pid)
    assert leftovers(prefix) == ([], [])


CRASHING_RUN = """
import subprocess, sys, time
from testbed._namespaces import NamespaceSet
nss = NamespaceSet(2, run_prefix=sys.argv[1])
nss.create()
subprocess.run(["ip", "tuntap", "add", "dev", sys.argv[1] + "d0", "mode", "tun"], check=True)
child = nss.popen(1, ["sleep", "600"])
print(child.pid, flush=True)
time.sleep(600)
"""


def crash_a_run(victim: str) -> int:
    """Start CRASHING_RUN under `victim`, SIGKILL it once set up; the pid it left sleeping."""
    run = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CRASHING_RUN), victim],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert run.stdout is not None
        return int(run.stdout.readline())
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
        run.stdout.close()  # type: ignore[union-attr]


def test_cleanup_leftovers_removes_what_a_killed_run_left_and_nothing_else():
    victim, bystander = new_run_prefix(), new_run_prefix()
    with NamespaceSet(1, run_prefix=bystander):
        sleeper = crash_a_run(victim)
        assert leftovers(victim) == ([f"{victim}p00", f"{victim}p01"], [f"{victim}d0"])
        assert process_running(sleeper)

        removed = cleanup_leftovers(victim)

        assert f"pid {sleeper}" in removed and f"dev {victim}d0" in removed
        assert leftovers(victim) == ([], [])
        assert not process_running(sleeper)
        assert list_namespaces(bystander) == [f"{bystander}p00"]
    assert cleanup_leftovers(victim) == []


def test_testbed_down_with_run_removes_that_run_only():
    # `geotrain testbed down --run PREFIX`, the prefix as `testbed run` prints it (no trailing -)
    victim, bystander = new_run_prefix(), new_run_prefix()
    with NamespaceSet(1, run_prefix=bystander):
        sleeper = crash_a_run(victim)
        down = [sys.executable, "-m", "geotrain.node", "testbed", "down", "--run",
                victim.rstrip("-")]  # fmt: skip
        out = subprocess.run(down, capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"removed netns {victim}p00" in out and f"removed pid {sleeper}" in out
        assert "WARNING" not in out  # only the named run was touched
        assert leftovers(victim) == ([], [])
        assert not process_running(sleeper)
        assert list_namespaces(bystander) == [f"{bystander}p00"]
        again = subprocess.run(down, capture_output=True, text=True, timeout=60, check=True)
        assert "nothing left over" in again.stdout
    bad = subprocess.run([*down[:-1], "gt-nothex"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected a run prefix" in bad.stderr
