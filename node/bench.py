# Secure-transport goodput benchmark: `python -m node.bench [--json]`. Invariants: the three paths
# (secure transport, raw pynng, plain TCP) run in the same process, over loopback, with the same
# message sizes and the same request/reply shape (payload one way, a few bytes back), so their
# ratios are comparable on a shared machine; nothing leaves 127.0.0.1.
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import trio

from ._admission import Admission
from ._identity import Identity
from ._logging import configure_logging
from ._messages import Ping, Pong
from ._transport import TransportConfig, open_transport, raw_pynng_round_trips

MB = 10**6
DEFAULT_SIZES_MB = (1, 16, 64, 256)


async def _secure_round_trips(payload: bytes, repeats: int) -> list[float]:
    config = TransportConfig(max_message_bytes=len(payload) + 1024, max_inbound_requests=2)
    admission = Admission.open_swarm("bench")  # throwaway: both ends are this process

    async def handler(peer, header, body):
        return Pong(header.nonce), b""

    times = []
    async with open_transport(config, Identity.generate(), admission, handler) as server:
        async with open_transport(config, Identity.generate(), admission, handler) as client:
            await client.request(server.address, Ping(0), b"", deadline_s=30)  # handshake
            for i in range(repeats):
                started = time.perf_counter()
                await client.request(server.address, Ping(i), payload, deadline_s=600)
                times.append(time.perf_counter() - started)
    return times


async def _tcp_round_trips(payload: bytes, repeats: int) -> list[float]:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket()
    times = []
    with listener, client:
        await client.connect(listener.getsockname())
        server, _ = await listener.accept()
        with server:
            buf = memoryview(bytearray(len(payload)))

            async def serve() -> None:
                while True:
                    header = await server.recv(8, trio.socket.MSG_WAITALL)
                    size, got = int.from_bytes(header, "big"), 0
                    while got < size:
                        got += await server.recv_into(buf[got:size])
                    await server.send(b"ok")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                view = memoryview(payload)
                for _ in range(repeats):
                    started = time.perf_counter()
                    await client.send(len(payload).to_bytes(8, "big"))
                    sent = 0
                    while sent < len(view):
                        sent += await client.send(view[sent:])
                    await client.recv(2, trio.socket.MSG_WAITALL)
                    times.append(time.perf_counter() - started)
                nursery.cancel_scope.cancel()
    return times


PATHS = {"secure": _secure_round_trips, "pynng": raw_pynng_round_trips, "tcp": _tcp_round_trips}


async def run(sizes_mb: tuple[int, ...], repeats: int) -> list[dict]:
    """Median goodput per (path, size); paths interleaved per size so load drifts hit all."""
    rows = []
    for size in sizes_mb:
        payload = bytes(range(256)) * (size * MB // 256) + bytes(size * MB % 256)
        for path, measure in PATHS.items():
            seconds = statistics.median(await measure(payload, repeats))
            gbps = len(payload) * 8 / seconds / 1e9
            rows.append({"path": path, "msg_bytes": len(payload), "gbps": round(gbps, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=list(DEFAULT_SIZES_MB))
    parser.add_argument("--repeats", type=int, default=5, help="round trips per cell (median)")
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
