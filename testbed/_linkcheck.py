# Measures what an emulated link really delivers: round-trip time and bulk TCP throughput between
# two peer namespaces, for summary.json's `measured_rtt_ms` / `measured_mbit`. Invariants: both
# ends run as separate processes inside their namespaces (`ip netns exec`), started from this file
# by path so they import only the standard library (fast to start, whatever the testbed package
# imports); a transfer is bounded (its byte count is fixed before it starts); every wait has a
# timeout; nothing is sent to an address outside the namespaces.
from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._linkspec import AccessLink
    from ._namespaces import NamespaceSet

PORT = 0  # the server takes a free port and says which: a fixed one could still be held (see serve)
# A measured link further than this from its spec is flagged in summary.json and the HTML report:
# the run's figures are then of the link the emulator gave, not the scenario's
SPEC_TOLERANCE = 0.10
RTT_SLACK_MS = 1.0  # ... RTTs within this of the spec always pass (a 0 ms spec measures ~0.1 ms)
CHUNK = 1 << 20
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LinkMeasurement:
    """What one check of a link measured.

    Attributes:
        measured_rtt_ms: median round trip of 1-byte ping-pongs over one TCP connection.
        connect_rtt_ms: median TCP connect time (SYN to SYN-ACK), one round trip too.
        measured_mbit: receiver-side goodput of the bulk transfer, Mbit/s (10**6 bit/s), over its
            last two thirds (TCP's start-up is not the link's doing), as a least-squares slope.
        bulk_bytes: size of that transfer.
    """

    measured_rtt_ms: float
    connect_rtt_ms: float
    measured_mbit: float
    bulk_bytes: int


def off_spec(link: dict) -> list[str]:
    """What a checked link (an entry of run.json's `links`: spec_* and measured_* fields) misses
    its spec by more than SPEC_TOLERANCE, said in words; [] when it holds it or was not
    measured. A rate is missed either way (an unshaped spec has none to miss)."""
    out = []
    spec_rtt, rtt = link.get("spec_rtt_ms"), link.get("measured_rtt_ms")
    if isinstance(spec_rtt, int | float) and isinstance(rtt, int | float):
        if abs(rtt - spec_rtt) > max(SPEC_TOLERANCE * spec_rtt, RTT_SLACK_MS):
            out.append(f"RTT {rtt:g} ms, spec {spec_rtt:g} ({_off(rtt, spec_rtt)})")
    spec_mbit, mbit = link.get("spec_mbit"), link.get("measured_mbit")
    if isinstance(spec_mbit, int | float) and spec_mbit > 0 and isinstance(mbit, int | float):
        if abs(mbit - spec_mbit) > SPEC_TOLERANCE * spec_mbit:
            out.append(f"{mbit:g} Mbit/s, spec {spec_mbit:g} ({_off(mbit, spec_mbit)})")
    return out


def _off(measured: float, spec: float) -> str:
    return f"{(measured - spec) / spec:+.0%}" if spec else f"{measured - spec:+g}"


def bulk_bytes_for(rate_mbit: float | None, seconds: float = 2.0, rtt_ms: float = 0.0) -> int:
    """A transfer size that takes about `seconds` at `rate_mbit` (unshaped: 256 MiB).

    On a long link the transfer is stretched to at least 15 round trips of `rtt_ms`, so TCP's
    start-up (a few round trips) stays a small part of it.
    """
    if rate_mbit is None:
        return 256 << 20
    seconds = max(seconds, 15 * rtt_ms / 1000)
    return max(1 << 20, int(rate_mbit * 1e6 / 8 * seconds))


def _serve_bulk(conn: socket.socket) -> None:
    """Receive a bulk transfer; report goodput over its last two thirds.

    The first third is left out (like iperf's --omit) so that TCP's start-up (slow start, BBR's
    startup, receive-window growth) is not charged to the link. The rate is the least-squares
    slope of bytes received over time, not two end points: after a loss, TCP hands the
    application a burst of held-back data at once, and a single such burst at an end point would
    skew a two-point rate by up to a queue's worth of bytes.
    """
    (total,) = struct.unpack("!Q", _recv_exact(conn, 8))
    buf = bytearray(CHUNK)
    got = 0
    samples: list[tuple[float, int]] = []
    while got < total:
        n = conn.recv_into(buf, min(CHUNK, total - got))
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {total} bytes")
        got += n
        if got >= total // 3:
            samples.append((time.perf_counter(), got))
    report = {"bytes_per_s": _slope(samples), "samples": len(samples)}
    conn.sendall(json.dumps(report).encode() + b"\n")


def _slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of bytes over seconds (0.0 with fewer than two distinct times)."""
    n = len(samples)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    cov = sum((t - mean_t) * (b - mean_b) for t, b in samples)
    return cov / var if var > 0 else 0.0


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def serve(host: str, port: int, connections: int) -> None:
    """Answer `connections` probe connections, then exit. Prints "ready PORT" once listening.

    Port 0 takes a free port. A fixed one (47000 once) lies inside Linux's ephemeral range, so an
    earlier check's client connection from this namespace could still hold it (TIME_WAIT, without
    SO_REUSEADDR) and the bind failed with EADDRINUSE (seen once in CI).

    A connection starts with one byte: b"p" = echo every byte back until the peer closes;
    b"b" = bulk: an 8-byte length, that many bytes in, then a JSON line with the receiver's timing;
    b"c" = connect-time probe, closed at once.
    """
    with socket.create_server((host, port), backlog=16) as listener:
        listener.settimeout(TIMEOUT_S)
        print(f"ready {listener.getsockname()[1]}", flush=True)
        for _ in range(connections):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                mode = conn.recv(1)
                if mode == b"p":
                    while data := conn.recv(4096):
                        conn.sendall(data)
                elif mode == b"b":
                    _serve_bulk(conn)


def _use_cubic(conn: socket.socket) -> None:
    """Send with CUBIC, Linux's default, where the kernel has it. Some hosts default to BBR,
    whose start-up takes its bandwidth estimate from delivery times: on the userspace emulator a
    busy box delays some deliveries, BBR can settle on a fraction of the link and then climbs
    back only 25% every 8 round trips. On a 790 Mbit/s, 134 ms link on this 2-core box, 64 MiB
    transfers: BBR measured 119-789 Mbit/s, CUBIC 772-789 (96 MiB: 789 in 5 of 5)."""
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    except (OSError, AttributeError):
        pass  # a kernel without cubic: its default it is


def probe(host: str, port: int, pings: int, bulk: int) -> dict[str, float]:
    """The client side: connect-time probes, ping-pongs, then a bulk transfer of `bulk` bytes."""
    connects = []
    for _ in range(pings):
        start = time.perf_counter()
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
            connects.append(time.perf_counter() - start)
            conn.sendall(b"c")
    rtts = []
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"p")
        for _ in range(pings + 1):
            start = time.perf_counter()
            conn.sendall(b"x")
            _recv_exact(conn, 1)
            rtts.append(time.perf_counter() - start)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        _use_cubic(conn)
        conn.sendall(b"b" + struct.pack("!Q", bulk))
        block = memoryview(bytes(CHUNK))
        sent = 0
        while sent < bulk:
            n = min(CHUNK, bulk - sent)
            conn.sendall(block[:n])
            sent += n
        result = json.loads(conn.makefile("rb").readline())
    return {
        "rtt_ms": statistics.median(rtts[1:]) * 1000,  # the first ping may wait for a delayed ACK
        "connect_ms": statistics.median(connects) * 1000,
        "mbit": result["bytes_per_s"] * 8 / 1e6,
        "bytes": bulk,
    }


def _last_line(stderr: str) -> str:
    """The error a worker died of (the last line of its traceback)."""
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else "no error output"


def _worker_argv(*args: object) -> list[str]:
    return [sys.executable, "-P", __file__, *map(str, args)]


def measure_link(
    namespaces: NamespaceSet,
    src: int,
    dst: int,
    *,
    bulk_bytes: int,
    pings: int = 7,
    port: int = PORT,
) -> LinkMeasurement:
    """Measure the link from peer `src` to peer `dst` (throughput src -> dst; RTT both ways).

    Args:
        namespaces: the peers' namespaces, with links already emulated between them.
        src: index of the sending peer.
        dst: index of the receiving peer (runs the server).
        bulk_bytes: size of the bulk transfer; see `bulk_bytes_for`.
        pings: number of connect probes and of ping-pongs (medians are reported).
        port: TCP port of the server inside `dst`'s namespace (0: a free one).

    Raises:
        RuntimeError: a side failed; the message names the side and its error.
    """
    connections = pings + 2
    server = namespaces.popen(
        dst,
        _worker_argv("serve", namespaces[dst].address, port, connections),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = server.stdout.readline().split() if server.stdout is not None else []
        if len(ready) != 2 or ready[0] != "ready":
            raise RuntimeError(f"link check server failed: {_last_line(server.communicate()[1])}")
        port = int(ready[1])
        client = namespaces.run(
            src,
            _worker_argv("probe", namespaces[dst].address, port, pings, bulk_bytes),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * 2,
        )
        if client.returncode != 0:
            raise RuntimeError(f"link check client failed: {_last_line(client.stderr)}")
        result = json.loads(client.stdout)
        server.wait(timeout=TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        for stream in (server.stdout, server.stderr):
            if stream is not None:
                stream.close()
    return LinkMeasurement(result["rtt_ms"], result["connect_ms"], result["mbit"], bulk_bytes)


def _bench(peers: int, delay_ms: float, rate_mbit: float | None, jitter_ms: float,
           loss: float, access: AccessLink | None = None) -> dict:  # fmt: skip
    """`peers` namespaces behind the userspace emulator, peers/2 flows at once (2i -> 2i+1):
    spec vs measured per flow, the loss the emulator applied, then unshaped headroom (1 flow).
    With `access` (an AccessLink) every peer also sits behind that access link, and the spec is
    the end-to-end path (its delays added up, the lowest rate on the way)."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from ._linkspec import LinkMatrix, LinkSpec
    from ._namespaces import NamespaceSet
    from ._userspace import UserspaceLinks

    matrix = LinkMatrix.uniform(peers, LinkSpec(delay_ms=delay_ms, jitter_ms=jitter_ms, loss=loss,
                                                rate_mbit=rate_mbit))  # fmt: skip
    if access is not None:
        matrix = replace(matrix, access=(access,) * peers)
    spec = matrix.path_spec(0, 1)
    out: dict = {"peers": peers, "spec": spec.to_json(), "spec_rtt_ms": 2 * spec.delay_ms}
    size = bulk_bytes_for(spec.rate_mbit, rtt_ms=2 * spec.delay_ms)
    t0 = time.perf_counter()
    with NamespaceSet(peers) as nss:
        with UserspaceLinks(nss, matrix) as links:
            out["setup_s"] = time.perf_counter() - t0
            with ThreadPoolExecutor(peers // 2) as pool:
                flows = list(
                    pool.map(
                        lambda i: measure_link(nss, 2 * i, 2 * i + 1, bulk_bytes=size),
                        range(peers // 2),
                    )
                )
            stats = links.statistics()
        out["flows"] = [m.__dict__ for m in flows]
        sent = sum(s.packets + s.lost + s.overflowed for s in stats.links)
        out["applied_loss"] = sum(s.lost for s in stats.links) / max(1, sent)
        out["queue_drops"] = sum(s.overflowed for s in stats.links) + stats.access_overflowed
        with UserspaceLinks(nss, LinkMatrix.uniform(peers, LinkSpec())):
            out["unshaped"] = measure_link(nss, 0, 1, bulk_bytes=bulk_bytes_for(None)).__dict__
        t1 = time.perf_counter()
    out["teardown_s"] = time.perf_counter() - t1
    return out


def _bench_line(r: dict) -> str:
    """One human-readable line of a bench result."""
    rtts = sorted(f["measured_rtt_ms"] for f in r["flows"])
    mbits = sorted(f["measured_mbit"] for f in r["flows"])
    spec = r["spec"]
    rate = "unshaped" if spec["rate_mbit"] is None else f"{spec['rate_mbit']:g} Mbit/s"
    ratio = (
        "" if spec["rate_mbit"] is None else f" (x{mbits[len(mbits) // 2] / spec['rate_mbit']:.3f})"
    )
    return (
        f"{r['peers']} peers, {len(rtts)} flows at once; spec RTT {r['spec_rtt_ms']:g} ms, {rate}, "
        f"loss {spec['loss']:g}: RTT median {rtts[len(rtts) // 2]:.2f} ms "
        f"(min {rtts[0]:.2f}, max {rtts[-1]:.2f}), goodput median {mbits[len(mbits) // 2]:.1f}"
        f"{ratio} (min {mbits[0]:.1f}, max {mbits[-1]:.1f}) Mbit/s, applied loss "
        f"{r['applied_loss']:.4f}, queue drops {r['queue_drops']}; unshaped "
        f"{r['unshaped']['measured_mbit'] / 1000:.2f} Gbit/s; setup {r['setup_s']:.1f} s, "
        f"teardown {r['teardown_s']:.1f} s"
    )


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="geotrain link check (testbed internals)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("connections", type=int)
    p = sub.add_parser("probe")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("pings", type=int)
    p.add_argument("bulk", type=int)
    p = sub.add_parser("bench", help="spec vs measured on two namespaces (root, /dev/net/tun)")
    p.add_argument("--delay-ms", type=float, default=25.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="0 = unshaped")
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--peers", type=int, default=2, help="even; peers/2 flows run at once")
    p.add_argument("--up-mbit", type=float, help="every peer behind an access link: uplink")
    p.add_argument("--down-mbit", type=float, help="... its downlink")
    p.add_argument("--access-delay-ms", type=float, help="... and its one-way delay")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.host, args.port, args.connections)
    elif args.command == "probe":
        print(json.dumps(probe(args.host, args.port, args.pings, args.bulk)))
    else:
        from ._linkspec import AccessLink

        rate = args.rate_mbit or None
        wanted = (args.up_mbit, args.down_mbit, args.access_delay_ms)
        access = None if wanted == (None, None, None) else AccessLink(
            args.up_mbit, args.down_mbit, args.access_delay_ms or 0.0)  # fmt: skip
        result = _bench(args.peers, args.delay_ms, rate, args.jitter_ms, args.loss, access)
        print(json.dumps(result, indent=2) if args.json else _bench_line(result))
    return 0


if __name__ == "__main__":  # worker entry point; the user-facing command lives in the CLI
    sys.exit(_main(sys.argv[1:]))
