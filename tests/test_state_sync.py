"""State sync on the in-memory network, on a virtual clock: a joiner fetches a model in chunks, and
a server that goes away or sends garbage mid-stream leaves the joiner's model as it was."""

from __future__ import annotations

import random

import pytest
import torch
import trio
from _runtimes import same, trainer

from geotrain.gossip import LinkTable
from geotrain.node._protocol import StateReply, StateRequest
from geotrain.node._state_sync import StateSync
from geotrain.node.algorithms import ChunkPlan, inline
from geotrain.node.testing import StaticMembership, open_memory_network
from geotrain.node.transport import ErrorReply, PeerInfo


class Replaced:
    """Stands in for the algorithm: counts `model_replaced` calls."""

    def __init__(self) -> None:
        self.calls = 0

    def model_replaced(self) -> None:
        self.calls += 1


def sync(t, net, me: str, peers, chunk_numel: int = 8) -> tuple[StateSync, Replaced]:
    algo = Replaced()
    transport = net.add(me, _unset)
    s = StateSync(t, algo, "adpsgd", transport, StaticMembership(list(peers)), LinkTable(),
                  random.Random(0), chunk_numel=chunk_numel, max_chunk_numel=1000,
                  to_thread=inline)  # fmt: skip
    net.set_handler(me, s.handle)
    return s, algo


async def _unset(peer, header, payload):
    raise RuntimeError("no handler yet")


async def test_a_joiner_fetches_the_model_in_chunks(autojump_clock):
    server, joiner = trainer(0, 2), trainer(1, 2)
    for _ in range(5):
        server.train_step()
    async with open_memory_network() as net:
        sync(server, net, "server", ["joiner"])
        s, algo = sync(joiner, net, "joiner", ["server"])
        assert await s.fetch(trio.Event())
        assert same(joiner.snapshot(), server.snapshot()) and algo.calls == 1
        assert net.bytes_sent[("joiner", "server")] > 0  # five chunk requests went out


async def test_a_server_gone_mid_stream_leaves_the_joiner_as_it_was(autojump_clock):
    server, joiner = trainer(0, 2), trainer(1, 2)
    server.train_step()
    before = joiner.snapshot()
    async with open_memory_network() as net:
        net.set_delay("joiner", "server", 0.1)
        sync(server, net, "server", ["joiner"])
        s, algo = sync(joiner, net, "joiner", ["server"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.fetch, trio.Event())
            await trio.sleep(0.25)  # chunk 0 is in, chunks 1-4 on their way
            net.remove("server")
        assert same(joiner.snapshot(), before) and algo.calls == 0


@pytest.mark.parametrize("lie", ["nonfinite", "wrong chunk", "other plan"])
async def test_a_server_that_lies_is_refused_and_the_joiner_keeps_its_model(autojump_clock, lie):
    joiner = trainer(1, 2)
    before = joiner.snapshot()
    liar = trainer(0, 2)
    liar.update(lambda live: [t.fill_(float("nan")) for t in live.values()] if lie == "nonfinite"
                else None)  # fmt: skip
    plan = ChunkPlan.for_model(liar.params(), 32)

    async def lying(peer, header, payload):
        index = 0 if lie == "wrong chunk" else header.index  # always sends chunk 0
        from geotrain.node.algorithms import encode_chunk, read_chunk

        data = encode_chunk(read_chunk(liar, plan, index), "none")
        chunks = len(plan) + (1 if lie == "other plan" else 0)
        return StateReply(step=3, chunks=chunks), data

    async with open_memory_network() as net:
        net.add("liar", lying)
        s, algo = sync(joiner, net, "joiner", ["liar"])
        with trio.move_on_after(10):
            await s.fetch(trio.Event())
        assert same(joiner.snapshot(), before) and algo.calls == 0


async def test_a_request_for_another_algorithm_or_plan_is_refused(autojump_clock):
    server = trainer(0, 2)
    async with open_memory_network() as net:
        s, _ = sync(server, net, "server", [])
        plan = ChunkPlan.for_model(server.params(), 32)
        peer = PeerInfo("x", b"", "mem://x", "inbound")
        for request, why in [
            (StateRequest(algorithm="choco", plan=plan.digest, chunk_numel=8, index=0), "runs"),
            (StateRequest(algorithm="adpsgd", plan=123, chunk_numel=8, index=0), "differ"),
            (StateRequest(algorithm="adpsgd", plan=plan.digest, chunk_numel=8, index=99), "99"),
            (StateRequest(algorithm="adpsgd", plan=plan.digest, chunk_numel=10**9, index=0),
             "chunks of"),
        ]:
            reply, data = await s.handle(peer, request, memoryview(b""))
            assert isinstance(reply, ErrorReply) and why in reply.reason and data == b""
        torch.testing.assert_close(server.snapshot(), server.snapshot())
