"""choco's runtime on the in-memory network, on a virtual clock: both ends' estimates stay equal,
a lost reply is found out and both ends resync, rejection, timeout, restart from state."""

from __future__ import annotations

import json

import pytest
import torch
import trio
from _runtimes import model, poison, runtimes, same

from geotrain.node.algorithms.choco import ChocoExchange, ChocoSettings
from geotrain.node.transport import ErrorReply, PeerInfo

CHOCO = {
    "algorithm": "choco",
    "codec": "topk:0.1",
    "algorithm_settings": {"choco": ChocoSettings(gamma=0.5)},
}


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


async def test_a_consensus_step_moves_both_models_towards_each_other(autojump_clock):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        for _ in range(5):
            a.ctx.trainer.train_step()
        gap = sum(float((model(a)[k] - model(b)[k]).norm()) for k in model(a))
        for _ in range(10):
            await a._exchange("p1")
        after = sum(float((model(a)[k] - model(b)[k]).norm()) for k in model(a))
        assert after < 0.8 * gap


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
        await a._exchange("p1")
        assert 0 < trio.current_time() - started <= a.ctx.peers.links.config.deadline_cap_s
        assert same(model(a), before) and a.counters.statistics().failed == 1
        assert a.links["p1"].seq == 0 and not a.links["p1"].busy


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (ChocoExchange(codec="topk:0.5", seq=0, base=0), "refused"),
        (ChocoExchange(codec="topk:0.1", seq=0, base=12345), "same training.seed"),
    ],
)
async def test_a_bad_request_is_refused_and_changes_nothing(autojump_clock, header, why):
    async with runtimes(2, **CHOCO) as (net, (a, b)):
        before = model(b)
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        reply, _ = await b.handle(peer, header, memoryview(b""))
        assert isinstance(reply, ErrorReply) and why in reply.reason
        assert same(model(b), before)
