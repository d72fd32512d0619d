"""Goodput of a streamed model exchange against raw pynng moving the same bytes.

    python -m geotrain.node.bench.exchange [--millions 100] [--codec none] [--repeats 3] [--json]
    python -m geotrain.node.bench.exchange --state-sync [--donors 3] [--millions 100] [--json]

In one process, over loopback: two nodes' adpsgd runtimes, each on its own secure transport,
average a `wide-linear` model (`--millions` parameters) with codec `--codec`; each exchange moves
the model both ways in chunks (the initiator's chunk i in a request, the responder's in the
reply), with the whole pipeline: read, encode, encrypt, send, decrypt, decode, check, mix. The
baseline, measured in the same run and taking turns with the exchanges, is raw pynng (no
security, no tensors) moving the same bytes in the same shape: one request carrying a chunk's
bytes and a reply carrying as many back, four in flight, for as many chunks. The figure is the
exchange's goodput over the baseline's (goal >= 0.7).

With --state-sync: a joiner fetches the other node's whole model by state sync (as a node that
joins late does: chunk by chunk into a staging copy, then loaded), once; printed are its time,
the bytes moved, whether the joiner's model then equals the server's, and the process's resident
memory before and at its peak during the fetch (both nodes live in this process). With
`--donors 3`: three servers, their models apart by a small offset each, and a joiner with
gossip.robust set, which takes each value's median over the three (every chunk from each); it
then equals the middle server's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import time
from collections.abc import AsyncIterator

import torch
import trio

from geotrain.gossip import LinkTable, PartnerSelector

from .._allocator import tune_allocator
from .._config import GossipConfig
from .._memory import peak_rss_mb, reset_peak_rss, rss_mb
from .._peer_choice import PeerChoice
from .._protocol import node_header_codec
from .._state_sync import StateSync
from ..algorithms import AlgorithmContext, get_algorithm
from ..cli import configure_logging
from ..identity import Admission, Identity
from ..testing import StaticMembership
from ..training import TaskContext, Trainer, resolve_task
from ..transport import TransportConfig, open_raw_pynng_exchange, open_transport

CHUNK_NUMEL = 2 * 2**20  # network.chunk_mb = 8, the default


class _Addresses(StaticMembership):
    def __init__(self, peers: dict[str, str]) -> None:
        super().__init__(list(peers))
        self._addresses = peers

    def address_of(self, peer_id: str) -> str | None:
        return self._addresses.get(peer_id)


def adpsgd_runtime(trainer: Trainer, gossip: GossipConfig, peer_id: str,
                   addresses: dict[str, str], transport, index: int,
                   start_soon) -> tuple[object, _Addresses, random.Random]:  # fmt: skip
    """The adpsgd runtime of bench node `index` on `transport`, exchanging with `addresses`
    (uniform partners, a fresh link table); with its membership and random source."""
    peers = _Addresses(addresses)
    rng = random.Random(index)
    shapes = [(name, tuple(t.shape)) for name, t in trainer.params().items()]
    choice = PeerChoice(
        gossip, peers, LinkTable(), PartnerSelector("uniform", peer_id, rng=rng),
        shapes, lambda: 1.0,
    )  # fmt: skip
    ctx = AlgorithmContext(
        trainer=trainer, gossip=gossip, settings=None, peers=choice, network=transport,
        rng=rng, start_soon=start_soon, chunk_numel=CHUNK_NUMEL, max_chunk_numel=16 * 2**20,
    )  # fmt: skip
    return get_algorithm("adpsgd").runtime(ctx), peers, rng


@contextlib.asynccontextmanager
async def secure_transports(ids: list[Identity], handler_for) -> AsyncIterator[list]:
    """A secure transport on loopback for each identity, of one open swarm, with messages of up
    to 64 MiB (parts of 4 MiB, as a node's); `handler_for(i)` answers node i's requests."""
    admission = Admission.open_swarm("bench")
    config = TransportConfig(max_message_bytes=64 * 2**20)
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_transport(
                config, ids[i], admission, handler_for(i), codec=node_header_codec()))
            for i in range(len(ids))
        ]  # fmt: skip


async def _exchanges(millions: float, codec: str, repeats: int, state_sync: bool = False,
                     donors: int = 1) -> dict:  # fmt: skip
    gossip = GossipConfig(codec=codec)
    n = donors + 1  # (nodes 0..donors-1 serve; the last one exchanges with node 0, or joins)
    ids = [Identity.generate() for _ in range(n)]
    trainers = [
        Trainer(resolve_task("wide-linear")(TaskContext(shard_index=i, num_shards=n,
                                                        params={"millions": millions})))
        for i in range(n)
    ]  # fmt: skip
    algos: list = [None] * n
    syncs: list = [None] * n

    def handler_for(i):
        async def handler(peer, header, payload):
            if isinstance(header, StateSync.handles):
                return await syncs[i].handle(peer, header, payload)
            return await algos[i].handle(peer, header, payload)

        return handler

    async with trio.open_nursery() as nursery, secure_transports(ids, handler_for) as transports:
        ta, tb = transports[0], transports[-1]
        for i in range(n):
            others = range(donors) if i == n - 1 else [n - 1]
            algos[i], peers, rng = adpsgd_runtime(
                trainers[i], gossip, ids[i].peer_id,
                {ids[o].peer_id: transports[o].address for o in others}, transports[i], i,
                nursery.start_soon,
            )  # fmt: skip
            syncs[i] = StateSync(trainers[i], algos[i], "adpsgd", transports[i], peers,
                                 LinkTable(), rng, chunk_numel=CHUNK_NUMEL,
                                 max_chunk_numel=16 * 2**20,
                                 untrusted=donors > 1)  # fmt: skip
        plan = algos[0].plan(CHUNK_NUMEL)
        if state_sync:
            out = {**await _state_sync(trainers, syncs[-1], tb), "chunks": len(plan)}
        else:
            out = await _timed_exchanges(algos[0], algos[-1], ta, len(plan), repeats)
        nursery.cancel_scope.cancel()
    return out


async def _exchange(algo, what: str) -> None:
    """One exchange of `algo` with its partner, started again while the partner declines it as
    busy (it may still be applying the last one when the next opens, on a loaded box); an
    exchange that fails or is rejected raises."""
    before = algo.counters.statistics()
    with trio.move_on_after(60):
        while not await algo.exchange_once():
            after = algo.counters.statistics()
            if (after.failed, after.rejected) != (before.failed, before.rejected):
                raise RuntimeError(f"{what} failed")
            await trio.sleep(0.05)
        return
    raise RuntimeError(f"{what}: the partner declined it for 60 s")


async def _applied(partner, exchanges: int) -> None:
    """Until `partner` has applied `exchanges` exchanges it answered (it mixes after its last
    reply: an exchange timed while it still applies the last one would wait on it)."""
    with trio.fail_after(120):
        while partner.counters.statistics().ok < exchanges:
            await trio.sleep(0.01)


async def _timed_exchanges(algo, partner, transport, chunks: int, repeats: int) -> dict:
    await _exchange(algo, "the warm-up exchange")  # (first touch of every buffer)
    times, moved = [], []
    for done in range(1, repeats + 1):
        await _applied(partner, done)
        before = transport.statistics()
        started = time.perf_counter()
        await _exchange(algo, "an exchange")
        times.append(time.perf_counter() - started)
        after = transport.statistics()
        moved.append(after.bytes_out - before.bytes_out + after.bytes_in - before.bytes_in)
    chunk_bytes = [moved[0] // 2 // chunks] * chunks
    return {"seconds": times, "bytes": moved, "chunks": chunks, "chunk_bytes": chunk_bytes}


async def _state_sync(trainers: list[Trainer], joiner: StateSync, transport) -> dict:
    """The joiner (the last trainer) fetches the model of the others (one, or the median of
    three) once, by state sync."""
    donors = trainers[:-1]
    with torch.no_grad():
        for k, donor in enumerate(donors):  # (apart: the median of three is the middle one)
            for t in donor.params().values():
                t.add_(0.01 * k)
    server, mine = donors[len(donors) // 2].params(), trainers[-1].params()
    with torch.no_grad():
        for t in mine.values():  # (so that equality below means the fetch brought it)
            t.zero_()
    before_mb = rss_mb() or 0.0
    reset = reset_peak_rss()
    stats = transport.statistics()
    started = time.perf_counter()
    fetched = await joiner.fetch(trio.Event())
    seconds = time.perf_counter() - started
    after = transport.statistics()
    equal = all(bool((server[n] == mine[n]).all()) for n in server)
    return {
        "fetched": fetched, "equal": equal, "seconds": seconds,
        "bytes": after.bytes_in - stats.bytes_in + after.bytes_out - stats.bytes_out,
        "rss_before_mb": before_mb, "peak_mb": peak_rss_mb(), "peak_reset": reset,
    }  # fmt: skip


async def _raw(chunk_bytes: list[int], repeats: int) -> list[float]:
    """Raw pynng moving the same bytes: a chunk out and a chunk back per request, 4 in flight."""
    payload = bytes(max(chunk_bytes))
    out = []
    async with open_raw_pynng_exchange(len(payload) + 64, in_flight=4) as exchange:
        for _ in range(repeats):
            started = time.perf_counter()
            limit = trio.Semaphore(4)

            async def one(size: int, limit: trio.Semaphore = limit) -> None:
                async with limit:
                    await exchange(payload[:size], size)

            async with trio.open_nursery() as nursery:
                for size in chunk_bytes:
                    nursery.start_soon(one, size)
            out.append(time.perf_counter() - started)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=100.0)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--state-sync", action="store_true",
                        help="measure one state sync of the whole model instead")
    parser.add_argument("--donors", type=int, choices=(1, 3), default=1,
                        help="with --state-sync: 3 fetches each value's median over three "
                        "servers (gossip.robust set)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("warning", "console")  # an entry point: keep stdout for the results
    tune_allocator()  # as a node does at start
    if args.state_sync:
        _print_state_sync(args)
        return
    ex = trio.run(_exchanges, args.millions, args.codec, args.repeats)
    raw = trio.run(_raw, ex["chunk_bytes"], args.repeats)
    ex_s, raw_s = statistics.median(ex["seconds"]), statistics.median(raw)
    nbytes = statistics.median(ex["bytes"])
    result = {
        "millions": args.millions, "codec": args.codec, "chunks": ex["chunks"],
        "bytes_per_exchange": nbytes, "exchange_s": ex["seconds"], "raw_pynng_s": raw,
        "exchange_gbps": nbytes * 8 / ex_s / 1e9, "raw_gbps": nbytes * 8 / raw_s / 1e9,
        "ratio": raw_s / ex_s,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    width = round(math.sqrt(args.millions * 1e6))
    print(f"model {width}x{width} float32 ({width * width * 4 / 1e6:.0f} MB), codec {args.codec}, "
          f"{ex['chunks']} chunks, {nbytes / 1e6:.0f} MB on the wire per exchange (both ways)")
    print(f"exchange: {ex_s:.2f} s median of {[round(t, 2) for t in ex['seconds']]} = "
          f"{result['exchange_gbps']:.2f} Gbit/s")
    print(f"raw pynng, same bytes: {raw_s:.2f} s = {result['raw_gbps']:.2f} Gbit/s")
    print(f"exchange / raw pynng goodput: {result['ratio']:.2f} (goal >= 0.7)")


def _print_state_sync(args) -> None:
    r = trio.run(_exchanges, args.millions, "none", 0, True, args.donors)
    model_mb = 4 * round(math.sqrt(args.millions * 1e6)) ** 2 / 1e6
    r = {"millions": args.millions, "model_mb": model_mb, "donors": args.donors, **r,
         "gbps": r["bytes"] * 8 / r["seconds"] / 1e9}  # fmt: skip
    if args.json:
        print(json.dumps(r))
        return
    print(f"model {model_mb:.0f} MB in {r['chunks']} chunks: state sync "
          f"{'done' if r['fetched'] else 'FAILED'} in {r['seconds']:.2f} s, "
          f"{r['bytes'] / 1e6:.0f} MB moved ({r['gbps']:.2f} Gbit/s); joiner's model equals the "
          + ("server's" if args.donors == 1 else f"median of {args.donors} servers'")
          + f": {r['equal']}")
    peak = "peak" if r["peak_reset"] else "peak since start (high-water mark not reset)"
    extra = (r["peak_mb"] - r["rss_before_mb"]) / model_mb
    print(f"resident memory of all {args.donors + 1} nodes: {r['rss_before_mb']:.0f} MB before, "
          f"{peak} {r['peak_mb']:.0f} MB during the fetch: +{extra:.2f} model copies")


if __name__ == "__main__":
    main()
