"""diloco's runtime on the in-memory network, on a virtual clock: the outer step on both updates,
a missing partner left out at the deadline, a poisoned update refused, restart from state."""

from __future__ import annotations

import json

import pytest
import torch
import trio
from _runtimes import model, poison, runtimes, same, step

from geotrain.gossip import NesterovOuter, average, pseudo_gradient
from geotrain.node.algorithms.diloco import DilocoSettings

DILOCO = {
    "algorithm": "diloco",
    "codec": "none",
    "algorithm_settings": {"diloco": DilocoSettings(inner_steps=2)},
}


@pytest.mark.parametrize("chunk_numel", [None, 8])  # one chunk; or 5 chunks of 33 parameters
async def test_the_outer_step_uses_the_partners_update_and_survives_a_checkpoint(
    autojump_clock, chunk_numel
):
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=chunk_numel, **DILOCO) as (net, (a, b)):
        for _ in range(2):
            b.ctx.trainer.train_step()
        await b.after_step(step(b, 2))  # b ends its round first: a gets b's update pushed
        assert b.used == {} and "p1" in a.inbox
        for _ in range(2):
            a.ctx.trainer.train_step()
        delta_a = pseudo_gradient(a.start, a.ctx.trainer.params())
        start_a = {k: v.clone() for k, v in a.start.items()}
        await a.after_step(step(a, 2))
        stats = a.statistics()
        assert stats.peer_deltas_used == 1 and stats.outer_steps == 1
        # the outer step is Nesterov on the mean of both updates, and the model restarts there
        expected = dict(start_a)
        NesterovOuter(0.7, 0.9).step(expected, average([delta_a, b.latest_delta]))
        assert all(torch.allclose(a.start[k], expected[k], atol=1e-6) for k in expected)
        assert same(model(a), a.start)
        assert a.counters.statistics().ok == 2  # b's offer answered, our offer answered
        tensors, meta = a.state()
        momentum = {k: v.clone() for k, v in a.outer.buffers.items()}
        start = {k: v.clone() for k, v in a.start.items()}
    async with runtimes(2, **DILOCO) as (net, (restored, _)):
        restored.load_state(tensors, json.loads(json.dumps(meta)))
        assert restored.round == 1
        assert same(restored.outer.buffers, momentum) and same(restored.start, start)


async def test_a_silent_partner_is_left_out_at_the_deadline(autojump_clock):
    async with runtimes(2, **DILOCO) as (net, (a, b)):
        net.cut("p0", "p1")
        for _ in range(2):
            a.ctx.trainer.train_step()
        delta = pseudo_gradient(a.start, a.ctx.trainer.params())
        start = {k: v.clone() for k, v in a.start.items()}
        started = trio.current_time()
        await a.after_step(step(a, 2))
        waited = trio.current_time() - started
        size = a.ctx.peers.payload_nbytes("none")
        assert waited == pytest.approx(a.ctx.peers.round_deadline("p1", size, started), rel=0.01)
        stats = a.statistics()
        assert (stats.outer_steps, stats.peer_deltas_used, stats.partners_missing) == (1, 0, 1)
        NesterovOuter(0.7, 0.9).step(start, delta)  # its own update alone
        assert all(torch.allclose(a.start[k], start[k], atol=1e-6) for k in start)
        assert a.counters.statistics().failed == 1


async def test_a_poisoned_update_is_refused(autojump_clock):
    async with runtimes(2, **DILOCO) as (net, (a, b)):
        poison(b)
        await b.after_step(step(b, 2))  # b offers its NaN update to a
        assert a.inbox == {} and a.counters.statistics().rejected == 1
        for _ in range(2):
            a.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        assert all(torch.isfinite(t).all() for t in model(a).values())


async def test_an_update_is_used_once_and_never_when_too_stale(autojump_clock):
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(inner_steps=2,
                                                                          max_staleness=1)}}
    async with runtimes(2, **settings) as (net, (a, b)):
        b.ctx.trainer.train_step()
        await b.after_step(step(b, 2))  # b's update of its round 1 reaches a's inbox
        a.ctx.peers.live_peers = lambda: ()  # a's later rounds ask nobody: only the inbox counts
        await a.after_step(step(a, 2))  # a's round 1: b's round-1 update is fresh: used
        assert a.statistics().peer_deltas_used == 1
        await a.after_step(step(a, 4))  # round 2: nothing new from b: not used again
        assert a.statistics().peer_deltas_used == 1
        a.inbox["p1"] = (1, b.latest_delta)  # an update of b's round 1 offered again, late
        await a.after_step(step(a, 6))  # round 3: two rounds old > max_staleness 1: left out
        assert a.statistics().peer_deltas_used == 1
