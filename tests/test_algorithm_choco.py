"""choco's runtime on the in-memory network, on a virtual clock: both ends' estimates stay equal,
a lost reply is found out and both ends resync, rejection, timeout, restart from state."""

from __future__ import annotations

import json

import pytest
import torch
import trio
from _runtimes import model, poison, runtimes, same

from geotrain.node.algorithms._stream import (
    CHUNKS_IN_FLIGHT,
    encode_chunk,
    model_chunk,
    slow_start_s,
)
from geotrain.node.algorithms.choco import ChocoExchange, ChocoReply, ChocoSettings
from geotrain.node.transport import ErrorReply, PeerInfo

CHOCO = {
    "algorithm": "choco",
    "codec": "topk:0.1",
    "algorithm_settings": {"choco": ChocoSettings(gamma=0.5)},
}


def exchange(algo, **fields) -> ChocoExchange:
    """Chunk 0 of an exchange with `algo`, cut as `algo` cuts its model."""
    plan = algo.plan(algo.ctx.chunk_numel)
    base = {"codec": "topk:0.1", "seq": 0, "base": algo.base_digest, "xid": 1,
            "plan": plan.digest, "chunk_numel": plan.chunk_numel, "chunks": len(plan)}  # fmt: skip
    return ChocoExchange(**{**base, **fields})


def equal_links(x, y) -> bool:
    return same(x.mine, y.theirs) and same(x.theirs, y.mine) and x.seq == y.seq


async def test_links_stay_equal_a_lost_reply_resyncs_both_ends_and_state_survives(autojump_clock):
    torch.manual_seed(0)
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        for _ in range(3):
            a.ctx.trainer.train_step()
            b.ctx.trainer.train_step()
            await a._exchange("p1")
            await b._exchange("p0")
        assert a.links["p1"].seq == b.links["p0"].seq == 6
        assert equal_links(a.links["p1"], b.links["p0"])
        assert a.counters.statistics().ok == 6  # three started, three answered
        # b applies an exchange whose reply never reaches a: the counts now differ ...
        net.lose_next_reply("p0", "p1")
        await a._exchange("p1")
        assert (a.links["p1"].seq, b.links["p0"].seq) == (6, 7)
        assert a.counters.statistics().failed == 1
        # ... the next exchange finds out, and both ends restart the link from the initial model
        await a._exchange("p1")
        assert a.resyncs == b.resyncs == 1
        assert a.links["p1"].seq == b.links["p0"].seq == 0
        await a._exchange("p1")
        assert a.links["p1"].seq == b.links["p0"].seq == 1
        assert equal_links(a.links["p1"], b.links["p0"])
        tensors, meta = a.state()
        b_link = b.links["p0"]
    # a checkpoint round trip keeps the link's count and estimates
    async with runtimes(2, **CHOCO) as (net, (restored, _)):
        restored.load_state(tensors, json.loads(json.dumps(meta)))
        assert restored.links["p1"].seq == 1 and equal_links(restored.links["p1"], b_link)


@pytest.mark.parametrize("chunk_numel", [None, 8])  # one chunk; or 5 chunks of 33 parameters
async def test_one_exchange_is_a_consensus_step_of_gamma(autojump_clock, chunk_numel):
    # With a lossless codec the estimates become the models themselves after one exchange, so
    # each side moves exactly gamma/2 of the way to the other: x_a += gamma/2 (x_b - x_a).
    exact = {**CHOCO, "codec": "none", "max_norm_ratio": 100.0}
    async with runtimes(2, chunk_numel=chunk_numel, **exact) as (net, (a, b)):
        for _ in range(5):
            a.ctx.trainer.train_step()
        xa, xb = model(a), model(b)
        assert set(xa) == set(xb) and xa
        await a._exchange("p1")
        for k in xa:
            torch.testing.assert_close(model(a)[k], xa[k] + 0.25 * (xb[k] - xa[k]))
            torch.testing.assert_close(model(b)[k], xb[k] + 0.25 * (xa[k] - xb[k]))


async def test_a_busy_link_declines_and_a_reply_of_the_wrong_count_is_not_used(autojump_clock):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        b._link("p0").busy = True
        before = model(b)
        header = exchange(b)
        reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), header,
                                  memoryview(b""))  # fmt: skip
        assert isinstance(reply, ErrorReply) and reply.code == "busy" and same(model(b), before)
        b._link("p0").busy = False

        async def miscounted(address, header, payload, *, deadline_s, expect_peer):
            return ChocoReply(seq=header.seq + 5), bytearray(payload), None

        a.ctx.network.request = miscounted
        before = model(a)
        await a._exchange("p1")
        assert same(model(a), before) and a.counters.statistics().failed == 1


async def test_a_poisoned_difference_is_rejected_and_changes_nothing(autojump_clock):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        poison(b)
        before = model(a)
        await a._exchange("p1")
        assert same(model(a), before)
        assert a.counters.statistics().rejected == 1


async def test_a_partner_that_never_answers_costs_one_deadline(autojump_clock):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        net.cut("p0", "p1")
        before = model(a)
        started = trio.current_time()
        nbytes = a.ctx.peers.payload_nbytes("topk:0.1")  # (the model is one chunk; ~its size)
        # a chunk's deadline: the link's for a window of chunks (the stream has one; the
        # deadline allows for CHUNKS_IN_FLIGHT) and a fresh connection's slow start (no tensor
        # work measured on a virtual clock); the whole stream's: the link's for all of its bytes
        # both ways, which comes first
        chunk = a.chunk_timer.deadline(a.ctx.peers, "p1", nbytes, started, chunks=1)
        assert a.chunk_timer.width(a.ctx.peers, "p1", nbytes, started, chunks=1) == 1
        rtt = a.ctx.peers.links.estimate("p1", started).rtt_s
        window = 2 * nbytes * CHUNKS_IN_FLIGHT
        link = a.ctx.peers.exchange_deadline("p1", window, started)
        assert chunk == pytest.approx(link + slow_start_s(rtt, window))
        whole = a.ctx.peers.exchange_deadline("p1", 2 * nbytes, started)
        assert whole < chunk
        await a._exchange("p1")
        assert trio.current_time() - started == pytest.approx(whole)
        assert same(model(a), before) and a.counters.statistics().failed == 1
        assert a.links["p1"].seq == 0 and not a.links["p1"].busy


async def test_an_exchange_whose_tensor_work_outlasts_the_links_deadline_still_completes(
    autojump_clock,
):
    # a big model on busy cores: each chunk's tensor work takes longer than the link alone
    # would allow the whole exchange (under load in CI, every 100M choco exchange ended in
    # TooSlowError): the deadlines grow with the work measured, the first one's included
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        net.set_delay("p0", "p1", 1.5)  # a 3 s round trip stands in for the partner's work
        ticks = iter(range(10**6))
        a.ctx.clock = lambda: 0.75 * next(ticks)  # our own work: 0.75 s each time it is timed
        link_only = a.ctx.peers.exchange_deadline(
            "p1", 2 * a.ctx.peers.payload_nbytes("topk:0.1"), trio.current_time())  # fmt: skip
        assert link_only < 3.0
        await a._exchange("p1")
        stats = a.counters.statistics()
        assert stats.ok == 1 and stats.failed == 0 and a.links["p1"].seq == 1


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (ChocoExchange(codec="topk:0.5", seq=0, base=0), "refused"),
    ],
)
async def test_a_bad_request_is_refused_and_changes_nothing(autojump_clock, header, why):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        before = model(b)
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        reply, _ = await b.handle(peer, header, memoryview(b""))
        assert isinstance(reply, ErrorReply) and reply.code == "bad_request" and why in reply.reason
        assert same(model(b), before)


async def test_peers_of_different_initial_models_mix_from_zero_estimates(autojump_clock):
    """Two loops of one's own, each model built without a common seed: choco refused to ever
    mix them (warned). Their link now starts at zero on both ends, agreed through one resync,
    the estimates stay equal, the models come together, and a checkpoint keeps the link's
    start."""
    from structlog.testing import capture_logs

    from geotrain.node.algorithms.choco import ChocoResync

    exact = {**CHOCO, "codec": "none", "max_norm_ratio": 100.0}
    with capture_logs() as logs:
        async with runtimes(2, init_seeds=[None, 1], **exact) as (net, (a, b)):
            assert a.base_digest != b.base_digest
            xa, xb = model(a), model(b)
            distance = _distance(xa, xb)
            assert distance > 0.1
            await a._exchange("p1")  # refused with a resync: both links now start at zero
            assert a.links["p1"].zero and b.links["p0"].zero and a.resyncs == b.resyncs == 1
            assert same(model(a), xa) and same(model(b), xb)
            assert a.links["p1"].seq == b.links["p0"].seq == 0
            for _ in range(6):
                await a._exchange("p1")
                await b._exchange("p0")
            assert a.links["p1"].seq == b.links["p0"].seq == 12 and a.resyncs == 1
            assert equal_links(a.links["p1"], b.links["p0"])
            assert _distance(model(a), model(b)) < 0.5 * distance
            tensors, meta = a.state()
        async with runtimes(2, init_seeds=[None, 1], **exact) as (net, (restored, _)):
            restored.load_state(tensors, json.loads(json.dumps(meta)))
            assert restored.links["p1"].zero and restored.links["p1"].seq == 12
    said = [e for e in logs if e["event"] == "choco_initial_models_differ"]
    assert len(said) == 1 and "start at zero" in said[0]["why"]
    # a peer whose link starts at zero on our side but that shares our initial model agrees on
    # the common start again (one that restarted without its checkpoint)
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        b._link("p0").zero = True
        reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), exchange(b),
                                  memoryview(b""))  # fmt: skip
        assert isinstance(reply, ChocoResync) and not reply.zero and not b.links["p0"].zero


def _distance(x: dict, y: dict) -> float:
    return sum(float((x[k] - y[k]).pow(2).sum()) for k in x) ** 0.5


async def test_a_stream_broken_half_way_restarts_the_link_on_both_ends(autojump_clock):
    # chunks change the estimates as they come: an exchange cut after some of them leaves both
    # models as they were (no consensus step) and the next exchange restarts the link, after
    # which the two ends' copies agree again
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=8, **CHOCO) as (net, (a, b)):  # 5 chunks
        for _ in range(2):
            a.ctx.trainer.train_step()
            await a._exchange("p1")
        assert equal_links(a.links["p1"], b.links["p0"]) and a.links["p1"].seq == 2
        a.ctx.trainer.train_step()
        before_a, before_b = model(a), model(b)
        # chunks 0-3 arrive at 0.05 s (their answers at once), chunk 4 is on the way at 0.07 s
        net.set_delay("p0", "p1", 0.05, both_ways=False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a._exchange, "p1")
            await trio.sleep(0.07)
            net.cut("p0", "p1")
        assert same(model(a), before_a) and same(model(b), before_b)
        assert a.counters.statistics().failed == 1
        assert a.links["p1"].seq == 0  # a restarted its side at once
        assert b.links["p0"].stream is not None  # b holds the unfinished exchange ...
        net.heal("p0", "p1")
        net.set_delay("p0", "p1", 0.0, both_ways=False)
        await a._exchange("p1")  # ... until a's next one: b restarts too and says so
        assert b.links["p0"].stream is None and b.links["p0"].seq == 0 and b.resyncs == 1
        await a._exchange("p1")
        assert a.links["p1"].seq == b.links["p0"].seq == 1
        assert equal_links(a.links["p1"], b.links["p0"])


async def test_a_lost_connection_frees_the_link_of_an_unfinished_exchange(autojump_clock):
    async with runtimes(2, chunk_numel=8, **CHOCO) as (net, (a, b)):
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        reply, _ = await b.handle(peer, exchange(b, xid=7), memoryview(b""))
        assert isinstance(reply, ErrorReply)  # (an empty payload is no chunk) ...
        assert b.links["p0"].stream is None and not b.links["p0"].busy  # ... and changes nothing
        plan = b.plan(8)
        q = {k: torch.zeros_like(v) for k, v in b.ctx.trainer.params().items()}
        chunk = encode_chunk(model_chunk(q, plan, 0), "topk:0.1")
        reply, _ = await b.handle(peer, exchange(b, xid=7), memoryview(chunk))
        assert isinstance(reply, ChocoReply) and b.links["p0"].busy  # 1 of 5 chunks in
        resyncs = b.resyncs
        b.peer_disconnected("p0")
        await trio.sleep(1)  # (the restart runs in a worker)
        assert b.links["p0"].stream is None and not b.links["p0"].busy
        assert b.links["p0"].seq == 0 and b.resyncs == resyncs + 1


def test_the_initial_models_digest_takes_a_scalar_parameter():
    """A model with a 0-dim parameter (a learned temperature) crashed choco at join."""
    from geotrain.node.algorithms.choco import model_digest

    a = {"t": torch.tensor(0.5), "w": torch.ones(2, 2)}
    assert model_digest(a) == model_digest({k: v.clone() for k, v in a.items()})
    assert model_digest(a) != model_digest({**a, "t": torch.tensor(0.25)})


async def test_a_checkpoint_waits_for_the_exchange_in_flight_and_keeps_its_link(autojump_clock):
    """Each chunk of a choco exchange reads the live model, which a 10^8 checkpoint holds for
    seconds, and a checkpoint left out a link an exchange was half-way through (a restart then
    resynced it from its start). The checkpoint lets the exchange end and takes no new one."""
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=8, **CHOCO) as (net, (a, b)):  # 5 chunks
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a._exchange, "p1")
            await trio.sleep(0.06)
            assert b.links["p0"].stream is not None  # b answers a's exchange ...
            async with b.quiet(30.0):  # ... and its checkpoint waits for it to end
                assert b.links["p0"].stream is None and b.links["p0"].seq == 1
                tensors, meta = b.state()
                assert meta["seq"] == {"p0": 1} and any(k.startswith("p0/") for k in tensors)
                reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"),
                                          exchange(b, seq=1, xid=99), memoryview(b""))
                assert isinstance(reply, ErrorReply) and reply.code == "busy"
                assert "writing a checkpoint" in reply.reason  # no new one meanwhile ...
                b.pacer.due = lambda step: True  # (an exchange of b's own is due)
                await b.after_step(b.ctx.trainer.train_step())
                assert not b._running  # ... either way
        assert a.counters.statistics().ok == 1 and a.counters.statistics().failed == 0
        assert a.counters.statistics().last_s == pytest.approx(0.2)  # two round trips: timed
        assert equal_links(a.links["p1"], b.links["p0"])
        await a._exchange("p1")  # after it: as before
        assert a.links["p1"].seq == b.links["p0"].seq == 2 and a.counters.statistics().ok == 2


async def test_a_checkpoint_waits_for_a_slow_stream_but_not_for_one_its_neighbour_left(
    autojump_clock,
):
    peer = PeerInfo("p0", b"", "mem://p0", "inbound")
    async with runtimes(2, chunk_numel=8, **CHOCO) as (net, (a, b)):
        plan = b.plan(8)
        q = {k: torch.zeros_like(v) for k, v in b.ctx.trainer.params().items()}

        def chunk(i: int) -> memoryview:
            return memoryview(encode_chunk(model_chunk(q, plan, i), "topk:0.1"))

        reply, _ = await b.handle(peer, exchange(b, xid=7), chunk(0))
        assert isinstance(reply, ChocoReply) and b.links["p0"].stream is not None
        await trio.sleep(150)  # a slow link: the stream began 150 s ago, its last chunk now
        reply, _ = await b.handle(peer, exchange(b, xid=7, index=1), chunk(1))
        assert isinstance(reply, ChocoReply)
        await trio.sleep(10)
        started = trio.current_time()
        async with b.quiet(30.0):  # a stream silent for 10 s is still awaited (to 30 s) ...
            assert trio.current_time() - started == pytest.approx(30.0, abs=0.1)
            # ... and the link is neither restarted nor a new exchange taken meanwhile
            reply, _ = await b.handle(peer, exchange(b, xid=8), chunk(0))
            assert isinstance(reply, ErrorReply) and reply.reason == "writing a checkpoint"
            assert b.links["p0"].stream[0] == 7 and b.resyncs == 0
        await trio.sleep(200)
        started = trio.current_time()
        async with b.quiet(30.0):  # ... one silent past STALE_STREAM_S is not
            assert trio.current_time() - started < 0.1
