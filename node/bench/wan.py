"""One end of a model exchange or state sync across a real network, for the WAN goodput bench.

    python -m geotrain.node.bench.wan serve    --key A.key --peer-key B.key --listen tcp://IP:PORT
    python -m geotrain.node.bench.wan exchange --key B.key --peer-key A.key --listen tcp://IP:0 \
        --dial tcp://IP:PORT --mb 400 --rtt-ms 150 --mbit 1000
    python -m geotrain.node.bench.wan sync ... (the same arguments)

The two ends are separate processes (the testbed's bench runs each in its own network namespace,
behind an emulated link: python -m geotrain.testbed.bench_goodput). Each holds a `wide-linear`
model of `--mb` MB of float32 and runs what a node runs: a secure transport, the adpsgd runtime
and state sync. `serve` answers until its stdin closes (it prints "ready" once listening).
`exchange` opens the session (one small request: the handshake), then times one pairwise
exchange (codec none: the model both ways, chunk by chunk, with its whole pipeline); `sync` times
one state sync of the server's model. Both print one JSON line: seconds, model bytes, and the
transport's statistics. The link table starts with the link's declared RTT and rate, as a node's
probes would have measured them, so deadlines and in-flight windows fit the link.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import trio

from geotrain.gossip import LinkTable, PartnerSelector

from .._allocator import tune_allocator
from .._config import GossipConfig
from .._peer_choice import PeerChoice
from .._protocol import node_header_codec
from .._state_sync import StateSync
from ..algorithms import AlgorithmContext, get_algorithm
from ..cli import configure_logging
from ..identity import Admission, Identity
from ..training import TaskContext, Trainer, resolve_task
from ..transport import Ping, Pong, TransportConfig, open_transport
from .exchange import CHUNK_NUMEL, _Addresses


def _trainer(mb: float, shard: int) -> Trainer:
    millions = mb / 4  # float32
    task = resolve_task("wide-linear")(TaskContext(shard_index=shard, num_shards=2,
                                                   params={"millions": millions}))  # fmt: skip
    return Trainer(task)


async def _run(args: argparse.Namespace) -> dict | None:
    me, other = Identity.load(args.key), Identity.load(args.peer_key)
    admission = Admission.open_swarm("wan-bench")
    gossip = GossipConfig(codec="none")
    config = TransportConfig(listen=args.listen, max_message_bytes=64 * 2**20,
                             connections_per_peer=args.connections)  # fmt: skip
    trainer = _trainer(args.mb, 0 if args.mode == "serve" else 1)
    links = LinkTable()
    now = trio.current_time()
    if args.rtt_ms:
        links.record_rtt(other.peer_id, args.rtt_ms / 1000, now)
    if args.mbit:
        links.record_transfer(other.peer_id, int(args.mbit * 1e6 / 8), 1.0, now)
    parts: dict = {}
    chunk_numel = int(args.chunk_mb * 2**20) // 4 if args.chunk_mb else CHUNK_NUMEL

    async def handler(peer, header, payload):
        if isinstance(header, Ping):
            return Pong(header.nonce), b""
        if isinstance(header, StateSync.handles):
            return await parts["sync"].handle(peer, header, payload)
        return await parts["algo"].handle(peer, header, payload)

    async with trio.open_nursery() as nursery:
        async with open_transport(config, me, admission, handler,
                                  codec=node_header_codec()) as transport:  # fmt: skip
            peers = _Addresses({other.peer_id: args.dial or "tcp://0.0.0.0:0"})
            rng = random.Random(0)
            shapes = [(name, tuple(t.shape)) for name, t in trainer.params().items()]
            choice = PeerChoice(gossip, peers, links,
                                PartnerSelector("uniform", me.peer_id, rng=rng), shapes,
                                lambda: 1.0)  # fmt: skip
            ctx = AlgorithmContext(
                trainer=trainer, gossip=gossip, settings=None, peers=choice, network=transport,
                rng=rng, start_soon=nursery.start_soon, chunk_numel=chunk_numel,
                max_chunk_numel=16 * 2**20,
            )  # fmt: skip
            parts["algo"] = algo = get_algorithm("adpsgd").runtime(ctx)
            parts["sync"] = sync = StateSync(trainer, algo, "adpsgd", transport, peers, links,
                                             rng, chunk_numel=chunk_numel,
                                             max_chunk_numel=16 * 2**20)  # fmt: skip
            if args.mode == "serve":
                print("ready", flush=True)
                await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
                result = None
            else:
                result = await _timed(args, transport, algo, sync, other.peer_id)
            nursery.cancel_scope.cancel()
    return result


async def _timed(args, transport, algo, sync, peer: str) -> dict:
    await transport.request(args.dial, Ping(0), b"", deadline_s=30.0, expect_peer=peer)
    before = transport.statistics()
    started = time.perf_counter()
    ok = await (algo.exchange_once() if args.mode == "exchange" else sync.fetch(trio.Event()))
    seconds = time.perf_counter() - started
    after = transport.statistics()
    return {
        "mode": args.mode, "ok": bool(ok), "seconds": seconds,
        "model_bytes": sum(4 * t.numel() for t in algo.ctx.trainer.params().values()),
        "bytes_out": after.bytes_out - before.bytes_out,
        "bytes_in": after.bytes_in - before.bytes_in,
        # connections this end dialled to the other (it is dialled by nobody)
        "connections": after.handshakes_ok - after.inbound_handshakes_ok,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serve", "exchange", "sync"))
    parser.add_argument("--key", required=True, help="this end's identity key file")
    parser.add_argument("--peer-key", required=True, help="the other end's identity key file")
    parser.add_argument("--listen", required=True, help="tcp://IP:PORT to listen on")
    parser.add_argument("--dial", help="the server's tcp://IP:PORT (exchange, sync)")
    parser.add_argument("--mb", type=float, default=400.0, help="model size, MB of float32")
    parser.add_argument("--chunk-mb", type=float, default=0.0,
                        help="chunk size, MiB (0: network.chunk_mb's default, 8)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="the link's declared RTT")
    parser.add_argument("--mbit", type=float, default=0.0, help="the link's declared rate")
    parser.add_argument("--connections", type=int, default=TransportConfig.connections_per_peer,
                        help="connections this end dials to the other, at most")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if args.mode != "serve" and not args.dial:
        parser.error(f"{args.mode}: --dial is required")
    if args.mb <= 0:
        parser.error(f"--mb: {args.mb}, expected > 0")
    configure_logging(args.log_level, "console")  # an entry point: keep stdout for the result
    tune_allocator()  # as a node does at start
    result = trio.run(_run, args)
    if result is not None:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
