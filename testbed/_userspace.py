# Userspace WAN emulation for kernels without sch_netem. Invariants: every IPv4 packet a peer sends
# into its TUN device is either dropped (loss draw, queue overflow, unknown destination; each
# counted) or written to the destination peer's TUN device at
# max(serialized + delay ± jitter, previous delivery of that link), so one link never reorders;
# a link is a (source peer, destination region) pair with its own serialization clock and a
# bounded queue; a peer with an access link also has an uplink (all it sends, before the region
# link) and a downlink (all it receives, after it, served in order of arrival) of its own. The
# emulator runs in its own process (no GIL contention with the orchestrator) and exits when told
# to or when its control pipe closes (the parent died), which closes the TUN fds and so deletes
# the devices.
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ._linkspec import LinkMatrix, LinkSpec
from ._namespaces import NamespaceSet
from ._tun import TUN_MTU, attach_tun


@dataclass(frozen=True)
class UserspaceConfig:
    """Settings of the userspace emulator.

    Attributes:
        seed: seeds the loss and jitter draws, so a run's drop pattern is reproducible.
        queue_bdp_factor: a shaped link queues at most this many bandwidth-delay products (of the
            round trip, 2 x delay) before it drops, like a router buffer. 4, because BBR's startup
            keeps up to ~3 BDP in flight: with 2, a 25 ms / 100 Mbit/s link tail-dropped 50-70
            packets per 25 MB transfer and goodput varied 0.93-1.05x; with 4 none, and 0.999x.
        queue_min_bytes: floor of that buffer, so links with tiny delay still hold a few 64 KB
            packets (the TUN MTU makes packets large).
        mtu: MTU of the TUN devices; 65000 means ~45x fewer packets than 1500 for bulk TCP.
        realtime: run the emulator under SCHED_FIFO (priority 1) where allowed, so that busy peer
            processes do not delay its wake-ups: on a loaded 2-core box (load 7) this took a
            25 ms link's measured RTT from 52-53 ms to 50.4-50.6 ms. It sleeps in select() when
            idle and its CPU use follows the traffic the peers make.
        access_queue_s: an access link (a peer's own uplink or downlink) buffers this many
            seconds of its rate before it drops (at least queue_min_bytes), as a home router's
            deep buffer does. 1.0, because with 64 KB packets 0.25 s of a 20 Mbit/s uplink holds
            fewer packets than TCP's initial window (10): the burst at a flow's start overflowed
            it (6 drops) and a 1.5 MiB transfer measured 7.2 Mbit/s (0.5 s: 19.8-20.0 Mbit/s on
            a 40 ms path); and on a 212 ms path (a home uplink across the Pacific) 0.5 s is less
            than the startup overshoot: 27 drops, 13.7 and 18.0 Mbit/s; 1.0 s: 0 drops, 20.0.
    """

    seed: int = 0
    queue_bdp_factor: float = 4.0
    queue_min_bytes: int = 4 * 65536
    mtu: int = TUN_MTU
    realtime: bool = True
    access_queue_s: float = 1.0  # an access link buffers this many seconds at its rate

    def __post_init__(self) -> None:
        if self.queue_bdp_factor <= 0:
            raise ValueError(
                f"UserspaceConfig.queue_bdp_factor={self.queue_bdp_factor!r}: expected > 0"
            )
        if self.queue_min_bytes < self.mtu:
            raise ValueError(
                f"UserspaceConfig.queue_min_bytes={self.queue_min_bytes!r}: expected at least one "
                f"packet (mtu={self.mtu})"
            )
        if not 1280 <= self.mtu <= 65535:
            raise ValueError(f"UserspaceConfig.mtu={self.mtu!r}: expected 1280..65535")


class EgressLink:
    """Serialization clock, delay line and counters of one (source peer, dest. region) link."""

    __slots__ = (
        "spec",
        "free_at",
        "last_delivery",
        "limit",
        "_bps",
        "_delay",
        "_jitter",
        "packets",
        "bytes",
        "lost",
        "overflowed",
    )

    def __init__(self, spec: LinkSpec, config: UserspaceConfig) -> None:
        self.free_at = 0.0  # when the last admitted packet has fully left (shaped links)
        self.last_delivery = 0.0
        self.packets = self.bytes = self.lost = self.overflowed = 0
        self.set_spec(spec, config)

    def set_spec(self, spec: LinkSpec, config: UserspaceConfig) -> None:
        """Change the spec; packets already admitted keep their delivery time."""
        self.spec = spec
        self._bps = None if spec.rate_mbit is None else spec.rate_mbit * 1e6 / 8  # bytes/s
        self._delay = spec.delay_ms / 1000
        self._jitter = spec.jitter_ms / 1000
        bdp = 0.0 if self._bps is None else self._bps * 2 * self._delay
        self.limit = max(config.queue_min_bytes, config.queue_bdp_factor * bdp)

    def admit(self, size: int, now: float, rng: random.Random) -> float | None:
        """Delivery time of a packet of `size` bytes sent at `now`, or None if it is dropped."""
        if self.spec.loss and rng.random() < self.spec.loss:
            self.lost += 1
            return None
        sent = now
        if self._bps is not None:
            start = max(now, self.free_at)
            if round((start - now) * self._bps) + size > self.limit:  # bytes queued + this
                self.overflowed += 1
                return None
            self.free_at = sent = start + size / self._bps
        delay = self._delay
        if self._jitter:
            delay = max(0.0, delay + rng.uniform(-self._jitter, self._jitter))
        at = max(sent + delay, self.last_delivery)
        self.last_delivery = at
        self.packets += 1
        self.bytes += size
        return at


class AccessQueue:
    """Serialization clock and bounded queue of one peer's uplink or downlink."""

    __slots__ = ("bps", "delay", "free_at", "limit", "packets", "bytes", "overflowed")

    def __init__(self, rate_mbit: float | None, delay_ms: float, config: UserspaceConfig) -> None:
        self.bps = None if rate_mbit is None else rate_mbit * 1e6 / 8
        self.delay = delay_ms / 1000
        self.free_at = 0.0
        self.limit = max(config.queue_min_bytes, (self.bps or 0.0) * config.access_queue_s)
        self.packets = self.bytes = self.overflowed = 0

    def admit(self, size: int, now: float) -> float | None:
        """When a packet of `size` bytes entering at `now` has crossed, or None (dropped)."""
        sent = now
        if self.bps is not None:
            start = max(now, self.free_at)
            if round((start - now) * self.bps) + size > self.limit:
                self.overflowed += 1
                return None
            self.free_at = sent = start + size / self.bps
        self.packets += 1
        self.bytes += size
        return sent + self.delay


@dataclass(frozen=True)
class LinkStatistics:
    """Counters of one link: packets/bytes admitted for delivery, drops by cause."""

    src_peer: int
    dst_region: str
    packets: int
    bytes: int
    lost: int
    overflowed: int


@dataclass(frozen=True)
class EmulatorStatistics:
    """Counters of the whole emulator.

    `unroutable` counts packets to no known peer (or not IPv4); `write_errors` counts deliveries
    the destination device refused.
    """

    links: tuple[LinkStatistics, ...]
    unroutable: int
    write_errors: int
    access_overflowed: int = 0  # packets dropped by a full access link (uplink or downlink)

    @classmethod
    def from_json(cls, data: dict) -> EmulatorStatistics:
        links = tuple(LinkStatistics(**link) for link in data["links"])
        return cls(links, data["unroutable"], data["write_errors"],
                   data.get("access_overflowed", 0))  # fmt: skip


class PacketScheduler:
    """The emulator's decisions, free of I/O: packets in with a time, (peer, packet) out when due.

    Args:
        addresses: IPv4 address of each peer, as 4 raw bytes, indexed by peer.
        matrix: link specs and each peer's region.
        config: queue and seed settings.
    """

    def __init__(self, addresses: Sequence[bytes], matrix: LinkMatrix, config: UserspaceConfig):
        if len(addresses) != matrix.n_peers:
            raise ValueError(f"{len(addresses)} addresses for {matrix.n_peers} peers")
        self.config = config
        self._rng = random.Random(config.seed)
        self._peer_by_address = {a: i for i, a in enumerate(addresses)}
        self._region_index = {r: i for i, r in enumerate(matrix.regions)}
        self._peer_region = [self._region_index[r] for r in matrix.peer_regions]
        self._links = [
            [EgressLink(matrix.spec(src, dst), config) for dst in matrix.regions]
            for src in matrix.peer_regions
        ]
        self._up: list[AccessQueue | None] = [None] * matrix.n_peers
        self._down: list[AccessQueue | None] = [None] * matrix.n_peers
        self._set_access(matrix)
        self._matrix = matrix
        # (time, seq, stage, destination peer, packet): stage 1 reaches the destination's
        # downlink at `time`, stage 0 is delivered then
        self._heap: list[tuple[float, int, int, int, bytes]] = []
        self._seq = 0
        self.unroutable = 0
        self.write_errors = 0

    def set_matrix(self, matrix: LinkMatrix) -> None:
        """Apply new link specs at run time (same regions and peer placement)."""
        if (
            matrix.regions != self._matrix.regions
            or matrix.peer_regions != self._matrix.peer_regions
        ):
            raise ValueError("set_matrix: regions and peer placement cannot change at run time")
        for src, src_region in enumerate(matrix.peer_regions):
            for j, dst_region in enumerate(matrix.regions):
                self._links[src][j].set_spec(matrix.spec(src_region, dst_region), self.config)
        self._set_access(matrix)
        self._matrix = matrix

    def _set_access(self, matrix: LinkMatrix) -> None:
        """Each peer's uplink and downlink queues per its access link; a queue whose rate and
        delay stay the same keeps its clock (packets in it keep their times)."""
        for peer in range(matrix.n_peers):
            access = matrix.access_of(peer)
            for queues, rate in ((self._up, access and access.up_mbit),
                                 (self._down, access and access.down_mbit)):  # fmt: skip
                delay = access.delay_ms if access else 0.0
                old = queues[peer]
                new = None if access is None else AccessQueue(rate, delay, self.config)
                if old is not None and new is not None and (old.bps, old.delay) == (
                        new.bps, new.delay):  # fmt: skip
                    continue
                if old is not None and new is not None:
                    new.free_at = old.free_at
                queues[peer] = new

    def send(self, src: int, packet: bytes, now: float) -> None:
        """Peer `src` sent `packet` (a raw IP packet) at `now`."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self.unroutable += 1
            return
        dst = self._peer_by_address.get(packet[16:20])
        if dst is None:
            self.unroutable += 1
            return
        up = self._up[src]
        if up is not None:
            now = up.admit(len(packet), now)  # (when it has left the sender's access link)
            if now is None:
                return
        at = self._links[src][self._peer_region[dst]].admit(len(packet), now, self._rng)
        if at is not None:
            self._seq += 1
            stage = 0 if self._down[dst] is None else 1
            heapq.heappush(self._heap, (at, self._seq, stage, dst, packet))

    def next_due(self) -> float | None:
        """Time of the earliest pending delivery, or None when nothing is in flight."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[int, bytes]]:
        """(destination peer, packet) of every delivery due at or before `now`, in time order."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, seq, stage, dst, packet = heapq.heappop(heap)
            if stage == 0:
                out.append((dst, packet))
                continue
            down = self._down[dst]  # it reached the receiver's downlink at `at`: in order of
            done = at if down is None else down.admit(len(packet), at)  # arrival, its queue
            if done is not None:
                heapq.heappush(heap, (done, seq, 0, dst, packet))
        return out

    def write_failed(self, dst: int) -> None:
        """Writing a packet into peer `dst`'s device failed."""
        self.write_errors += 1

    def statistics(self) -> EmulatorStatistics:
        links = tuple(
            LinkStatistics(src, region, link.packets, link.bytes, link.lost, link.overflowed)
            for src, row in enumerate(self._links)
            for region, link in zip(self._matrix.regions, row, strict=True)
        )
        overflowed = sum(q.overflowed for q in (*self._up, *self._down) if q is not None)
        return EmulatorStatistics(links, self.unroutable, self.write_errors, overflowed)


# Starts the emulator process with this package's modules but without running the package's
# __init__ (which may pull in torch and others: seconds of start-up and hundreds of MB per run).
BOOTSTRAP = """
import sys, types
package = types.ModuleType("testbed")
package.__path__ = [sys.argv[1]]
sys.modules["testbed"] = package
from testbed._userspace import _serve
sys.exit(_serve(sys.stdin.fileno(), sys.stdout.fileno()))
"""


class EmulatorError(RuntimeError):
    """The emulator process failed to start or stopped answering; the message says how."""


class UserspaceLinks:
    """Emulated links between the namespaces of a NamespaceSet, run by a separate process.

    Use as a context manager inside the NamespaceSet's `with` block. Entering creates one TUN
    device per namespace and starts the emulator process, which owns the devices' fds; leaving
    stops it, which removes the devices. If this process dies, the emulator sees its control pipe
    close and exits too.

    Attributes:
        matrix: the link specs in effect.
        realtime: whether the emulator process runs under SCHED_FIFO.

    Args:
        namespaces: the peers' namespaces (already created).
        matrix: link specs; `matrix.n_peers` must equal the number of namespaces.
        config: emulator settings.
    """

    def __init__(
        self, namespaces: NamespaceSet, matrix: LinkMatrix, config: UserspaceConfig | None = None
    ) -> None:
        if matrix.n_peers != len(namespaces):
            raise ValueError(f"matrix has {matrix.n_peers} peers for {len(namespaces)} namespaces")
        self._namespaces = namespaces
        self._config = config or UserspaceConfig()
        self.matrix = matrix
        self._proc: subprocess.Popen | None = None
        self.realtime = False  # whether the emulator got SCHED_FIFO (see UserspaceConfig)

    def start(self) -> None:
        """Create the TUN devices and start the emulator process."""
        fds: list[int] = []
        try:
            for ns in self._namespaces:
                fds.append(attach_tun(ns, mtu=self._config.mtu))
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-c", BOOTSTRAP, os.path.dirname(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=fds,
            )
        finally:
            for fd in fds:  # the emulator holds its own copies now; the devices live with it
                os.close(fd)
        ready = self._request(
            {
                "fds": fds,
                "addresses": [str(ns.address) for ns in self._namespaces],
                "matrix": self.matrix.to_json(),
                "config": dataclasses.asdict(self._config),
            }
        )
        self.realtime = bool(ready["realtime"])

    def _request(self, message: dict) -> dict:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise EmulatorError("the emulator is not running")
        try:
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError as exc:
            raise EmulatorError(f"the emulator exited (status {proc.poll()})") from exc
        if not line:
            raise EmulatorError(f"the emulator exited (status {proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise EmulatorError(
                f"the emulator refused {message.get('op', 'start')}: {reply['error']}"
            )
        return reply

    def set_matrix(self, matrix: LinkMatrix) -> None:
        """Change link specs at run time; in effect for every packet sent after this returns."""
        self._request({"op": "set_matrix", "matrix": matrix.to_json()})
        self.matrix = matrix

    def statistics(self) -> EmulatorStatistics:
        """Packet counters of every link so far."""
        return EmulatorStatistics.from_json(self._request({"op": "statistics"}))

    def close(self) -> None:
        """Stop the emulator (its devices disappear with it). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):  # ValueError: pipe already closed
            proc.stdin.write(b'{"op": "stop"}\n')  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]

    def __enter__(self) -> UserspaceLinks:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _serve(stdin: int, stdout: int) -> int:
    """The emulator process: read the setup line, then pump packets until stopped."""
    import ipaddress
    import signal

    from ._tun import pump_packets

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle
    setup = b""
    while not setup.endswith(b"\n"):
        chunk = os.read(stdin, 65536)
        if not chunk:
            return 1
        setup += chunk
    message = json.loads(setup)
    scheduler = PacketScheduler(
        [ipaddress.IPv4Address(a).packed for a in message["addresses"]],
        LinkMatrix.from_json(message["matrix"]),
        UserspaceConfig(**message["config"]),
    )

    def reply(data: dict) -> None:
        os.write(stdout, json.dumps(data).encode() + b"\n")

    def on_control(line: bytes) -> bool:
        command = json.loads(line)
        op = command.get("op")
        if op == "stop":
            return False
        try:
            if op == "set_matrix":
                scheduler.set_matrix(LinkMatrix.from_json(command["matrix"]))
                reply({"ok": True})
            elif op == "statistics":
                stats = scheduler.statistics()
                reply({**stats.__dict__, "links": [s.__dict__ for s in stats.links]})
            else:
                reply({"error": f"unknown op {op!r}"})
        except (ValueError, KeyError, TypeError) as exc:
            reply({"error": str(exc)})
        return True

    realtime = False
    if scheduler.config.realtime:
        with contextlib.suppress(OSError):  # not permitted: run at normal priority
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            realtime = True
    reply({"ready": True, "realtime": realtime})
    pump_packets(message["fds"], scheduler, stdin, on_control)
    return 0
