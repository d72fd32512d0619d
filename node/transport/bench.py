# Secure-transport goodput benchmark: `python -m geotrain.node.transport.bench [--json]`.
# Invariants: the three paths (secure transport, raw pynng, plain TCP) run in the same process,
# over loopback, with the same message sizes and the same request/reply shape (payload one way, a
# few bytes back), and their round trips are interleaved, so that load from other processes hits
# all three alike and their ratios are comparable on a shared machine; nothing leaves 127.0.0.1.
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from ..cli import configure_logging
from ..identity import Admission, Identity
from ._messages import Ping, Pong
from ._transport import (
    TransportConfig,
    open_raw_pynng_pair,
    open_transport,
)

MB = 10**6
DEFAULT_SIZES_MB = (1, 16, 64, 256)
RoundTrip = Callable[[bytes], Awaitable[None]]


@asynccontextmanager
async def open_secure_pair(max_bytes: int) -> AsyncIterator[RoundTrip]:
    """Two transports of this process (throwaway open swarm); yields `round_trip(payload)`."""
    config = TransportConfig(max_message_bytes=max_bytes, max_inbound_requests=8)
    admission = Admission.open_swarm("bench")

    async def handler(peer, header, body):
        return Pong(header.nonce), b""

    async with open_transport(config, Identity.generate(), admission, handler) as server:
        async with open_transport(config, Identity.generate(), admission, handler) as client:
            await client.request(server.address, Ping(0), b"", deadline_s=30)  # handshake

            async def round_trip(payload: bytes) -> None:
                await client.request(server.address, Ping(1), payload, deadline_s=600)

            yield round_trip


@asynccontextmanager
async def open_tcp_pair(max_bytes: int) -> AsyncIterator[RoundTrip]:
    """A plain TCP connection over loopback: 8-byte length, payload, 2 bytes back."""
    listener, client = trio.socket.socket(), trio.socket.socket()
    with listener, client:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        await client.connect(listener.getsockname())
        server, _ = await listener.accept()
        buf = memoryview(bytearray(max_bytes))

        async def serve() -> None:
            while True:
                size, got = int.from_bytes(await server.recv(8, trio.socket.MSG_WAITALL), "big"), 0
                while got < size:
                    got += await server.recv_into(buf[got:size])
                await server.send(b"ok")

        async def round_trip(payload: bytes) -> None:
            view, sent = memoryview(payload), 0
            await client.send(len(view).to_bytes(8, "big"))
            while sent < len(view):
                sent += await client.send(view[sent:])
            await client.recv(2, trio.socket.MSG_WAITALL)

        with server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                yield round_trip
                nursery.cancel_scope.cancel()


PATHS = {"secure": open_secure_pair, "pynng": open_raw_pynng_pair, "tcp": open_tcp_pair}


async def measure(size: int, repeats: int) -> dict[str, float]:
    """Median seconds per round trip for each path, the paths taking turns."""
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    async with AsyncExitStack() as stack:
        trips = {p: await stack.enter_async_context(o(size)) for p, o in PATHS.items()}
        for trip in trips.values():  # warm up: first-touch page faults, lazy setup
            await trip(payload)
        for _ in range(repeats):
            for path, trip in trips.items():
                started = time.perf_counter()
                await trip(payload)
                times[path].append(time.perf_counter() - started)
    return {path: statistics.median(t) for path, t in times.items()}


async def run(sizes_mb: tuple[int, ...], repeats: int) -> list[dict]:
    rows = []
    for size_mb in sizes_mb:
        size = size_mb * MB
        for path, seconds in (await measure(size, repeats)).items():
            gbps = size * 8 / seconds / 1e9
            rows.append({"path": path, "msg_bytes": size, "gbps": round(gbps, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m geotrain.node.transport.bench",
        description="Goodput of the secure transport vs raw pynng vs plain TCP over loopback.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=list(DEFAULT_SIZES_MB))
    parser.add_argument("--repeats", type=int, default=7, help="round trips per cell (median)")
    args = parser.parse_args(argv)
    configure_logging("warning", "json")  # an entry point: keep stdout for the results
    rows = trio.run(run, tuple(args.sizes_mb), args.repeats)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    pynng_rate = {r["msg_bytes"]: r["gbps"] for r in rows if r["path"] == "pynng"}
    print(f"{'path':8} {'MB':>6} {'Gbit/s':>8} {'x pynng':>8}")
    for r in rows:
        ratio = r["gbps"] / pynng_rate[r["msg_bytes"]]
        print(f"{r['path']:8} {r['msg_bytes'] / MB:6.0f} {r['gbps']:8.3f} {ratio:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
