"""diloco's runtime on the in-memory network, on a virtual clock: the outer step on both updates,
a missing partner left out at the deadline, a poisoned update refused, restart from state."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
import trio
from _runtimes import model, poison, runtimes, same, step

from geotrain import compress
from geotrain.gossip import (
    ClipRadius,
    NesterovOuter,
    average,
    params_norm,
    pseudo_gradient,
    robust_average,
)
from geotrain.node import GossipConfig
from geotrain.node.algorithms import diloco
from geotrain.node.algorithms._stream import (
    ChunkPlan,
    EncodedAssembly,
    encode_chunk,
    model_chunk,
)
from geotrain.node.algorithms.diloco import DeltaOffer, DeltaReply, DilocoSettings
from geotrain.node.training import StepResult
from geotrain.node.transport import ErrorReply, PeerInfo

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
        # a told b it held b's round 1: b answered a's offer with nothing, not that update again
        # (each way: one update and the same headers; b's update twice would be one more)
        update = a.ctx.peers.payload_nbytes("none")
        b_to_a, a_to_b = net.bytes_sent[("p1", "p0")], net.bytes_sent[("p0", "p1")]
        assert abs(b_to_a - a_to_b) < update / 2
        tensors, meta = a.state()
        momentum = {k: v.clone() for k, v in a.outer.buffers.items()}
        start = {k: v.clone() for k, v in a.start.items()}
    async with runtimes(2, **DILOCO) as (net, (restored, _)):
        restored.load_state(tensors, json.loads(json.dumps(meta)))
        assert restored.round == 1
        # where its round began: the first round after a restart weighs its own steps
        assert restored.rounds.round_end_step == a.rounds.round_end_step == 2
        assert same(restored.outer.buffers, momentum) and same(restored.start, start)


@pytest.mark.parametrize("chunk_numel", [None, 1000])  # one chunk; or 5 chunks
async def test_offers_crossing_at_a_round_end_carry_each_update_once(autojump_clock, chunk_numel):
    # both partners end their round at the same instant and offer to each other: each update
    # travels in its own offer and the replies carry none (each update went twice, and each
    # node held its partner's update twice); both outer steps still use both updates
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=chunk_numel, params={"features": 4000, "samples": 256},
                        **DILOCO) as (net, (a, b)):  # fmt: skip
        for node in (a, b):
            for _ in range(2):
                node.ctx.trainer.train_step()
        deltas = [pseudo_gradient(n.start, n.ctx.trainer.params()) for n in (a, b)]
        starts = [{k: v.clone() for k, v in n.start.items()} for n in (a, b)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.after_step, step(a, 2))
            nursery.start_soon(b.after_step, step(b, 2))
        update = a.ctx.peers.payload_nbytes("none")
        assert net.bytes_sent[("p0", "p1")] < 1.2 * update
        assert net.bytes_sent[("p1", "p0")] < 1.2 * update
        for node, start in zip((a, b), starts, strict=True):
            stats = node.statistics()
            assert (stats.peer_deltas_used, stats.partners_missing) == (1, 0)
            NesterovOuter(0.7, 0.9).step(start, average(deltas))
            assert all(torch.allclose(node.start[k], start[k], atol=1e-6) for k in start)
            assert node.counters.statistics().failed == 0


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_big_model_drops_its_update_after_the_outer_step(autojump_clock, monkeypatch,
                                                                  codec):  # fmt: skip
    # a model above KEEP_UPDATE_BYTES holds its update only through its round end (not through
    # every inner step); a lossy codec's encoded chunks still answer a later offer in that codec
    monkeypatch.setattr(diloco, "KEEP_UPDATE_BYTES", 0)
    async with runtimes(3, **{**DILOCO, "codec": codec}) as (net, (a, b, c)):
        a.ctx.peers.live_peers = lambda: ("p1",)  # a offers to b only
        c.ctx.peers.live_peers = lambda: ("p0",)
        for node in (a, c):
            node.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        assert a.latest_delta is None and a.latest[0] == 1
        assert b.inbox["p0"][0] == 1  # offered while a still held it
        await c.after_step(step(c, 2))  # c offers to a after a's outer step
        used = c.statistics().peer_deltas_used
        assert used == (1 if codec == "int8" else 0)  # none: a had nothing left to answer with
        assert c.counters.statistics().failed == 0


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


async def test_an_offer_answered_across_the_partners_round_end_still_delivers(autojump_clock):
    # b's round ends while it answers a's offer: the chunks a got are of two updates, so a keeps
    # none of them, but its own update reached b whole, and nobody counts a failure
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8}) as (net, (a, b)):  # 5 chunks
        b.ctx.peers.live_peers = lambda: ()  # b's rounds end without offering
        b.ctx.trainer.train_step()
        await b.after_step(step(b, 2))
        assert b.latest[0] == 1
        net.set_delay("p0", "p1", 0.05)  # chunks 0-3 arrive at 0.05 s, chunk 4 at 0.10 s
        a.ctx.trainer.train_step()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.after_step, step(a, 2))
            await trio.sleep(0.07)
            b.ctx.trainer.train_step()
            await b.after_step(step(b, 4))  # b's round 2 ends between a's chunks
        assert b.latest[0] == 2
        stats = a.statistics()
        assert (stats.outer_steps, stats.peer_deltas_used, stats.partners_missing) == (1, 0, 0)
        assert a.counters.statistics().peers["p1"].ok == 1
        assert a.counters.statistics().failed == 0
        assert b.inbox["p0"][0] == 1  # a's update of its round 1 is b's to use


async def test_a_new_offer_replacing_one_still_arriving_is_kept(autojump_clock):
    # the last chunk of an abandoned offer, finishing after the sender began a new one, must
    # not take the new one's place away (it used to delete it, and the new offer's end failed)
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8}) as (net, (a, b)):
        plan = b.plan(8)
        delta = {k: torch.full_like(v, 0.01) for k, v in b.ctx.trainer.params().items()}
        p0 = PeerInfo("p0", b"", "mem://p0", "inbound")

        def offer(index: int, xid: int) -> DeltaOffer:
            return DeltaOffer(codec="none", round=1, xid=xid, plan=plan.digest, chunk_numel=8,
                              chunks=len(plan), index=index)  # fmt: skip

        chunks = [encode_chunk(model_chunk(delta, plan, i), "none") for i in range(len(plan))]
        for i in range(len(plan) - 1):
            await b.handle(p0, offer(i, xid=1), memoryview(chunks[i]))
        old = b._incoming["p0"]
        to_thread = b.ctx.to_thread

        async def meanwhile(fn, *args):  # while the old offer's last chunk is being decoded,
            b.ctx.to_thread = to_thread  # the sender's new offer begins
            reply, _ = await b.handle(p0, offer(0, xid=2), memoryview(chunks[0]))
            assert isinstance(reply, DeltaReply) and b._incoming["p0"] is not old
            return await to_thread(fn, *args)

        b.ctx.to_thread = meanwhile
        reply, _ = await b.handle(p0, offer(len(plan) - 1, xid=1), memoryview(chunks[-1]))
        assert isinstance(reply, DeltaReply) and b.inbox["p0"][0] == 1  # the old one completed
        assert b._incoming["p0"][0] == 2  # the new one is still held
        for i in range(1, len(plan)):
            reply, _ = await b.handle(p0, offer(i, xid=2), memoryview(chunks[i]))
            assert isinstance(reply, DeltaReply)
        assert b.inbox["p0"][0] == 1 and not b._incoming


async def test_a_closed_connection_frees_the_slot_of_an_unfinished_offer(autojump_clock):
    settings = {"diloco": DilocoSettings(inner_steps=2, fanout=1)}
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8, "algorithm_settings": settings}) as (
        net, (a, b)
    ):
        plan = b.plan(8)
        delta = {k: torch.zeros_like(v) for k, v in b.ctx.trainer.params().items()}
        p0 = PeerInfo("p0", b"", "mem://p0", "inbound")

        def offer(index: int, xid: int = 1) -> DeltaOffer:
            return DeltaOffer(codec="none", round=1, xid=xid, plan=plan.digest, chunk_numel=8,
                              chunks=len(plan), index=index)  # fmt: skip

        chunk = encode_chunk(model_chunk(delta, plan, 0), "none")
        reply, _ = await b.handle(p0, offer(0), memoryview(chunk))
        assert isinstance(reply, DeltaReply) and "p0" in b._incoming
        # p0 dies before its other chunks: with fanout 1 its half offer fills b's only slot ...
        p2 = PeerInfo("p2", b"", "mem://p2", "inbound")
        refused, _ = await b.handle(p2, offer(0, xid=2), memoryview(chunk))
        # declined, not rejected: p2 did nothing wrong (its fanout may be larger than b's)
        assert isinstance(refused, ErrorReply) and refused.code == "busy"
        assert b.counters.statistics().rejected == 0
        b.peer_disconnected("p0")  # ... until the transport sees its connection close
        assert not b._incoming
        reply, _ = await b.handle(p2, offer(0, xid=2), memoryview(chunk))
        assert isinstance(reply, DeltaReply) and "p2" in b._incoming


@pytest.mark.parametrize("chunk_numel", [None, 8])
async def test_consensus_averages_the_outer_parameters_of_each_swap_on_both_ends(
    autojump_clock, chunk_numel
):
    settings = {"diloco": DilocoSettings(inner_steps=2, consensus_every=1,
                                         consensus_codec="none")}  # fmt: skip
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=chunk_numel, **{**DILOCO, "algorithm_settings": settings}
                        ) as (net, (a, b)):  # fmt: skip
        # the two have drifted apart (as nodes that averaged different updates do)
        b.ctx.trainer.apply(lambda live: [t.add_(1.0) for t in live.values()])
        b.model_replaced()
        a0 = {k: v.clone() for k, v in a.start.items()}
        b0 = {k: v.clone() for k, v in b.start.items()}
        for _ in range(2):
            b.ctx.trainer.train_step()
        delta_b = pseudo_gradient(b0, b.ctx.trainer.params())
        await b.after_step(step(b, 2))  # b ends round 1 first: swaps starts with a
        mid = {k: (a0[k] + b0[k]) / 2 for k in a0}
        expected_b = {k: v.clone() for k, v in mid.items()}
        NesterovOuter(0.7, 0.9).step(expected_b, average([delta_b]))  # a had no update yet
        assert all(torch.allclose(b.start[k], expected_b[k], atol=1e-5) for k in mid)
        for _ in range(2):
            a.ctx.trainer.train_step()
        delta_a = pseudo_gradient(a0, a.ctx.trainer.params())
        b_after = {k: v.clone() for k, v in b.start.items()}
        await a.after_step(step(a, 2))  # a swaps again, with b as it is now (b keeps a0 for its
        # next outer step), and a mixes that before its own step
        expected_a = {k: (a0[k] + b_after[k]) / 2 for k in a0}
        NesterovOuter(0.7, 0.9).step(expected_a, average([delta_a, delta_b]))
        assert all(torch.allclose(a.start[k], expected_a[k], atol=1e-5) for k in mid)
        assert a.statistics().consensus_mixes == 1 and b.statistics().consensus_mixes == 1
        assert set(b.consensus) == {"p0"}  # for b's next outer step: a's start of the swap
        held = b.consensus["p0"][1].decoded()  # (kept as it came: codec none's values)
        assert all(torch.equal(held[k], a0[k]) for k in a0)
        apart = sum(float((a0[k] - b0[k]).norm() ** 2) for k in a0) ** 0.5
        now = sum(float((a.start[k] - b.start[k]).norm() ** 2) for k in a0) ** 0.5
        # what is left is the two outer steps' difference (b had only its own update)
        assert now < apart / 2, (now, apart)


async def test_without_consensus_drifted_outer_parameters_stay_apart(autojump_clock):
    settings = {"diloco": DilocoSettings(inner_steps=2, consensus_every=0)}
    async with runtimes(2, **{**DILOCO, "algorithm_settings": settings}) as (net, (a, b)):
        b.ctx.trainer.apply(lambda live: [t.add_(1.0) for t in live.values()])
        b.model_replaced()
        for x in (b, a):
            x.ctx.trainer.train_step()
            x.ctx.trainer.train_step()
            await x.after_step(step(x, 2))
        apart = sum(float((a.start[k] - b.start[k]).norm() ** 2) for k in a.start) ** 0.5
        assert apart > 1.0 and a.statistics().consensus_mixes == 0


def test_consensus_needs_a_dense_codec():
    with pytest.raises(ValueError, match="gossip.diloco.consensus_codec"):
        DilocoSettings(consensus_codec="topk:0.01")


async def test_adaptive_rounds_keep_the_round_end_a_set_fraction_of_compute(autojump_clock):
    # steps of 10 ms; a round end may take 10% of the round's compute: H = wait / 1 ms
    settings = {"diloco": DilocoSettings(inner_steps=2, comm_fraction=0.1, max_inner_steps=500,
                                         consensus_every=0)}  # fmt: skip
    async with runtimes(2, **{**DILOCO, "algorithm_settings": settings}) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.01)
        stepped = 0

        async def round_of_a() -> tuple[int, float]:
            """Steps until a's round ends; (the steps it took, the seconds its round end took)."""
            nonlocal stepped
            before = a.outer_steps
            while True:
                stepped += 1
                started = trio.current_time()
                await a.after_step(StepResult(step=stepped, loss=0.0, seconds=0.01))
                if a.outer_steps > before:
                    return stepped, trio.current_time() - started

        end, waited = await round_of_a()
        assert end == 2  # the first round is inner_steps long
        assert a.inner_steps == math.ceil(waited / (0.1 * 0.01))  # 20 ms offer -> 20 steps
        assert a.inner_steps == 20 and a.statistics().inner_steps == 20
        next_end, _ = await round_of_a()
        assert next_end == end + 20  # the round it asked for
        net.set_delay("p0", "p1", 0.05)  # the link degrades: rounds grow with it ...
        await round_of_a()
        assert a.inner_steps == 100
        net.set_delay("p0", "p1", 0.001)  # ... and shrink back, not below inner_steps
        await round_of_a()
        await round_of_a()
        assert a.inner_steps == 2


def test_adaptive_round_settings_are_checked():
    with pytest.raises(ValueError, match="gossip.diloco.comm_fraction"):
        DilocoSettings(comm_fraction=1.5)
    with pytest.raises(ValueError, match="gossip.diloco.max_inner_steps"):
        DilocoSettings(inner_steps=50, max_inner_steps=10)


async def test_steps_a_loop_took_while_its_round_ended_are_kept_on_the_new_start(autojump_clock):
    # a loop of the user's own does not pause at a round end: the outer step runs at its next
    # step, and what it learned meanwhile lands on top of the new start instead of being lost
    torch.manual_seed(0)
    async with runtimes(2, **DILOCO) as (net, (a, b)):
        for _ in range(2):
            b.ctx.trainer.train_step()
        await b.after_step(step(b, 2))
        for _ in range(2):
            a.ctx.trainer.train_step()
        trainer = a.ctx.trainer
        live_end = {k: v.clone() for k, v in trainer.params().items()}
        delta_a = pseudo_gradient(a.start, live_end)
        start_a = {k: v.clone() for k, v in a.start.items()}
        real_apply, drift = trainer.apply, {}

        def apply_at_the_next_user_step(fn):
            trainer.train_step()  # the user's step during the round end
            drift.update({k: v - live_end[k] for k, v in trainer.params().items()})
            return real_apply(fn)

        trainer.apply = apply_at_the_next_user_step
        await a.after_step(step(a, 2))
        expected = dict(start_a)
        NesterovOuter(0.7, 0.9).step(expected, average([delta_a, b.latest_delta]))
        assert all(torch.allclose(a.start[k], expected[k], atol=1e-6) for k in expected)
        assert any(d.abs().max() > 0 for d in drift.values())
        assert all(torch.allclose(model(a)[k], expected[k] + drift[k], atol=1e-6)
                   for k in expected)  # fmt: skip


def _encoded(update: dict, plan, codec: str) -> EncodedAssembly:
    held = EncodedAssembly(plan, codec, torch.device("cpu"))
    for i in range(len(plan)):
        held.add(i, bytearray(encode_chunk(model_chunk(update, plan, i), codec)))
    assert held.complete
    return held


@pytest.mark.parametrize("rule", ["none", "clip", "trim"])
async def test_the_outer_step_streamed_over_encoded_updates_is_the_whole_one(autojump_clock, rule):
    # peers' updates are held as they came and folded into the outer step a chunk at a time:
    # the result is Nesterov on gossip.robust_average of the decoded updates, for every rule
    torch.manual_seed(1)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        **DILOCO) as (net, (a, _)):  # fmt: skip
        plan = a.plan(1000)  # 5 chunks
        shapes = {n: t.shape for n, t in a.start.items()}
        ours = {n: torch.randn(s) for n, s in shapes.items()}
        theirs = [{n: torch.randn(s) * (1 + 4 * (j == 0)) for n, s in shapes.items()}
                  for j in range(3)]  # fmt: skip
        held = [_encoded(t, plan, "int8") for t in theirs]
        whole = [h.decoded() for h in held]  # what int8 brought
        assert held[0].nbytes < 0.5 * 4 * plan.numel  # kept encoded: a fraction of float32
        radius, radius_ref = ClipRadius(rule), ClipRadius(rule)  # (the same history)
        for _ in range(2):  # twice: the second step carries momentum
            expected = {n: t.clone() for n, t in a.start.items()}
            reference = NesterovOuter(0.7, 0.9)
            reference.buffers = {n: t.clone() for n, t in a.outer.buffers.items()}
            reference.step(expected, robust_average(ours, whole, rule, radius_ref))
            a._outer_update(ours, held, rule, radius)
            assert all(torch.allclose(a.start[n], expected[n], atol=1e-5) for n in expected)
        if rule == "clip":
            assert radius.clipped == radius_ref.clipped >= 1  # the long one was clipped


@pytest.mark.parametrize("kind", ["model", "encoded"])
def test_an_assembly_is_complete_only_when_every_chunk_is_in(kind, monkeypatch):
    # chunks are added from several worker threads: the last chunk to arrive must not report
    # the update complete while an earlier one is still being decoded (it did: the check and
    # the mix then read a half-written update)
    import threading

    from geotrain.node.algorithms import _stream

    update = {"w": torch.arange(16, dtype=torch.float32)}
    plan = _stream.ChunkPlan.build([("w", (16,))], 8)  # 2 chunks
    payloads = [encode_chunk(model_chunk(update, plan, i), "none") for i in range(2)]
    slow, real = threading.Event(), _stream.decode_chunk

    def decode(payload, spec, plan_, index, device):
        if index == 0:
            slow.wait(5)
        return real(payload, spec, plan_, index, device)

    monkeypatch.setattr(_stream, "decode_chunk", decode)
    cls = _stream.ModelAssembly if kind == "model" else EncodedAssembly
    held = cls(plan, "none", torch.device("cpu"))
    first = threading.Thread(target=held.add, args=(0, payloads[0]))
    first.start()
    try:
        assert held.add(1, payloads[1]) is False and not held.complete
    finally:
        slow.set()
        first.join()
    assert held.complete


async def test_a_crossing_offer_is_taken_even_when_the_updates_held_fill_fanout(autojump_clock):
    # fanout 1 and an update from c already held: b's offer, crossing a's own offer to b, is
    # still taken (it stands for the reply a's offer would have brought, which carries none)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(inner_steps=2,
                                                                          fanout=1)}}
    async with runtimes(3, **settings) as (net, (a, b, c)):
        c.ctx.peers.live_peers = lambda: ("p0",)
        a.ctx.peers.live_peers = lambda: ("p1",)
        b.ctx.peers.live_peers = lambda: ("p0",)
        for node in (a, b, c):
            node.ctx.trainer.train_step()
        await c.after_step(step(c, 2))  # c pushes its update to a
        assert "p2" in a.inbox
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.after_step, step(a, 2))
            nursery.start_soon(b.after_step, step(b, 2))
        assert a.statistics().peer_deltas_used == 2  # c's and b's
        assert b.statistics().peer_deltas_used == 1
        assert a.counters.statistics().failed == b.counters.statistics().failed == 0


async def _half_offer_from(b, a) -> None:
    """b ends its round 1 offering to nobody, then sends a only the first of five chunks of it."""
    b.ctx.peers.live_peers = lambda: ()
    b.ctx.trainer.train_step()
    await b.after_step(step(b, 2))
    plan = a.plan(8)
    offer = DeltaOffer(codec="none", round=1, xid=7, plan=plan.digest, chunk_numel=8,
                       chunks=len(plan), index=0)  # fmt: skip
    chunk = encode_chunk(model_chunk(b.latest_delta, plan, 0), "none")
    await a.handle(PeerInfo("p1", b"", "mem://p1", "inbound"), offer, memoryview(chunk))


async def test_a_round_end_does_not_wait_for_an_offer_abandoned_earlier(autojump_clock):
    # b began an offer to a long ago and never finished it; at a's round end b answers a's
    # offer at once: a's outer step must not wait the whole deadline for b's old offer (only
    # offers that cross a's own at its round end are waited for)
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8}) as (net, (a, b)):  # 5 chunks
        await _half_offer_from(b, a)
        assert "p1" in a._incoming
        a.ctx.trainer.train_step()
        started = trio.current_time()
        await a.after_step(step(a, 2))
        deadline = a.ctx.peers.round_deadline("p1", a.ctx.peers.payload_nbytes("none"), started)
        assert trio.current_time() - started < deadline / 2
        assert a.statistics().outer_steps == 1 and a.counters.statistics().failed == 0


async def test_an_offer_stalled_past_its_deadline_is_dropped_and_stands_for_nothing(
    autojump_clock,
):
    # b's half offer stalls; long after its deadline a's round end frees it, so a's offer no
    # longer tells b it holds that update, and b's answer brings it
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8}) as (net, (a, b)):  # 5 chunks
        await _half_offer_from(b, a)
        await trio.sleep(3600)
        a.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        assert "p1" not in a._incoming
        assert a.statistics().peer_deltas_used == 1  # b's update, from its replies


async def _rounds_ending_together(in_place: bool, monkeypatch, hold: bool = False,
                                  half_momentum: bool = False, codec: str = "none",
                                  feedback: bool = True) -> dict:  # fmt: skip
    # two nodes end two rounds at the same instant: offers and consensus swaps cross, each
    # answered while the other's round start may hold its update
    monkeypatch.setattr(diloco, "KEEP_UPDATE_BYTES", 0 if in_place else 2**40)
    monkeypatch.setattr(diloco, "HOLD_HALF_ABOVE_BYTES", 0 if hold else 2**40)
    monkeypatch.setattr(diloco, "MOMENTUM_HALF_ABOVE_BYTES", 0 if half_momentum else 2**40)
    monkeypatch.setattr(diloco, "FEEDBACK_FINE_UP_TO_BYTES", 2**40 if feedback else -1)
    settings = {"diloco": DilocoSettings(inner_steps=2, consensus_every=1,
                                         consensus_codec="none")}  # fmt: skip
    seen = []
    torch.manual_seed(0)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        **{**DILOCO, "codec": codec, "algorithm_settings": settings}) as (
        net,
        nodes,
    ):
        nodes[1].ctx.trainer.apply(lambda live: [t.add_(0.005) for t in live.values()])
        nodes[1].model_replaced()  # (apart: the consensus swap moves them)
        initial = [{k: v.clone() for k, v in n.start.items()} for n in nodes]
        for node in nodes:
            real = node._outer_step

            async def outer_step(round_, delta, replies, partners, node=node, real=real):
                seen.append(delta is node.start)  # our update where the round start was
                await real(round_, delta, replies, partners)

            node._outer_step = outer_step
        for number in (2, 4):
            for node in nodes:
                for _ in range(2):
                    node.ctx.trainer.train_step()
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    nursery.start_soon(node.after_step, step(node, number))
        return {
            "in_place": seen,
            "initial": initial,
            "held": [n._hold for n in nodes],
            "starts": [{k: v.clone() for k, v in n.start.items()} for n in nodes],
            "models": [model(n) for n in nodes],
            "momenta": [{k: v.clone() for k, v in n.outer.buffers.items()} for n in nodes],
            "stats": [n.statistics() for n in nodes],
            "residuals": [bool(n.feedback) for n in nodes],
            "chunks": [n.latest[1] for n in nodes],
        }


def _close(a: list[dict], b: list[dict], scale: float = 0.0) -> bool:
    # to float32's rounding of the largest values (the round start is rebuilt as our update +
    # the model, of magnitude `scale`: their sum's rounding is of the larger of the two)
    def tolerance(x: dict) -> float:
        return 2e-5 * max(scale, *(float(t.abs().max()) for t in x.values()))

    return all(torch.allclose(x[k], y[k], rtol=0, atol=tolerance(x))
               for x, y in zip(a, b, strict=True) for k in x)  # fmt: skip


async def test_a_big_model_s_update_over_its_round_start_steps_as_a_copy_would(
    autojump_clock, monkeypatch
):
    # a big model in the daemon writes its update over its round start (one model copy less at
    # the round end); its outer steps, with consensus swaps answered meanwhile, are those of
    # the copy a smaller model keeps
    copied = await _rounds_ending_together(False, monkeypatch)
    in_place = await _rounds_ending_together(True, monkeypatch)
    assert copied["in_place"] == [False] * 4 and in_place["in_place"] == [True] * 4
    assert copied["stats"] == in_place["stats"]
    assert all(s.consensus_mixes == 2 and s.peer_deltas_used == 2 for s in copied["stats"])
    for key in ("starts", "models", "momenta"):
        assert _close(copied[key], in_place[key]), key
    for start, live in zip(in_place["starts"], in_place["models"], strict=True):
        assert same(start, live)


async def test_a_big_model_holds_peers_updates_in_bfloat16_and_steps_almost_as_exactly(
    autojump_clock, monkeypatch
):
    # codec none's updates held as they came were a whole float32 model each (+0.5 model copies
    # at a 100M node's peak, bench.memory); bfloat16 keeps 8 bits of each value's mantissa
    exact = await _rounds_ending_together(True, monkeypatch)
    held = await _rounds_ending_together(True, monkeypatch, hold=True)
    assert exact["held"] == [None, None] and held["held"] == ["bf16", "bf16"]
    assert exact["stats"] == held["stats"]
    for i in range(2):
        moved = {k: exact["starts"][i][k] - exact["initial"][i][k] for k in exact["initial"][i]}
        error = {k: held["starts"][i][k] - exact["starts"][i][k] for k in moved}
        size, off = params_norm(moved), params_norm(error)
        assert 0 < off < 0.01 * size, (off, size)  # rounded, not lost nor scaled


async def test_a_big_model_holds_its_outer_momentum_in_bfloat16_and_steps_almost_exactly(
    autojump_clock, monkeypatch
):
    # a float32 outer momentum was a whole model copy through every inner step and at the
    # round end's peak; in bfloat16 it is half, and the outer steps move as before to its
    # rounding (the arithmetic stays float32)
    exact = await _rounds_ending_together(True, monkeypatch)
    half = await _rounds_ending_together(True, monkeypatch, half_momentum=True)
    assert exact["stats"] == half["stats"]
    assert all(t.dtype == torch.float32 for m in exact["momenta"] for t in m.values())
    assert all(t.dtype == torch.bfloat16 for m in half["momenta"] for t in m.values())
    for i in range(2):
        moved = {k: exact["starts"][i][k] - exact["initial"][i][k] for k in exact["initial"][i]}
        error = {k: half["starts"][i][k] - exact["starts"][i][k] for k in moved}
        size, off = params_norm(moved), params_norm(error)
        assert 0 < off < 0.01 * size, (off, size)
    # the estimate counts half a copy for it; a small model keeps float32 momentum
    gossip = GossipConfig(algorithm="diloco", codec="none")
    big, small = 2**25, 1000
    monkeypatch.setattr(diloco, "MOMENTUM_HALF_ABOVE_BYTES", 64 * 2**20)
    assert diloco.momentum_dtype(big) == torch.bfloat16 and diloco.momentum_dtype(small) is None
    assert (diloco.diloco_copies(gossip, small, 1) - diloco.diloco_copies(gossip, big, 1)
            == pytest.approx(0.5 + 2 * (1 - diloco.held_share("none", big))))  # fmt: skip


async def test_a_checkpoint_s_momentum_loads_in_the_dtype_the_node_holds_it_in(
    autojump_clock, monkeypatch
):
    # a checkpoint written by a node holding float32 momentum, loaded where it is held in
    # bfloat16 (a new release, or the threshold crossed), and back
    monkeypatch.setattr(diloco, "MOMENTUM_HALF_ABOVE_BYTES", 0)
    async with runtimes(1, **DILOCO) as (net, (a,)):
        for _ in range(2):
            a.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        tensors, meta = a.state()
        momentum = {k: v for k, v in tensors.items() if k.startswith("momentum/")}
        assert momentum and all(v.dtype == torch.bfloat16 for v in momentum.values())
        a.load_state({**tensors, **{k: v.float() for k, v in momentum.items()}}, meta)
        assert all(v.dtype == torch.bfloat16 for v in a.outer.buffers.values())
        a.outer.dtype = None  # a node holding it in its parameters' dtype
        a.load_state(tensors, meta)
        assert all(v.dtype == torch.float32 for v in a.outer.buffers.values())


def test_an_update_held_in_bfloat16_takes_half_the_bytes_and_keeps_its_exact_norm():
    plan = ChunkPlan.build([("w", (3000,))], 1000)
    update = {"w": torch.randn(3000)}
    held = EncodedAssembly(plan, "none", torch.device("cpu"), hold="bf16")
    for i in range(len(plan)):
        held.add(i, bytearray(encode_chunk(model_chunk(update, plan, i), "none")))
    assert held.complete and held.nbytes < 0.55 * 3000 * 4
    assert held.norm == pytest.approx(float(update["w"].norm()), rel=1e-6)  # as sent
    values = torch.cat([t for _, _, t in held.slices()])
    assert torch.equal(values, update["w"].bfloat16().float())


def test_a_peers_update_is_held_in_our_codec_when_it_came_in_a_wider_one():
    # a node that chose int8 was sent codec none by a peer running auto, and held it whole:
    # four times what its memory estimate counted for each update
    plan = ChunkPlan.build([("w", (3000,))], 1000)
    update = {"w": torch.randn(3000)}

    def held(spec: str, hold: str | None) -> EncodedAssembly:
        assembly = EncodedAssembly(plan, spec, torch.device("cpu"), hold=hold)
        for i in range(len(plan)):
            assembly.add(i, bytearray(encode_chunk(model_chunk(update, plan, i), spec)))
        return assembly

    assert held("none", "int8").held_spec == "int8" and held("none", "int8").nbytes < 0.3 * 12000
    assert held("int4", "int8").held_spec == "int4"  # a narrower one stays as it came
    big, small = 2**25, 1000  # parameters: above and below HOLD_HALF_ABOVE_BYTES
    assert [diloco.hold_codec(c, small) for c in ("int8", "auto", "none", "topk:0.01")] == [
        "int8", None, None, None]
    assert [diloco.hold_codec(c, big) for c in ("int8", "auto", "none", "topk:0.01")] == [
        "int8", "bf16", "bf16", "bf16"]
    # what the estimate counts per held update: a peer may send any codec of the dense ladder
    assert diloco.held_share("int8", small) == pytest.approx(0.25, abs=0.01)
    assert diloco.held_share("topk:0.01", small) == 1.0
    assert diloco.held_share("auto", big) == pytest.approx(0.5, abs=0.01)


async def _outer_step_with_held(in_place: bool, monkeypatch, rule: str) -> dict:
    # three peers' updates (one long) and two partners' outer parameters held, partners silent
    monkeypatch.setattr(diloco, "KEEP_UPDATE_BYTES", 0 if in_place else 2**40)
    torch.manual_seed(1)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        robust=rule, **DILOCO) as (net, (a, _)):  # fmt: skip
        net.cut("p0", "p1")
        plan = a.plan(1000)
        shapes = {n: t.shape for n, t in a.start.items()}
        for j in range(3):
            update = {n: torch.randn(s) * 0.01 * (1 + 4 * (j == 0)) for n, s in shapes.items()}
            a.inbox[f"q{j}"] = (1, _encoded(update, plan, "int8"))
        for j in range(2):
            outer = {n: t + torch.randn(t.shape) * 0.1 for n, t in a.start.items()}
            a.consensus[f"r{j}"] = (0, _encoded(outer, plan, "none"))
        for _ in range(2):
            a.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        assert a.statistics().peer_deltas_used == 3 and a.consensus_mixes == 2
        return {"start": [a.start], "model": [model(a)], "momentum": [a.outer.buffers]}


@pytest.mark.parametrize("rule", ["none", "clip", "trim"])
async def test_an_outer_step_over_the_round_start_mixes_and_clips_as_a_copy_would(
    autojump_clock, monkeypatch, rule
):
    copied = await _outer_step_with_held(False, monkeypatch, rule)
    in_place = await _outer_step_with_held(True, monkeypatch, rule)
    for key in copied:
        assert _close(copied[key], in_place[key]), key


async def test_a_round_end_cut_short_leaves_the_round_start_and_the_model_as_they_were(
    autojump_clock, monkeypatch
):
    # the round start holds the update through an in-place round end: cancelled there (the
    # node stopping), the start comes back, and a checkpoint then holds the true one
    monkeypatch.setattr(diloco, "KEEP_UPDATE_BYTES", 0)
    async with runtimes(2, **DILOCO) as (net, (a, b)):
        net.cut("p0", "p1")  # b never answers: a's round end waits for its deadline
        for _ in range(2):
            a.ctx.trainer.train_step()
        start, live = ({k: v.clone() for k, v in a.start.items()}, model(a))
        with trio.move_on_after(0.01):
            await a.after_step(step(a, 2))
        assert not a._start_holds_delta and a.latest_delta is None
        assert _close([a.start], [start]) and same(model(a), live)  # (start - live + live)
        tensors, _ = a.state()
        assert _close([{k: tensors[f"start/{k}"] for k in start}], [start])


async def test_the_round_start_read_through_an_in_place_round_end_is_the_true_one(
    autojump_clock, monkeypatch
):
    # partners' consensus swaps read our outer parameters (chunks, norm, distance) while our
    # round start holds our update: they get the round start, not the update
    monkeypatch.setattr(diloco, "KEEP_UPDATE_BYTES", 0)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        **DILOCO) as (net, (a, _)):  # fmt: skip
        for _ in range(2):
            a.ctx.trainer.train_step()
        start = {k: v.clone() for k, v in a.start.items()}
        scale = max(float(t.abs().max()) for t in model(a).values())  # (this task's steps are
        # big: the model is ~50 by now, the start ~0.01)
        delta, _ = a._round_end("none")
        assert delta is a.start and a._start_holds_delta
        assert a._start_norm() == pytest.approx(params_norm(start), rel=1e-5)
        plan = a.plan(1000)
        read = EncodedAssembly(plan, "none", torch.device("cpu"))
        for i in range(len(plan)):
            read.add(i, bytearray(a._start_chunk(plan, i, "none")))
        assert _close([read.decoded()], [start], scale)
        away = _encoded({k: v + 0.5 for k, v in start.items()}, plan, "none")
        assert a._start_distance(away) == pytest.approx(0.5 * plan.numel**0.5, rel=1e-4)
        a._restore_start()
        assert _close([a.start], [start], scale) and not a._start_holds_delta


async def test_a_big_model_sends_int8_updates_without_error_feedback_rounded_stochastically(
    autojump_clock, monkeypatch
):
    # the float16 residual was half a model copy through every inner step (a 100M node with
    # int8: +3.0-3.5 copies beyond a plain loop, goal 2.5); int8 rounds finely enough without
    # it, stochastically (unbiased): the outer steps land as near the exact ones as with it
    specs = []
    real = diloco.encode_chunk

    def encode_chunk(slices, spec, *args, **kwargs):
        specs.append(spec)
        return real(slices, spec, *args, **kwargs)

    monkeypatch.setattr(diloco, "encode_chunk", encode_chunk)
    exact = await _rounds_ending_together(True, monkeypatch)
    kept = await _rounds_ending_together(True, monkeypatch, codec="int8")
    with_feedback, specs[:] = set(specs), []
    dropped = await _rounds_ending_together(True, monkeypatch, codec="int8", feedback=False)
    # (the consensus swaps' chunks are codec none)
    stochastic = compress.get_codec("int8:stochastic")
    assert with_feedback == {"int8", "none"}
    assert {compress.get_codec(s) for s in specs} == {stochastic, compress.get_codec("none")}
    assert kept["residuals"] == [True, True] and dropped["residuals"] == [False, False]
    assert exact["stats"] == kept["stats"] == dropped["stats"]
    for i in range(2):
        moved = {k: exact["starts"][i][k] - exact["initial"][i][k] for k in exact["initial"][i]}
        size = params_norm(moved)
        offs = [params_norm({k: run["starts"][i][k] - exact["starts"][i][k] for k in moved})
                for run in (kept, dropped)]  # fmt: skip
        assert all(0 < off < 0.01 * size for off in offs), (offs, size)


def test_which_updates_go_without_error_feedback(monkeypatch):
    # above the threshold the fine codecs drop it (int8 then rounds stochastically), the coarse
    # ones keep it; the memory estimate follows
    monkeypatch.setattr(diloco, "FEEDBACK_FINE_UP_TO_BYTES", 64 * 2**20)
    big, small = 2**25, 1000
    for spec, sent in (("int8", "int8:stochastic"), ("int8:64", "int8:64,stochastic")):
        encoding, feedback = diloco.update_encoding(spec, big)
        assert compress.get_codec(encoding) == compress.get_codec(sent) and not feedback
    assert diloco.update_encoding("fp16", big) == ("fp16", False)
    for coarse in ("int4", "topk:0.01", "sign"):
        assert diloco.update_encoding(coarse, big) == (coarse, True)
    assert diloco.update_encoding("int8", small) == ("int8", True)
    int8, auto = (GossipConfig(algorithm="diloco", codec=c) for c in ("int8", "auto"))
    share = diloco.wire_share("int8")
    assert diloco.own_share("int8", big) == pytest.approx(share) and share < 0.3
    assert diloco.own_share("int8", small) == diloco.own_share("auto", big) == 1.0
    assert diloco.diloco_copies(int8, small, 1) - diloco.diloco_copies(int8, big, 1) == (
        pytest.approx(1.0 - share + 0.5))  # (and its momentum in bfloat16)


async def test_a_residual_held_from_coarse_rounds_goes_out_once_then_is_dropped(
    autojump_clock, monkeypatch
):
    # `auto` may send one round in int4 (feedback kept) and the next in int8 (none), or a
    # checkpoint brings one: the residual goes into that update once and its memory is given
    # back (top-k's residual here: a big one)
    monkeypatch.setattr(diloco, "FEEDBACK_FINE_UP_TO_BYTES", -1)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        **{**DILOCO, "codec": "int8"}) as (net, nodes):  # fmt: skip
        a = nodes[0]
        a.ctx.trainer.train_step()
        a._round_end("topk:0.01")
        assert a.feedback
        residual = a.feedback.state_dict()
        a._restore_start()
        a.ctx.trainer.train_step()
        delta, chunks = a._round_end("int8")
        assert not a.feedback
        plan = a.plan(a.ctx.chunk_numel)
        sent = _encoded_values(chunks, plan)
        for name, r in residual.items():  # what went out is the update plus the residual
            target = delta[name].reshape(-1) + r.float().reshape(-1)
            scale = float(target.abs().max())
            assert torch.allclose(sent[name], target, rtol=0, atol=scale / 100), name


def _encoded_values(chunks: list[bytes], plan) -> dict:
    assembly = EncodedAssembly(plan, "int8", torch.device("cpu"))
    for index, chunk in enumerate(chunks):
        assembly.add(index, chunk)
    return {k: v.reshape(-1) for k, v in assembly.decoded().items()}


async def test_stochastic_rounding_differs_between_nodes_and_rounds(autojump_clock, monkeypatch):
    # independent rounding noise is what averages out over partners and rounds: each node has
    # its own seeds, and a round's seeds are not the last one's
    monkeypatch.setattr(diloco, "FEEDBACK_FINE_UP_TO_BYTES", -1)
    async with runtimes(2, chunk_numel=1000, params={"features": 4000, "samples": 64},
                        **{**DILOCO, "codec": "int8"}) as (net, nodes):  # fmt: skip
        assert nodes[0]._seed_base != nodes[1]._seed_base
        a = nodes[0]
        a.ctx.trainer.train_step()
        delta, first = a._round_end("int8")
        delta = {k: v.clone() for k, v in delta.items()}
        a._restore_start()
        a.round += 1
        _, second = a._round_end("int8")
        assert len(first) == len(second) > 1
        assert all(x != y for x, y in zip(first, second, strict=True))
        plan = a.plan(a.ctx.chunk_numel)
        for chunks in (first, second):
            sent = _encoded_values(chunks, plan)
            for name, values in sent.items():
                target = delta[name].reshape(-1)
                assert torch.allclose(values, target, rtol=0, atol=float(target.abs().max()) / 100)


async def test_a_partner_that_failed_is_not_drawn_again_while_its_pause_runs(autojump_clock):
    # fanout 1 among two peers, one of them gone: a crashed peer drew two of three rounds
    settings = DilocoSettings(inner_steps=2, fanout=1, consensus_every=0)
    gossip = {**DILOCO, "algorithm_settings": {"diloco": settings}, "max_norm_ratio": 1e9}
    async with runtimes(3, **gossip) as (net, algos):
        a = algos[0]
        net.cut("p0", "p2")
        for r in range(1, 13):
            for _ in range(2):
                a.ctx.trainer.train_step()
            await a.after_step(step(a, 2 * r))
            await trio.sleep(60)  # rounds of a minute: a pause in seconds would be over
        stats = a.statistics()
        assert stats.outer_steps == 12
        # each failure benches p2 for 1, 2, 4, 8 rounds: the rounds meanwhile go to p1
        assert stats.partners_missing <= 4, stats
        assert a.counters.statistics().ok >= 8
        assert a.sit_outs.rounds["p2"][1] == stats.partners_missing  # failures in a row, none reset


async def test_an_offer_declined_as_busy_is_no_failure_of_the_link(autojump_clock):
    # a healthy 3-node swarm at fanout 1 counted 2-5 such declines a node as failed exchanges,
    # each stretching the link's deadlines and pausing the partner as a failed one
    settings = {"diloco": DilocoSettings(inner_steps=2, fanout=1, consensus_every=0)}
    async with runtimes(2, **{**DILOCO, "chunk_numel": 8, "algorithm_settings": settings}) as (
        net, (a, b)
    ):
        plan = b.plan(8)
        delta = {k: torch.zeros_like(v) for k, v in b.ctx.trainer.params().items()}
        half = DeltaOffer(codec="none", round=1, xid=7, plan=plan.digest, chunk_numel=8,
                          chunks=len(plan), index=0)  # fmt: skip
        chunk = encode_chunk(model_chunk(delta, plan, 0), "none")
        p2 = PeerInfo("p2", b"", "mem://p2", "inbound")
        reply, _ = await b.handle(p2, half, memoryview(chunk))  # b's one slot: p2's offer
        assert isinstance(reply, DeltaReply)
        for _ in range(2):
            a.ctx.trainer.train_step()
        await a.after_step(step(a, 2))
        assert a.counters.statistics().failed == 0
        assert a.ctx.peers.links.estimate("p1", trio.current_time()).failures == 0
        assert a.sit_outs.rounds["p1"] == (2, 0)  # it sits out the next round, no failure counted
        assert a.statistics().partners_missing == 1  # its update did not come this round


@pytest.mark.parametrize("catch_up", [True, False])
async def test_a_slow_peer_catches_up_and_each_update_weighs_its_inner_steps(autojump_clock,
                                                                             catch_up):  # fmt: skip
    """A 4x straggler took the swarm's progress only at its own round end, H of its slow steps
    later. Now a partner's update of a whole round that comes while it is at most halfway
    through its own ends its round at its next step, and each update weighs the inner steps it
    took: the straggler's short round counts for what it did, and a short update does not make
    the fast peer end its round."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {
        "diloco": DilocoSettings(inner_steps=10, catch_up=catch_up)}}
    async with runtimes(2, **settings) as (net, (fast, slow)):
        for _ in range(3):
            slow.ctx.trainer.train_step()
        for _ in range(10):
            fast.ctx.trainer.train_step()
        await fast.after_step(step(fast, 10))  # a whole round: offered to the slow peer
        assert slow.inbox["p0"][0] == 1
        slow.ctx.trainer.train_step()
        for _ in range(3):  # the fast peer is 3 steps into its next round when the slow one's
            fast.ctx.trainer.train_step()  # update comes
        delta_slow = pseudo_gradient(slow.start, slow.ctx.trainer.params())
        start = {k: v.clone() for k, v in slow.start.items()}
        await slow.after_step(step(slow, 4))
        if not catch_up:  # rounds of inner_steps only: its round goes on
            assert slow.statistics().outer_steps == 0 and slow.inbox["p0"][0] == 1
            return
        stats = slow.statistics()
        assert (stats.outer_steps, stats.catch_ups, stats.peer_deltas_used) == (1, 1, 1)
        # the mean weighs each update by its inner steps: 4 of ours, 10 of the fast peer's
        mean = {k: (4 * delta_slow[k] + 10 * fast.latest_delta[k]) / 14 for k in delta_slow}
        NesterovOuter(0.7, 0.9).step(start, mean)
        assert all(torch.allclose(slow.start[k], start[k], atol=1e-6) for k in start)
        assert "p1" in fast.inbox  # its short update went to the fast peer
        await fast.after_step(step(fast, 13))  # a short update: no reason to end its round
        assert fast.statistics().outer_steps == 1 and fast.statistics().catch_ups == 0
        # rounds of inner_steps from the caught-up step on: the slow peer's next ends at 14
        for number in range(5, 14):
            slow.ctx.trainer.train_step()
            await slow.after_step(step(slow, number))
        assert slow.statistics().outer_steps == 1
        slow.ctx.trainer.train_step()
        await slow.after_step(step(slow, 14))
        assert slow.statistics().outer_steps == 2


@pytest.mark.parametrize("round_s", [30.0, 0.0])
async def test_a_slow_peer_ends_its_round_by_time_and_takes_a_partners_newest_round(
        autojump_clock, round_s):  # fmt: skip
    """With fanout 1 a straggler took the swarm's progress only when a fast peer happened to
    draw it (two runs of three on geo3). With round_s its round also ends once it has lasted
    that long: its offer's reply brings the partner's newest whole round, weighed by steps."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(
        inner_steps=10, fanout=1, consensus_every=0, round_s=round_s)}}  # fmt: skip
    async with runtimes(3, **settings) as (net, (fast, other, slow)):
        # fast draws the other; slow draws fast
        fast.sit_outs.rounds["p2"] = slow.sit_outs.rounds["p1"] = (99, 0)
        for _ in range(10):
            fast.ctx.trainer.train_step()
        await fast.after_step(step(fast, 10))
        assert "p0" not in slow.inbox  # nobody offered it anything
        await take_steps(slow, 1, 1, 1.0)
        await trio.sleep(60)  # an evaluation or a checkpoint: not the round's time
        await take_steps(slow, 2, 2, 28.0)
        assert slow.statistics().outer_steps == 0  # its steps took 29 s: not yet round_s
        slow.ctx.trainer.train_step()
        delta_slow = pseudo_gradient(slow.start, slow.ctx.trainer.params())
        start = {k: v.clone() for k, v in slow.start.items()}
        await slow.after_step(paced(3, 2.0))
        stats = slow.statistics()
        if not round_s:  # rounds of inner_steps only
            assert stats.outer_steps == 0 and stats.timed_rounds == 0
            return
        assert (stats.outer_steps, stats.timed_rounds, stats.peer_deltas_used) == (1, 1, 1)
        mean = {k: (3 * delta_slow[k] + 10 * fast.latest_delta[k]) / 13 for k in delta_slow}
        NesterovOuter(0.7, 0.9).step(start, mean)
        assert all(torch.allclose(slow.start[k], start[k], atol=1e-6) for k in start)
        assert fast.inbox["p2"][0] == 1  # its 3 steps went to the fast peer


async def test_a_partners_claimed_steps_never_outweigh_a_whole_round_of_ours(autojump_clock):
    """`steps` comes from the network: a peer saying a million weighs as one whole round."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(inner_steps=4)}}
    async with runtimes(2, **settings) as (net, (a, b)):
        for _ in range(4):
            a.ctx.trainer.train_step()
            b.ctx.trainer.train_step()
        await b.after_step(step(b, 4))
        assert a._steps_of[("p1", 1)] == 4
        a._steps_of[("p1", 1)] = 10**6  # as a lying DeltaOffer would have it
        delta_a = pseudo_gradient(a.start, a.ctx.trainer.params())
        start = {k: v.clone() for k, v in a.start.items()}
        await a.after_step(step(a, 4))
        NesterovOuter(0.7, 0.9).step(start, average([delta_a, b.latest_delta]))
        assert all(torch.allclose(a.start[k], start[k], atol=1e-6) for k in start)


async def test_a_fast_peer_does_not_end_its_round_for_a_slower_peers_whole_round(autojump_clock):
    """A 1.5x slower peer's whole round lands anywhere in a fast peer's: without the rounds in
    the rule, a fast peer ended half of its rounds early for it (a reviewer's simulation)."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(inner_steps=10)}}
    async with runtimes(2, **settings) as (net, (fast, slow)):
        for _ in range(10):
            fast.ctx.trainer.train_step()
        await fast.after_step(step(fast, 10))
        for _ in range(5):  # 5 steps into its second round when the slower one's first ends
            fast.ctx.trainer.train_step()
        for _ in range(10):
            slow.ctx.trainer.train_step()
        await slow.after_step(step(slow, 10))  # a whole round, its first: offered to fast
        assert fast.inbox["p1"][0] == 1 and fast.rounds.arrivals["p1"][1] == 10
        fast.ctx.trainer.train_step()
        await fast.after_step(step(fast, 16))
        assert fast.statistics().outer_steps == 1 and fast.statistics().catch_ups == 0


def paced(number: int, seconds: float) -> StepResult:
    return StepResult(step=number, loss=0.0, seconds=seconds)


async def take_steps(algorithm, first: int, last: int, seconds: float) -> None:
    for number in range(first, last + 1):
        algorithm.ctx.trainer.train_step()
        await algorithm.after_step(paced(number, seconds))


AUTO = {"inner_steps": 10, "fanout": 1, "consensus_every": 0, "catch_up": False,
        "round_s": "auto"}


async def test_round_s_auto_ends_a_slow_peers_round_after_its_partners_pace(autojump_clock):
    """round_s = "auto": no seconds to guess. A partner's offer says how long its update's
    inner steps took (10 steps of 2 s): the slow peer ends its own round by time after 1.5x
    inner_steps at that pace; before any update says it, no round ends by time."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(**AUTO)}}
    async with runtimes(3, **settings) as (net, (fast, other, slow)):
        # fast draws the slow peer, and back
        fast.sit_outs.rounds["p1"] = slow.sit_outs.rounds["p1"] = (99, 0)
        await take_steps(slow, 1, 1, 16.0)
        assert slow.statistics().round_budget_s == 0.0
        await take_steps(slow, 2, 2, 16.0)
        assert slow.statistics().timed_rounds == 0  # 32 s in, but nothing says the pace yet
        await take_steps(fast, 1, 10, 2.0)  # its round: offered to the slow peer
        assert slow.statistics().round_budget_s == pytest.approx(30.0)
        await take_steps(slow, 3, 3, 16.0)  # 48 s into its round: past the budget now
        stats = slow.statistics()
        assert (stats.outer_steps, stats.timed_rounds) == (1, 1)
        await take_steps(slow, 4, 4, 16.0)
        await trio.sleep(60)  # an evaluation: not counted
        await take_steps(slow, 5, 5, 13.0)
        assert slow.statistics().timed_rounds == 1  # 29 s of steps into the next: not yet
        await take_steps(slow, 6, 6, 2.0)
        assert slow.statistics().timed_rounds == 2


async def test_round_s_auto_is_armed_by_the_reply_to_a_slow_peers_own_offer(autojump_clock):
    """A straggler that no partner draws learns the pace at its own round end, from the
    update that comes back in the reply."""
    torch.manual_seed(0)
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(**AUTO)}}
    async with runtimes(3, **settings) as (net, (fast, other, slow)):
        # fast draws the other; slow draws fast
        fast.sit_outs.rounds["p2"] = slow.sit_outs.rounds["p1"] = (99, 0)
        await take_steps(fast, 1, 10, 2.0)
        assert "p0" not in slow.inbox
        await take_steps(slow, 1, 10, 8.0)  # its round of 10 steps, offered to the fast peer
        assert slow.statistics().peer_deltas_used == 1
        assert slow.statistics().round_budget_s == pytest.approx(30.0)


async def test_round_s_auto_takes_the_upper_median_and_bounds_what_peers_claim(autojump_clock):
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(**AUTO)}}
    async with runtimes(1, **settings) as (net, (a,)):
        a.rounds.saw_pace("x", 10, 20_000, a.ctx.now())  # 2 s a step
        # 1 ms a step: one low value does not halve the budget
        a.rounds.saw_pace("liar", 10, 10, a.ctx.now())
        assert a.round_budget_s() == pytest.approx(30.0)
        a.rounds.saw_pace("y", 2**62, 1, a.ctx.now())  # a pace below 0.1 ms a step: not taken
        # steps count at most max_inner_steps (1000)
        a.rounds.saw_pace("z", 10**6, 20_000, a.ctx.now())
        assert "y" not in a.rounds.paces and a.rounds.paces["z"][0] == pytest.approx(0.02)
        await trio.sleep(20 * 10 * 2 + 1)  # 20 of x's rounds: its pace is forgotten
        assert a.round_budget_s() == 0.0


async def test_an_updates_time_counts_the_steps_it_saw_after_a_restart_mid_round(
        autojump_clock):  # fmt: skip
    """Restarted at step 8 of a 10-step round, a node times 2 steps of 2 s: its update of 10
    steps says 20 s, not 4 (a partner then ended its rounds 5x too soon)."""
    settings = {**DILOCO, "algorithm_settings": {"diloco": DilocoSettings(**AUTO)}}
    async with runtimes(2, **settings) as (net, (a, b)):
        for _ in range(8):
            a.ctx.trainer.train_step()
        await take_steps(a, 9, 10, 2.0)
        assert a.rounds.latest_round_ms == 20_000 and a.rounds.latest_steps == 10


def test_round_s_takes_seconds_or_auto_and_names_the_field_otherwise():
    assert DilocoSettings(round_s="auto").round_s == "auto"
    for bad in ("fast", -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="gossip.diloco.round_s"):
            DilocoSettings(round_s=bad)
    with pytest.raises(ValueError, match="gossip.diloco.round_s"):
        DilocoSettings(round_s="auto", comm_fraction=0.05)


async def test_a_model_replaced_while_an_outer_step_holds_the_model_takes_turns_with_it():
    # a state sync's model_replaced (a worker thread) against an outer step (another), which
    # holds the trainer's lock and then the round start's: model_replaced once took the round
    # start's lock first and then waited for the trainer's, and the two waited on each other
    async with runtimes(1, **DILOCO) as (_, (a,)):
        holding, go, finished = threading.Event(), threading.Event(), []

        def outer_step(live):
            holding.set()
            go.wait(10)
            with a._start_lock:
                finished.append("outer step")

        def replaced():
            a.model_replaced()
            finished.append("model replaced")

        stepper = threading.Thread(target=a.ctx.trainer.update, args=(outer_step,), daemon=True)
        stepper.start()
        assert holding.wait(10)
        replacer = threading.Thread(target=replaced, daemon=True)
        replacer.start()
        replacer.join(0.3)  # it waits for the model now (before: holding the round start)
        go.set()
        stepper.join(10)
        replacer.join(10)
        assert finished == ["outer step", "model replaced"]
        assert same(a.start, a.ctx.trainer.params())
