"""dpsgd's runtime on the in-memory network, on a virtual clock: rounds, a straggler left out at
the deadline, late and poisoned replies, a responder that waits, restart from state."""

from __future__ import annotations

import json

import pytest
import torch
import trio
from _runtimes import averaged_where_sent, model, poison, runtimes, same, step

from geotrain.node.algorithms import decode_chunk
from geotrain.node.algorithms.dpsgd import ROUND_WAIT_CAP_S, RoundReply, RoundRequest
from geotrain.node.transport import ErrorReply, PeerInfo

DPSGD = {"algorithm": "dpsgd", "codec": "none", "exchange_every": 1}


def asking(algo, **fields) -> RoundRequest:
    """A request of `algo`'s round model, chunk 0, cut as `algo` cuts it."""
    plan = algo.plan(algo.ctx.chunk_numel)
    base = {"algorithm": "dpsgd", "codec": "none", "round": 1, "degree": 1, "plan": plan.digest,
            "chunk_numel": plan.chunk_numel}  # fmt: skip
    return RoundRequest(**{**base, **fields})


async def test_a_round_mixes_both_ways_and_a_responder_waits_for_the_round(autojump_clock):
    async with runtimes(2, **DPSGD) as (net, (a, b)):
        a.ctx.trainer.train_step()  # the two models differ
        a_model, b_model = model(a), model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.after_step, step(a, 1))  # a asks b for round 1 before b is there
            await trio.sleep(0.5)
            assert a.rounds == 0  # still waiting for b
            await b.after_step(step(b, 1))
        assert a.rounds == b.rounds == a.full_rounds == 1
        # degree 1 each: weight 1/2, both hold the average of the two round-1 models
        expected = {k: (a_model[k] + b_model[k]) / 2 for k in a_model}
        assert all(torch.allclose(model(a)[k], expected[k]) for k in expected)
        assert all(torch.allclose(model(b)[k], expected[k]) for k in expected)
        assert a.counters.statistics().peers["p1"].ok == 1


async def test_a_sparse_codec_averages_the_values_sent_and_leaves_the_others(autojump_clock):
    wide = {"task": "wide-linear", "params": {"millions": 0.1}}  # 100,489 parameters
    async with runtimes(2, **{**DPSGD, "codec": "topk:0.1"}, init_seeds=[1, 2],
                        **wide) as (net, (a, b)):  # fmt: skip
        a_model, b_model = model(a), model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.after_step, step(a, 1))
            await b.after_step(step(b, 1))
        assert a.full_rounds == b.full_rounds == 1
        assert 0.08 < averaged_where_sent(model(a), a_model, b_model) < 0.12
        assert 0.08 < averaged_where_sent(model(b), b_model, a_model) < 0.12


async def test_a_round_ends_at_its_deadline_without_a_peer_that_never_gets_there(autojump_clock):
    # p2 never reaches round 1 (a straggler): p0's round ends exactly at its deadline, mixed with
    # p1 alone, and p2 is skipped (not waited for) in the next rounds.
    async with runtimes(3, **DPSGD) as (net, (a, b, straggler)):
        b.ctx.trainer.train_step()
        before_straggler = model(straggler)
        nbytes = a.ctx.peers.payload_nbytes("none")
        now = trio.current_time()
        deadline = max(a.ctx.peers.round_deadline(p, nbytes, now) for p in ("p1", "p2"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 1))
            started = trio.current_time()
            await a.after_step(step(a, 1))
            waited = trio.current_time() - started
        assert waited == pytest.approx(deadline + 0.001)  # + round_slack x our 1 ms step
        stats = a.statistics()
        assert (stats.rounds, stats.full_rounds, stats.missed_neighbours) == (1, 0, 1)
        exchanges = a.counters.statistics()
        assert exchanges.peers["p1"].ok == 1 and exchanges.peers["p2"].failed == 1
        assert same(model(straggler), before_straggler)
        # round 2: p2 is skipped for 2 rounds after its first miss, so p0 does not wait for it
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 2))
            started = trio.current_time()
            await a.after_step(step(a, 2))
            assert trio.current_time() - started < deadline / 2
        assert a.statistics().full_rounds == 1


async def test_a_reply_for_an_older_round_is_never_mixed(autojump_clock):
    async with runtimes(2, **DPSGD) as (net, (a, b)):
        payload = a.ctx.encode(model(a), "none")

        async def stale(address, header, data, *, deadline_s, expect_peer):
            chunks = len(a.plan(a.ctx.chunk_numel))
            reply = RoundReply(round=header.round - 1, degree=1, chunks=chunks)
            return reply, bytearray(payload), None

        a.ctx.network.request = stale
        before = model(a)
        await a.after_step(step(a, 5))
        stats = a.statistics()
        assert stats.late_replies_ignored == 1 and stats.missed_neighbours == 1
        assert same(model(a), before)


async def test_a_neighbour_whose_model_is_not_finite_is_left_out_and_counted(autojump_clock):
    async with runtimes(2, **DPSGD) as (net, (a, b)):
        poison(b)
        before = model(a)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 1))
            await a.after_step(step(a, 1))
        assert same(model(a), before)
        stats = a.counters.statistics()
        assert stats.rejected == 1 and stats.failed == 0 and a.statistics().missed_neighbours == 1


async def test_a_responder_holds_a_request_only_as_long_as_its_asker_waits(autojump_clock):
    # A request for a round b has not reached ties up one of b's inbound workers: b lets it go
    # when the asker's deadline (wait_s) has passed, not after ROUND_WAIT_CAP_S, and notes a's
    # round (so a's next miss can be judged: is a catching up or a straggler?).
    async with runtimes(2, **DPSGD) as (net, (a, b)):
        asker = PeerInfo("p0", b"", "mem://p0", "inbound")
        request = asking(b, round=7, wait_s=0.3)
        started = trio.current_time()
        reply, _ = await b.handle(asker, request, memoryview(b""))
        assert isinstance(reply, ErrorReply) and reply.code == "busy"
        assert trio.current_time() - started == pytest.approx(0.3)
        assert b._attendance._heard["p0"][-1][1] == 7
        # and never longer than ROUND_WAIT_CAP_S, whatever the asker says
        greedy = asking(b, round=8, wait_s=3600)
        started = trio.current_time()
        await b.handle(asker, greedy, memoryview(b""))
        assert trio.current_time() - started == pytest.approx(ROUND_WAIT_CAP_S)


async def test_the_round_survives_a_restart_from_state(autojump_clock):
    async with runtimes(2, **DPSGD) as (net, (a, b)):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 3))
            await a.after_step(step(a, 3))
        tensors, meta = a.state()
    async with runtimes(2, **DPSGD) as (net, (fresh, _)):
        fresh.load_state(tensors, json.loads(json.dumps(meta)))
        assert fresh.round == 3


async def test_a_round_ends_at_its_deadline_when_a_neighbour_is_cut_off(autojump_clock):
    # the neighbour never even hears the request: only our own deadline ends the round
    async with runtimes(3, **DPSGD) as (net, (a, b, c)):
        net.cut("p0", "p2")
        nbytes = a.ctx.peers.payload_nbytes("none")
        now = trio.current_time()
        deadline = max(a.ctx.peers.round_deadline(p, nbytes, now) for p in ("p1", "p2"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 1))
            started = trio.current_time()
            await a.after_step(step(a, 1))
        assert trio.current_time() - started == pytest.approx(deadline + 0.001)
        assert a.counters.statistics().peers["p2"].failed == 1


async def test_a_responder_keeps_last_rounds_model_only_while_a_neighbour_fetches_it(
    autojump_clock,
):
    # one round's model is held between rounds (memory): the last one goes when the next is
    # snapshotted, unless a neighbour is half-way through fetching it; then it is served to the end
    async with runtimes(2, **{**DPSGD, "chunk_numel": 8}) as (net, (a, b)):  # 5 chunks
        b.ctx.peers.live_peers = lambda: ()  # b publishes its rounds without asking anyone
        await b.after_step(step(b, 1))
        round_1 = model(b)
        asker = PeerInfo("p0", b"", "mem://p0", "inbound")
        plan = b.plan(8)
        reply, first = await b.handle(asker, asking(b, round=1, wait_s=1.0), memoryview(b""))
        assert isinstance(reply, RoundReply) and reply.round == 1 and reply.chunks == 5
        b.ctx.trainer.train_step()
        await b.after_step(step(b, 2))  # p0 has chunk 0 of 5 of round 1: round 1 stays
        got = [first]
        for index in range(1, 5):
            reply, data = await b.handle(asker, asking(b, round=1, index=index), memoryview(b""))
            assert isinstance(reply, RoundReply) and reply.round == 1
            got.append(data)
        values = [t for i, d in enumerate(got) for t in decode_chunk(d, "none", plan, i,
                                                                     torch.device("cpu"))]
        expected = torch.cat([round_1[k].reshape(-1) for k in sorted(round_1)])
        assert torch.equal(torch.cat(values), expected)
        b.ctx.trainer.train_step()
        await b.after_step(step(b, 3))  # nobody is fetching round 2: it goes
        assert sorted(b._models) == [3]
        reply, _ = await b.handle(asker, asking(b, round=2, wait_s=1.0), memoryview(b""))
        assert isinstance(reply, RoundReply) and reply.round == 3  # the newer one it has
        reply, _ = await b.handle(asker, asking(b, round=2, index=1), memoryview(b""))
        assert isinstance(reply, ErrorReply) and "gone" in reply.reason
        wrong = asking(b, round=1, wait_s=1.0, algorithm="choco")
        reply, _ = await b.handle(asker, wrong, memoryview(b""))
        assert isinstance(reply, ErrorReply) and "runs dpsgd" in reply.reason


async def test_a_round_model_streams_in_chunks_and_a_broken_stream_is_left_out(autojump_clock):
    chunked = {**DPSGD, "chunk_numel": 8}  # 33 parameters: 5 chunks
    async with runtimes(2, **chunked) as (net, (a, b)):
        a.ctx.trainer.train_step()
        a_model, b_model = model(a), model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 1))
            await a.after_step(step(a, 1))
        expected = {k: (a_model[k] + b_model[k]) / 2 for k in a_model}
        assert all(torch.allclose(model(a)[k], expected[k]) for k in expected)
        assert a.statistics().full_rounds == 1 and len(a.plan(8)) == 5
        # round 2: b's model arrives in part only (the link dies after its first chunk)
        before = model(a)
        net.set_delay("p0", "p1", 0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.after_step, step(b, 2))
            nursery.start_soon(a.after_step, step(a, 2))
            await trio.sleep(0.12)
            net.cut("p0", "p1")
        assert same(model(a), before)  # nothing of b's partial model was mixed
        assert a.statistics().missed_neighbours == 1
