# Network namespaces for testbed peers. Invariants: every namespace, device and process this module
# makes carries the run's name prefix (`gt-<runid>-...`), and nothing without that prefix is ever
# touched; a NamespaceSet removes all it made when its `with` block ends, also on an exception or
# Ctrl-C; peer addresses come only from 198.18.0.0/15 (RFC 2544, never routed anywhere).
from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "gt-"
NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
MAX_IFNAME = 15  # IFNAMSIZ - 1: names double as device names, so they must fit


# Set in every namespace (each has its own): a connection that idled past its retransmission
# timeout keeps its congestion window instead of starting over from the initial one, so a
# model stream's next chunks, or the next exchange on the same connection, need not climb back
# through slow start (Linux's default, 1, costs log2(window / 14 KB) round trips each time:
# 1.8 s for 64 MiB at 150 ms). A node's host should set it too (docs/how-to/testbed-scenarios.md).
NAMESPACE_SYSCTLS = ("net.ipv4.tcp_slow_start_after_idle=0",)


class NamespaceError(RuntimeError):
    """A namespace command failed; the message carries the command and the kernel's answer."""


def run_ip(args: Sequence[str], *, check: bool = True, input: str | None = None) -> str:
    """Run `ip ARGS...` (or another tool if args[0] is absolute / tc) and return stdout.

    Raises:
        NamespaceError: the command exited non-zero and `check` is set.
    """
    argv = list(args) if args[0] in ("tc", "sysctl", "unshare") else ["ip", *args]
    proc = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NamespaceError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def peer_address(index: int) -> ipaddress.IPv4Address:
    """Address of peer `index` (0-based): 198.18.0.1, 198.18.0.2, ... inside 198.18.0.0/15."""
    address = NETWORK.network_address + 1 + index
    if index < 0 or address >= NETWORK.broadcast_address:
        raise ValueError(f"peer index {index}: expected 0 <= index < {NETWORK.num_addresses - 2}")
    return address


def new_run_prefix(prefix: str = PREFIX) -> str:
    """A run-unique prefix such as `gt-3fa9c1-`."""
    return f"{prefix}{secrets.token_hex(3)}-"


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of existing network namespaces that start with `prefix`."""
    out = run_ip(["netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def list_devices(prefix: str = PREFIX) -> list[str]:
    """Names of network devices in the root namespace that start with `prefix`."""
    out = run_ip(["-o", "link", "show"], check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return sorted(n for n in names if n.startswith(prefix))


def namespace_pids(name: str) -> list[int]:
    """Processes running inside namespace `name` (`ip netns pids`)."""
    out = run_ip(["netns", "pids", name], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def process_running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a killed process waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _kill_pids(pids: Sequence[int], wait_s: float = 5.0) -> None:
    """SIGKILL `pids` and wait (up to `wait_s`) until none of them runs any more."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(process_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def cleanup_leftovers(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces, devices and processes left by runs whose names start with `prefix`.

    Processes inside a matching namespace are SIGKILLed, then the namespace is deleted, then
    matching devices of the root namespace are deleted. Safe to call when nothing is left.

    Returns:
        What was removed, as strings like "netns gt-3fa9c1-p00", "pid 1234", "dev gt-3fa9c1-p01".
    """
    if not prefix:
        raise ValueError("cleanup_leftovers: an empty prefix would match everything")
    removed: list[str] = []
    for name in list_namespaces(prefix):
        pids = namespace_pids(name)
        _kill_pids(pids)
        removed += [f"pid {p}" for p in pids]
        run_ip(["netns", "del", name], check=False)
        removed.append(f"netns {name}")
    for dev in list_devices(prefix):
        run_ip(["link", "del", dev], check=False)
        removed.append(f"dev {dev}")
    return removed


@dataclass(frozen=True)
class Namespace:
    """One peer's namespace: its name (also the name of its device) and address."""

    index: int
    name: str
    address: ipaddress.IPv4Address

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


class NamespaceSet:
    """N network namespaces named `<run prefix>p00`, `p01`, ... with loopback up.

    Use as a context manager (`with NamespaceSet(4) as nss:`); on exit every process started
    through `popen`, every process still inside the namespaces and the namespaces themselves are
    removed, together with any root-namespace device carrying the run prefix.
    """

    def __init__(self, n: int, *, prefix: str = PREFIX, run_prefix: str | None = None) -> None:
        if n < 1:
            raise ValueError(f"NamespaceSet.n={n}: expected at least 1")
        self.run_prefix = run_prefix or new_run_prefix(prefix)
        if not self.run_prefix.startswith(prefix):
            raise ValueError(
                f"run_prefix={self.run_prefix!r}: expected it to start with {prefix!r}"
            )
        self.namespaces = tuple(
            Namespace(i, f"{self.run_prefix}p{i:02d}", peer_address(i)) for i in range(n)
        )
        too_long = [ns.name for ns in self.namespaces if len(ns.name) > MAX_IFNAME]
        if too_long:
            raise ValueError(f"namespace names {too_long[:3]} exceed {MAX_IFNAME} characters")
        self._procs: list[subprocess.Popen] = []
        self._created = False

    def __len__(self) -> int:
        return len(self.namespaces)

    def __getitem__(self, index: int) -> Namespace:
        return self.namespaces[index]

    def __iter__(self) -> Iterator[Namespace]:
        return iter(self.namespaces)

    def create(self) -> None:
        """Create the namespaces, bring their loopback up and set their TCP sysctls
        (NAMESPACE_SYSCTLS) (idempotent per set)."""
        self._created = True  # set first: a half-made set is still cleaned up
        batch = "".join(f"netns add {ns.name}\n" for ns in self.namespaces)
        run_ip(["-batch", "-"], input=batch)
        for ns in self.namespaces:
            run_ip(["-n", ns.name, "link", "set", "lo", "up"])
            run_ip(["netns", "exec", ns.name, "sysctl", "-q", "-w", *NAMESPACE_SYSCTLS])

    def run(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside namespace `index` and wait for it (kwargs go to subprocess.run)."""
        return subprocess.run(self.namespaces[index].exec_argv(argv), **kwargs)

    def popen(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside namespace `index`; the set kills it on exit if it still runs."""
        proc = subprocess.Popen(self.namespaces[index].exec_argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill what runs inside, delete the namespaces and the run's devices. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs.clear()
        if self._created:
            cleanup_leftovers(self.run_prefix)
            self._created = False

    def __enter__(self) -> NamespaceSet:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
