"""adpsgd's runtime on the in-memory network, on a virtual clock: a streamed exchange, rejection,
timeout, a peer gone mid-stream, streams that lie, busy, restart from state."""

from __future__ import annotations

import pytest
import torch
import trio
from _runtimes import averaged_where_sent, model, poison, runtimes, same, settle, step

from geotrain import compress
from geotrain.node.algorithms.adpsgd import Exchange, ExchangeChunk
from geotrain.node.transport import ErrorReply, PeerInfo

CHUNKED = {"algorithm": "adpsgd", "codec": "none", "chunk_numel": 8}  # 33 parameters: 5 chunks


async def test_an_exchange_averages_both_models_in_one_round_trip(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()  # the two models differ
        before_a, before_b = model(a), model(b)
        started = trio.current_time()
        assert await a.exchange_once()
        assert trio.current_time() - started == pytest.approx(0.1)  # one round trip, no compute
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert set(mean) == {"weight", "bias"}
        assert all(torch.allclose(model(a)[k], mean[k]) for k in mean)
        assert all(torch.allclose(model(b)[k], mean[k]) for k in mean)
        for me, other in ((a, "p1"), (b, "p0")):
            stats = me.counters.statistics()
            assert (stats.ok, stats.failed, stats.rejected) == (1, 0, 0)
            assert stats.peers[other].codec == "none" and stats.peers[other].ok == 1
        # how long the exchange a started took (status says it); b only answered one
        assert a.counters.statistics().last_s == pytest.approx(0.1)
        net.set_delay("p0", "p1", 0.25)
        assert await a.exchange_once()
        stats = a.counters.statistics()
        assert stats.last_s == pytest.approx(0.5) and stats.mean_s == pytest.approx(0.3)
        assert b.counters.statistics().last_s is None is b.counters.statistics().mean_s


async def test_a_streamed_exchange_pipelines_its_chunks_and_mixes_the_same(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        assert len(a.plan(8)) == 5
        a.ctx.trainer.train_step()
        before_a, before_b = model(a), model(b)
        started = trio.current_time()
        assert await a.exchange_once()
        # chunk 0 opens the exchange, then chunks 1-4 go four at a time: two round trips
        assert trio.current_time() - started == pytest.approx(0.2)
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert all(torch.allclose(model(x)[k], mean[k]) for x in (a, b) for k in mean)
        assert net.bytes_sent[("p0", "p1")] > 33 * 4 and not b._sessions


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


async def test_the_mix_buffer_is_kept_for_the_next_exchange_and_its_old_values_never_leak(
    autojump_clock,
):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        a.ctx.trainer.train_step()
        assert await a.exchange_once()
        assert a._spare.nbytes == 33 * 4  # the model's size: kept, not made afresh next time
        for buffer in a._spare._spare.values():
            buffer.fill_(float("nan"))  # whatever it held must be overwritten, never read
        a.ctx.trainer.train_step()
        before_a, before_b = model(a), model(b)
        assert await a.exchange_once()
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert all(torch.allclose(model(x)[k], mean[k]) for x in (a, b) for k in mean)


async def test_a_poisoned_reply_is_rejected_and_changes_nothing(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
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
        plan = a.plan(a.ctx.chunk_numel)
        size = len(a._mix(plan, "none").send(0))
        # (no tensor work measured on a virtual clock)
        deadline = a.chunk_deadline("p1", size, len(plan))
        started = trio.current_time()
        assert not await a.exchange_once()
        assert trio.current_time() - started == pytest.approx(deadline)
        assert same(model(a), before) and a.counters.statistics().failed == 1
        # the next deadline to that peer is longer (backoff) and the peer rests a while
        assert a.chunk_deadline("p1", size, len(plan)) > deadline
        assert not a.ctx.peers.selector._available("p1", trio.current_time())


async def test_a_responder_that_is_stopping_mixes_nothing_and_says_so(autojump_clock):
    # its nursery takes no new task once the node stops: the last chunk's answer says so, and
    # neither side mixes (it used to fail the handler with "Nursery is closed to new arrivals")
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        a.ctx.trainer.train_step()
        before_a, before_b = model(a), model(b)

        def closed(*_):
            raise RuntimeError("Nursery is closed to new arrivals")

        b.ctx.start_soon = closed
        assert not await a.exchange_once()
        assert same(model(a), before_a) and same(model(b), before_b)
        assert not b._sessions and not a.busy()


async def test_a_peer_gone_mid_stream_changes_neither_model(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()
        before_a, before_b = model(a), model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.exchange_once)
            await trio.sleep(0.12)  # chunk 0 went through; chunks 1-4 are on the wire
            net.cut("p0", "p1")  # the link dies (or b's machine does): they never arrive
        assert same(model(a), before_a) and same(model(b), before_b)
        assert a.counters.statistics().failed == 1 and not a.busy()
        # b held the half-done exchange until it went quiet, then let it go and serves again
        assert b._sessions
        await trio.sleep(60)
        assert b._free() and not b._sessions
        net.heal("p0", "p1")
        assert await a.exchange_once()
        assert b.counters.statistics().failed == 1 and b.counters.statistics().ok == 1


async def test_a_closed_connection_ends_the_exchange_its_peer_was_driving_at_once(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()
        before_b = model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.exchange_once)
            await trio.sleep(0.12)
            net.cut("p0", "p1")  # a's machine dies mid-stream ...
        session = b._sessions["p0"]
        assert trio.current_time() < session.expires_at  # it would wait to idle out (a 100M
        b.peer_disconnected("p0")  # model's: minutes) ... but the transport saw a's connection
        assert not b._sessions  # close: dropped now (a 100M model answers one at a time)
        assert same(model(b), before_b) and b.counters.statistics().failed == 1
        b.peer_disconnected("p0")  # nothing left to drop: counted once
        assert b.counters.statistics().failed == 1


def _opening(algo, **changes) -> Exchange:
    plan = algo.plan(algo.ctx.chunk_numel)
    fields = {"algorithm": "adpsgd", "codec": "none", "step": 0, "xid": 7, "plan": plan.digest,
              "chunk_numel": plan.chunk_numel, "chunks": len(plan), **changes}  # fmt: skip
    return Exchange(**fields)


def _chunks(algo) -> list[bytes]:
    mix = algo._mix(algo.plan(algo.ctx.chunk_numel), "none")
    return [mix.send(i) for i in range(len(mix.plan))]


def _oversize(algo) -> bytes:
    """Chunk 1's slices named right, but ten times the elements the plan gives them."""
    slices = algo.plan(algo.ctx.chunk_numel).chunks[1]
    named = [(s.label, torch.zeros(10 * s.numel)) for s in slices]
    return compress.encode_named(named, compress.get_codec("none"))


@pytest.mark.parametrize(
    ("lie", "why"),
    [
        ("wrong total", "models differ"),
        ("other shapes", "models differ"),
        ("huge chunks", "chunks of"),
        ("other algorithm", "runs adpsgd"),
        ("unagreed codec", "refused"),
        ("extra chunk", "chunk 5 of a 5-chunk plan"),
        ("duplicate chunk", "twice"),
        ("earlier exchange", "no exchange 6 open"),
        ("unknown tensor", "not the plan's"),
        ("oversize chunk", "rejected"),
    ],
)
async def test_a_stream_that_lies_is_refused_and_loses_nothing(autojump_clock, lie, why):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        a.ctx.trainer.train_step()
        before = model(b)
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        chunks = _chunks(a)
        opening = {
            "wrong total": _opening(a, chunks=4),
            "other shapes": _opening(a, plan=123),
            "huge chunks": _opening(a, chunk_numel=2**40),
            "other algorithm": _opening(a, algorithm="choco"),
            "unagreed codec": _opening(a, codec="topk:0.5"),
        }.get(lie, _opening(a))
        first = chunks[1] if lie == "unknown tensor" else chunks[0]
        reply, _ = await b.handle(peer, opening, memoryview(first))
        if lie in ("extra chunk", "duplicate chunk", "earlier exchange", "oversize chunk"):
            assert not isinstance(reply, ErrorReply)
            index, xid, data = {
                "extra chunk": (5, 7, chunks[1]),
                "duplicate chunk": (0, 7, chunks[0]),
                "earlier exchange": (1, 6, chunks[1]),
                "oversize chunk": (1, 7, _oversize(a)),
            }[lie]
            reply, _ = await b.handle(peer, ExchangeChunk(xid=xid, index=index), memoryview(data))
        assert isinstance(reply, ErrorReply) and why in reply.reason, reply
        assert same(model(b), before)
        if lie != "earlier exchange":  # (that one is refused without touching the open one)
            assert not b._sessions  # nothing held: b serves the next exchange
            assert await a.exchange_once()


async def test_a_busy_node_declines_and_the_asker_counts_no_failure(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, b)):
        b.max_exchanges = 1  # as for a big model: one exchange at a time ...
        b._running = True  # ... and it is in one of its own
        before = model(b)
        reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), _opening(b),
                                  memoryview(_chunks(a)[0]))  # fmt: skip
        assert isinstance(reply, ErrorReply) and reply.code == "busy"
        assert "already in 1 exchange(s), the most it runs at once" in reply.reason  # (it says)
        assert same(model(b), before)
        assert not await a.exchange_once()  # the initiator: declined, not failed
        assert a.counters.statistics().failed == 0


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


@pytest.mark.parametrize(("codec", "chunk_numel"), [
    ("topk:0.1", None), ("randk:0.1,unscaled", None),
    ("topk:0.1", 30000)])  # slices of at most SMALL_SLICE: mixed with multi-tensor calls
async def test_a_sparse_codec_averages_the_values_sent_and_leaves_the_others(
    autojump_clock, codec, chunk_numel
):
    # the values a peer did not send decode as zeros: mixed in, they pulled nine tenths of each
    # model halfway to zero at every exchange (two digits nodes ended at 0.35 / 0.58 with
    # topk:0.01, bench.codecs)
    wide = {"task": "wide-linear", "params": {"millions": 0.1}}  # 100,489 parameters
    async with runtimes(2, algorithm="adpsgd", codec=codec, init_seeds=[1, 2],
                        chunk_numel=chunk_numel, **wide) as (net, (a, b)):  # fmt: skip
        for _ in range(2):
            before_a, before_b = model(a), model(b)
            assert await a.exchange_once()
            assert 0.08 < averaged_where_sent(model(a), before_a, before_b) < 0.12
            assert 0.08 < averaged_where_sent(model(b), before_b, before_a) < 0.12
        # a model is not an increment: no residual of what was not sent is kept for the next
        assert not a.feedback.state_dict() and not b.feedback.state_dict()


@pytest.mark.parametrize(("own", "kept"), [("none", False), ("topk:0.1", False), ("auto", True)])
async def test_a_peers_lossy_exchange_is_answered_with_error_feedback_only_where_it_is_counted(
    autojump_clock, own, kept
):
    # a node set to codec none (memory estimate: no residuals) answered a peer running auto in
    # int8 with error feedback: half a model of residuals its estimate did not count
    async with runtimes(2, algorithm="adpsgd", codec=own) as (net, (a, b)):
        a.ctx.trainer.train_step()
        chunk = a._mix(a.plan(a.ctx.chunk_numel), "int8").send(0)
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        reply, _ = await b.handle(peer, _opening(b, codec="int8"), memoryview(chunk))
        assert not isinstance(reply, ErrorReply), reply
        await settle()
        assert b.counters.statistics().ok == 1
        assert bool(b.feedback.state_dict()) == kept


async def test_the_responder_drops_an_exchange_its_initiator_gave_up(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        before_b = model(b)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.exchange_once)
            await trio.sleep(0.12)  # chunk 0 answered; chunks 1-4 on the wire ...
            net.link("p0", "p1").cut = True  # ... and lost
            await trio.sleep(0.1)
            net.link("p0", "p1").cut = False  # the link is back before a gives up
        assert a.counters.statistics().failed == 1 and b._sessions
        await trio.sleep(2.5)  # a's "gave up" message reached b long before b would idle out
        assert not b._sessions and b.counters.statistics().failed == 1
        assert same(model(b), before_b)
        assert not await a.exchange_once()  # a failed partner waits out its pause (5 s) ...
        await trio.sleep(5)
        assert await a.exchange_once()  # ... and is taken again after it


async def test_a_plan_finer_than_max_chunks_is_refused_before_it_is_built(autojump_clock):
    from geotrain.node.algorithms import MAX_CHUNKS

    wide = {"task": "wide-linear", "params": {"millions": 0.1}}  # 100,489 parameters
    async with runtimes(2, algorithm="adpsgd", codec="none", **wide) as (net, (a, b)):
        numel = sum(t.numel() for t in model(b).values())
        assert numel > MAX_CHUNKS
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        for chunks in (numel, 5):  # the true count, or a lie about it
            opening = Exchange(algorithm="adpsgd", codec="none", step=0, xid=1, plan=0,
                               chunk_numel=1, chunks=chunks)  # fmt: skip
            reply, _ = await b.handle(peer, opening, memoryview(b""))
            assert isinstance(reply, ErrorReply) and reply.code == "bad_request", reply
        assert 1 not in b._plans and not b._sessions


async def test_peers_that_cut_the_model_differently_still_exchange_with_lossy_codecs(
    autojump_clock,
):
    # error feedback is kept per tensor, not per slice: chunk sizes may differ between peers
    async with runtimes(2, algorithm="adpsgd", codec="int8", chunk_numel=8) as (net, (a, b)):
        b.ctx.chunk_numel = 16
        for _ in range(3):
            a.ctx.trainer.train_step()
            assert await a.exchange_once() and await b.exchange_once()
        assert a.counters.statistics().ok == 6 and b.counters.statistics().rejected == 0
        assert set(a.feedback.state_dict()) == {"weight", "bias"}


async def test_a_replaced_model_drops_the_exchange_it_was_answering(autojump_clock):
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        reply, _ = await b.handle(peer, _opening(a), memoryview(_chunks(a)[0]))
        assert b._sessions
        b.model_replaced()  # state sync replaced b's model
        assert not b._sessions
        reply, _ = await b.handle(peer, ExchangeChunk(xid=7, index=1), memoryview(_chunks(a)[1]))
        assert isinstance(reply, ErrorReply) and "no exchange 7" in reply.reason


async def test_a_small_model_answers_while_it_exchanges_and_a_big_one_does_not(autojump_clock):
    async with runtimes(3, **CHUNKED) as (net, (a, b, c)):
        assert a.max_exchanges == 3  # 33 parameters: three mix buffers cost nothing
        net.set_delay("p0", "p1", 0.05)
        net.set_delay("p2", "p1", 0.05)
        async with trio.open_nursery() as nursery:  # a and c both start an exchange with b
            a.ctx.peers.choose_partner = lambda now: "p1"
            c.ctx.peers.choose_partner = lambda now: "p1"
            nursery.start_soon(a.exchange_once)
            nursery.start_soon(c.exchange_once)
        assert b.counters.statistics().ok == 2  # b answered both at once
    wide = {"task": "wide-linear", "params": {"millions": 8.0}}  # 32 MB: 3 buffers are too many
    async with runtimes(2, algorithm="adpsgd", codec="none", **wide) as (net, (a, b)):
        assert a.max_exchanges == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_a_half_precision_model_travels_in_its_own_precision_not_float32(autojump_clock,
                                                                                dtype):
    # codec auto on a fast link picks the least compression; for a bf16 (fp16) model that is
    # bf16 (fp16), exact for its values, not "none" (float32 on the wire: twice the bytes)
    from geotrain.node import GossipConfig
    from geotrain.node.testing import algorithm_on, open_memory_network
    from geotrain.node.training import LoopTrainer

    def half(seed: int) -> LoopTrainer:
        torch.manual_seed(seed)
        return LoopTrainer(torch.nn.Linear(64, 64).to(dtype))

    config = GossipConfig(algorithm="adpsgd", codec="auto")
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        a, b = (algorithm_on(net, me, half(i), config, [other], nursery.start_soon, seed=i)
                for i, (me, other) in enumerate((("p0", "p1"), ("p1", "p0"))))
        before = {k: (model(a)[k].float() + model(b)[k].float()) / 2 for k in model(a)}
        assert await a.exchange_once()
        codec = "bf16" if dtype == torch.bfloat16 else "fp16"
        assert a.counters.statistics().peers["p1"].codec == codec
        assert net.bytes_sent[("p0", "p1")] < 0.6 * 4 * (64 * 64 + 64)  # 2 bytes a value
        assert all(torch.allclose(model(a)[k].float(), before[k], atol=1e-2) for k in before)
        nursery.cancel_scope.cancel()


async def test_a_peer_of_another_model_is_warned_about_once(autojump_clock):
    """Peers of other parameter names (torch.compile's '_orig_mod.') refused each other at
    info level only and trained alone unnoticed."""
    from structlog.testing import capture_logs

    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        peer = PeerInfo("p0", b"", "mem://p0", "inbound")
        with capture_logs() as logs:
            for _ in range(3):
                reply, _ = await b.handle(peer, _opening(a, plan=123), memoryview(_chunks(a)[0]))
                assert isinstance(reply, ErrorReply) and "models differ" in reply.reason
    said = [e for e in logs if e["event"] == "models_differ"]
    assert len(said) == 1 and said[0]["log_level"] == "warning" and "_orig_mod." in said[0]["hint"]


@pytest.mark.parametrize("codec", ["int8", "fp16"])
async def test_a_big_model_in_a_fine_codec_mixes_in_bfloat16_and_keeps_the_pairs_sum(
    autojump_clock, monkeypatch, codec
):
    # above MIX_HALF_ABOVE_BYTES (lowered here) the mix buffer is bfloat16 and each end mixes
    # what the other decoded of it: x += (Q(x_peer) - Q(x_sent)) / 2. The pair's sum stays
    # exactly where it was (a float32 buffer mixing Q(x_peer) - x_sent moved it by the rounding)
    from geotrain.node.algorithms import _stream

    monkeypatch.setattr(_stream, "MIX_HALF_ABOVE_BYTES", 0)
    wide = {"task": "wide-linear", "params": {"millions": 0.01}}
    async with runtimes(2, algorithm="adpsgd", codec=codec, init_seeds=[1, 2], chunk_numel=3000,
                        **wide) as (net, (a, b)):  # fmt: skip
        assert len(a.plan(3000)) > 2
        for _ in range(3):  # the second and third exchanges start with residuals held
            a.ctx.trainer.train_step()
            before_a, before_b = model(a), model(b)
            assert await a.exchange_once()
            for k in before_a:
                total = before_a[k] + before_b[k]
                assert torch.allclose(model(a)[k] + model(b)[k], total, atol=1e-6), k
                mean = total / 2
                assert (model(a)[k] - mean).abs().max() < 0.01 * mean.abs().max(), k
        assert all(t.dtype == torch.bfloat16 for t in a._spare._spare.values())
        assert a.feedback.state_dict() and b.feedback.state_dict()  # error feedback kept
        # a peer whose model is 100x ours: every chunk taken, the whole refused at the commit,
        # our model as it was
        b.ctx.trainer.update(lambda live: [t.mul_(100) for t in live.values()])
        before_a = model(a)
        assert not await a.exchange_once()
        assert same(model(a), before_a) and a.counters.statistics().rejected == 1
    monkeypatch.undo()
    assert _stream.mixes_in_half(codec, 2**24 + 1) and _stream.mixes_in_half("bf16", 2**25)
    assert not _stream.mixes_in_half(codec, 2**24) and _stream.mixes_in_half("none", 2**25)
    assert not _stream.mixes_in_half("int4", 2**25) and not _stream.mixes_in_half("topk:0.1", 2**25)


async def test_a_value_beyond_float16s_range_is_refused_at_encoding_and_poisons_nothing(
    autojump_clock, monkeypatch
):
    # fp16 rounds a value above 65504 to inf: the responder's own chunk went out as inf, its
    # bfloat16 mix took Q(peer) - inf and its model turned non-finite (its error feedback too)
    from geotrain.node.algorithms import _stream

    wide = {"task": "wide-linear", "params": {"millions": 0.01}}
    for half in (0, 2**50):
        monkeypatch.setattr(_stream, "MIX_HALF_ABOVE_BYTES", half)
        async with runtimes(2, algorithm="adpsgd", codec="fp16", init_seeds=[1, 2],
                            **wide) as (net, (a, b)):  # fmt: skip
            b.ctx.trainer.update(lambda live: live["weight"].view(-1)[7].fill_(1e5))
            before_a, before_b = model(a), model(b)
            assert not await a.exchange_once()
            await settle()
            assert same(model(a), before_a) and same(model(b), before_b)
            residuals = [*a.feedback.state_dict().values(), *b.feedback.state_dict().values()]
            assert all(bool(torch.isfinite(r).all()) for r in residuals)


async def test_a_peer_that_reopens_or_goes_quiet_is_held_off_and_cannot_hold_the_slots(
    autojump_clock,
):
    """Three admitted identities each opened an exchange, sent chunk 0 and opened anew every
    second: every opening reset the deadlines, and the node's three slots stayed taken for as
    long as they went on (its honest partner's exchanges all declined). A peer that leaves its
    exchanges unfinished is declined for its idle deadline, doubled for each more in a row."""
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        evil = PeerInfo("p9", b"", "mem://p9", "inbound")
        first = memoryview(_chunks(a)[0])
        reply, _ = await b.handle(evil, _opening(a, xid=1), first)
        assert not isinstance(reply, ErrorReply)  # an opening like any other: taken
        idle = b._sessions["p9"].idle_s
        reply, _ = await b.handle(evil, _opening(a, xid=2), first)  # opened over it
        assert isinstance(reply, ErrorReply) and reply.code == "busy"
        assert "left unfinished" in reply.reason and not b._sessions  # the slot is free ...
        assert await a.exchange_once()  # ... for an honest partner
        for xid in range(3, 8):  # re-opening within its hold-off: declined each time
            await trio.sleep(0.1)
            reply, _ = await b.handle(evil, _opening(a, xid=xid), first)
            assert isinstance(reply, ErrorReply) and reply.code == "busy" and not b._sessions
        await trio.sleep(max(1.0, idle))  # its hold-off is over: taken, then left to idle out
        reply, _ = await b.handle(evil, _opening(a, xid=8), first)
        assert not isinstance(reply, ErrorReply) and "p9" in b._sessions
        await trio.sleep(idle + 0.1)
        assert b._free() and "p9" not in b._sessions  # idled out: a second one in a row ...
        held = b._held_off["p9"]
        assert held.strikes == 2 and held.until - trio.current_time() > 1.9 * max(1.0, idle)
        # ... while a peer that finishes what it starts is never held off
        for _ in range(3):
            assert await a.exchange_once()
        assert "p0" not in b._held_off


async def test_a_checkpoint_waits_for_the_exchange_in_flight_and_takes_no_new_one(
    autojump_clock,
):
    """A 10^8 node's checkpoint held the model lock for 6-14 s: the chunks of an exchange in
    flight waited on it, the partner's deadline passed, and ~800 MB of transfer was wasted."""
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.exchange_once)
            await trio.sleep(0.06)
            assert b._sessions  # b answers a's exchange ...
            async with b.quiet(30.0):  # ... and its checkpoint waits for it to end
                assert not b._sessions and b.counters.statistics().ok == 1
                reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"),
                                          _opening(a, xid=99), memoryview(_chunks(a)[0]))
                assert isinstance(reply, ErrorReply) and reply.code == "busy"
                assert "writing a checkpoint" in reply.reason  # no new one meanwhile ...
                assert not b.start_exchange(1)  # ... either way
        assert a.counters.statistics().ok == 1 and a.counters.statistics().failed == 0
        assert await b.exchange_once() and b.start_exchange(2)  # after it: as before


async def test_a_checkpoint_waits_for_a_quiet_peer_only_until_its_deadline(autojump_clock):
    """A session whose peer went quiet was dropped only by an opening or an exchange of our
    own, neither of which comes while a checkpoint waits: every checkpoint waited the full 30 s
    (training with it)."""
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        evil = PeerInfo("p9", b"", "mem://p9", "inbound")
        reply, _ = await b.handle(evil, _opening(a, xid=1), memoryview(_chunks(a)[0]))
        assert not isinstance(reply, ErrorReply)
        idle = b._sessions["p9"].idle_s
        started = trio.current_time()
        async with b.quiet(30.0):
            assert not b._sessions
        assert trio.current_time() - started < idle + 1.0 < 30.0


@pytest.mark.parametrize("second_starts_after_s", [0.0, 0.03, 0.15])
async def test_two_exchanges_one_pair_starts_at_once_average_once_and_never_swap(
    autojump_clock, second_starts_after_s
):
    """Both nodes of a pair start an exchange with each other (at once, or the second while the
    first streams): one runs and both models end at the mean. Two at once moved each model by
    the whole difference (a swap, not an average): a two-site swarm's held-out loss jumped."""
    async with runtimes(2, **CHUNKED) as (net, (a, b)):
        net.set_delay("p0", "p1", 0.05)
        a.ctx.trainer.train_step()  # the two models differ
        before_a, before_b = model(a), model(b)
        done: list[bool] = []

        async def later(runtime) -> None:
            await trio.sleep(second_starts_after_s)
            done.append(await runtime.exchange_once())

        async def first(runtime) -> None:
            done.append(await runtime.exchange_once())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first, a)
            nursery.start_soon(later, b)
        await settle()
        assert sorted(done) == [False, True]
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert all(torch.allclose(model(x)[k], mean[k]) for x in (a, b) for k in mean)
