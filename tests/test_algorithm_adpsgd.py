"""adpsgd's runtime on the in-memory network, on a virtual clock: exchange, rejection, timeout,
busy, restart from state."""

from __future__ import annotations

import pytest
import torch
import trio
from _runtimes import model, poison, runtimes, same, settle, step

from geotrain.node.algorithms.adpsgd import MAX_RESPONSES, Exchange
from geotrain.node.transport import ErrorReply, PeerInfo


async def test_an_exchange_averages_both_models_in_one_round_trip(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()  # the two models differ
        before_a, before_b = model(a), model(b)
        started = trio.current_time()
        assert await a.exchange_once()
        assert trio.current_time() - started == pytest.approx(0.1)  # one round trip, no compute
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert all(torch.allclose(model(a)[k], mean[k]) for k in mean)
        assert all(torch.allclose(model(b)[k], mean[k]) for k in mean)
        for me, other in ((a, "p1"), (b, "p0")):
            stats = me.counters.statistics()
            assert (stats.ok, stats.failed, stats.rejected) == (1, 0, 0)
            assert stats.peers[other].codec == "none" and stats.peers[other].ok == 1


async def test_after_step_starts_one_exchange_every_exchange_every_steps(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none", exchange_every=4) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.2)
        for n in (1, 2, 3):
            await a.after_step(step(a, n))
            assert not a.busy()
        await a.after_step(step(a, 4))
        assert a.busy()
        await a.after_step(step(a, 8))  # still running: not a second one
        await settle()
        assert not a.busy() and a.counters.statistics().ok == 1


async def test_a_poisoned_reply_is_rejected_and_changes_nothing(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        poison(b)
        before = model(a)
        assert not await a.exchange_once()
        assert same(model(a), before)
        stats = a.counters.statistics()
        assert stats.rejected == 1 and stats.peers["p1"].rejected == 1 and stats.ok == 0


async def test_a_partner_that_never_answers_costs_one_deadline_and_is_backed_off(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        net.cut("p0", "p1")
        before = model(a)
        size = len(a._encode(a.ctx.trainer.snapshot(), "none"))
        deadline = a.ctx.peers.exchange_deadline("p1", size, trio.current_time())
        started = trio.current_time()
        assert not await a.exchange_once()
        assert trio.current_time() - started == pytest.approx(deadline)
        assert same(model(a), before) and a.counters.statistics().failed == 1
        # the next deadline to that peer is longer (backoff) and the peer rests a while
        assert a.ctx.peers.exchange_deadline("p1", size, trio.current_time()) > deadline
        assert not a.ctx.peers.selector._available("p1", trio.current_time())


async def test_a_busy_responder_declines_without_mixing(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        b._responding = MAX_RESPONSES  # already answering as many as it will
        before = model(b)
        reply, _ = await b.handle(
            PeerInfo("p0", b"", "mem://p0", "inbound"),
            Exchange(algorithm="adpsgd", codec="none", step=1),
            memoryview(a.ctx.encode(model(a), "none")),
        )
        assert isinstance(reply, ErrorReply) and reply.code == "busy"
        assert same(model(b), before)
        assert not await a.exchange_once()  # the initiator: declined, not failed
        assert a.counters.statistics().failed == 0


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (Exchange(algorithm="choco", codec="none", step=0), "runs adpsgd"),
        (Exchange(algorithm="adpsgd", codec="topk:0.5", step=0), "refused"),
        (Exchange(algorithm="adpsgd", codec="none", step=0), "rejected"),  # junk payload
    ],
)
async def test_a_bad_request_is_answered_with_an_error_and_changes_nothing(
    autojump_clock, header, why
):
    async with runtimes(2, algorithm="adpsgd", codec="auto") as (net, (a, b)):
        before = model(b)
        reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), header,
                                  memoryview(b"junk"))  # fmt: skip
        assert isinstance(reply, ErrorReply) and reply.code == "bad_request" and why in reply.reason
        assert same(model(b), before)


async def test_error_feedback_survives_a_restart_from_state(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="int8") as (net, (a, b)):
        a.ctx.trainer.train_step()
        assert await a.exchange_once()
        tensors, meta = a.state()
        assert tensors and all(k.startswith("ef/") for k in tensors)
        assert any(t.abs().sum() > 0 for t in tensors.values())  # int8 left a residual
    async with runtimes(2, algorithm="adpsgd", codec="int8") as (net, (fresh, _)):
        fresh.load_state(tensors, meta)
        again, _ = fresh.state()
        assert same(again, tensors)
