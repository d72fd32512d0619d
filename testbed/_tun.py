# TUN devices that connect each peer namespace to the userspace link emulator. Invariants: a
# device is created in the root namespace (ioctl TUNSETIFF on /dev/net/tun, IFF_TUN | IFF_NO_PI, so
# every read is exactly one IP packet), carries its namespace's name, and is then moved into that
# namespace; the device lives as long as its file descriptor, so closing the fd removes it.
from __future__ import annotations

import fcntl
import os
import select
import struct
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ._namespaces import NETWORK, Namespace, run_ip

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TUN_MTU = 65000  # large packets: fewer of them, so less Python work per byte in the emulator


def tun_available() -> tuple[bool, str]:
    """Whether /dev/net/tun can be opened here, and why not if it cannot."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError as exc:
        return False, f"/dev/net/tun: {exc.strerror}"
    os.close(fd)
    return True, "/dev/net/tun opens"


def open_tun(name: str) -> int:
    """Create TUN device `name` in the current (root) namespace; return its non-blocking fd.

    The caller owns the fd; closing it deletes the device.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


def attach_tun(ns: Namespace, *, mtu: int = TUN_MTU) -> int:
    """Create a TUN device for `ns`, move it into the namespace and configure it.

    Inside the namespace the device gets the peer's address with prefix /15 (so the route for all
    of 198.18.0.0/15 goes through it), the given MTU, IPv6 off (no stray router solicitations),
    reverse-path filtering off and TCP buffers large enough for long fast links.

    Returns:
        The fd the emulator reads this peer's outgoing packets from and writes its incoming ones to.
    """
    fd = open_tun(ns.name)
    try:
        run_ip(["link", "set", ns.name, "netns", ns.name])
        batch = (
            f"link set {ns.name} mtu {mtu}\n"
            f"addr add {ns.address}/{NETWORK.prefixlen} dev {ns.name}\n"
            f"link set {ns.name} up\n"
        )
        sysctls = [
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            f"net.ipv4.conf.{ns.name}.rp_filter=0",
            # a new namespace starts with the kernel's small default socket buffers (4 MiB send):
            # too small for the bandwidth-delay product of a fast long link (1 Gbit/s x 50 ms)
            "net.ipv4.tcp_rmem=4096 131072 33554432",
            "net.ipv4.tcp_wmem=4096 16384 33554432",
        ]
        run_ip(["netns", "exec", ns.name, "sysctl", "-q", "-w", *sysctls])
        run_ip(["-n", ns.name, "-batch", "-"], input=batch)
    except BaseException:
        os.close(fd)
        raise
    return fd


class PacketSink(Protocol):
    """What `pump_packets` feeds: the userspace emulator's scheduler."""

    def send(self, src: int, packet: bytes, now: float) -> None: ...
    def next_due(self) -> float | None: ...
    def pop_due(self, now: float) -> list[tuple[int, bytes]]: ...
    def write_failed(self, dst: int) -> None: ...


# epoll_wait's timeout is in whole milliseconds; select() on the epoll fd waits with microsecond
# precision, so deliveries are on time to the kernel's timer slack (~50 us) plus wake-up latency.
EARLY_S = 0.00005
READ_BATCH = 64  # packets read from one fd per wake-up, so one busy peer cannot starve the others


def pump_packets(
    fds: Sequence[int],
    sink: PacketSink,
    control_fd: int,
    on_control: Callable[[bytes], bool],
) -> None:
    """Move packets between TUN fds through `sink` until told to stop.

    Reads every packet peer i writes into its device from `fds[i]`, hands it to `sink.send`, and
    writes each packet `sink.pop_due` returns into its destination's fd. `control_fd` carries
    newline-terminated commands; each is passed to `on_control`, which returns False to stop.
    End of file on `control_fd` (the owner died) also stops. A write the destination device
    refuses is reported to `sink.write_failed`.
    """
    peer_of = {fd: i for i, fd in enumerate(fds)}
    epoll = select.epoll()
    for fd in fds:
        epoll.register(fd, select.EPOLLIN)
    epoll.register(control_fd, select.EPOLLIN)
    pending = b""
    clock = time.monotonic
    with epoll:
        while True:
            due = sink.next_due()
            timeout = None if due is None else max(0.0, due - clock() - EARLY_S)
            select.select([epoll], [], [], timeout)
            for fd, _ in epoll.poll(0):
                if fd == control_fd:
                    data = os.read(control_fd, 65536)
                    if not data:
                        return
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if not on_control(line):
                            return
                    continue
                now = clock()
                src = peer_of[fd]
                for _ in range(READ_BATCH):
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:  # the device went away with its namespace
                        epoll.unregister(fd)
                        break
                    sink.send(src, packet, now)
            for dst, packet in sink.pop_due(clock() + EARLY_S):
                try:
                    os.write(fds[dst], packet)
                except OSError:
                    sink.write_failed(dst)
