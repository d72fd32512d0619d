"""selsync's runtime on the in-memory network, on a virtual clock: the threshold decides, the
reference moves after an exchange (started or answered), restart from state."""

from __future__ import annotations

import json

import pytest
import torch
from _runtimes import model, runtimes, same, settle, step

from geotrain.node.algorithms.selsync import SelsyncSettings


def selsync(threshold: float, **settings) -> dict:
    return {
        "algorithm": "selsync", "codec": "none", "exchange_every": 1,
        "algorithm_settings": {"selsync": SelsyncSettings(threshold=threshold, **settings)},
    }  # fmt: skip


def sampled(sample, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` as `sample` keeps them: flat, float32, only the sampled values."""
    return {n: tensors[n].float().reshape(-1)[o::s] for n, (o, s) in sample.layout.items()}


def kept(algorithm) -> dict[str, torch.Tensor]:
    """Its model as its reference keeps it."""
    return sampled(algorithm.reference, model(algorithm))


def nudge(algorithm, by: float) -> None:
    algorithm.ctx.trainer.update(lambda live: [t.add_(by * t.norm() / t.numel() ** 0.5 + by)
                                               for t in live.values()])  # fmt: skip


async def test_small_changes_stay_local_and_a_large_one_is_exchanged(autojump_clock):
    async with runtimes(2, **selsync(0.05)) as (net, (a, b)):
        nudge(a, 1e-4)
        await a.after_step(step(a, 1))
        await settle()
        assert a.statistics().communicated_steps == 0 and a.counters.statistics().ok == 0
        assert 0 < a.statistics().last_relative_change < 0.05
        nudge(a, 0.5)
        await a.after_step(step(a, 2))
        await settle()
        stats = a.statistics()
        assert stats.communicated_steps == 1 and stats.steps == 2
        assert stats.comm_fraction == pytest.approx(0.5)
        assert a.counters.statistics().ok == 1 and b.counters.statistics().ok == 1
        # both reset their reference to the mixed model (whole, in float32: the model fits
        # reference_mb): the next check sees no change at all
        for x in (a, b):
            assert x.reference.exact and same(x.reference.values, kept(x))
        await a.after_step(step(a, 3))
        assert a.statistics().last_relative_change == 0.0


async def test_a_model_bigger_than_reference_mb_keeps_a_sample_rewritten_in_place(autojump_clock):
    wide = {"task": "wide-linear", "params": {"millions": 0.04}}  # 200 x 200
    async with runtimes(2, **wide, **selsync(0.05, reference_mb=0.01)) as (net, (a, b)):
        sample = a.reference
        assert not sample.exact and 2000 <= sample.numel <= 2700  # (0.01 MB = 2621 floats)
        buffers = {k: t.data_ptr() for k, t in sample.values.items()}
        nudge(a, 1e-4)
        await a.after_step(step(a, 1))
        assert 0 < a.statistics().last_relative_change < 0.05
        assert a.statistics().communicated_steps == 0
        nudge(a, 0.5)
        await a.after_step(step(a, 2))
        await settle()
        assert a.statistics().communicated_steps == 1
        assert same(sample.values, kept(a)) and same(b.reference.values, kept(b))
        assert {k: t.data_ptr() for k, t in sample.values.items()} == buffers  # no new copy


async def test_the_reference_and_counts_survive_a_restart_from_state(autojump_clock):
    wide = {"task": "wide-linear", "params": {"millions": 0.04}}
    for settings in ({}, {"reference_mb": 0.01}):  # kept whole, and sampled
        async with runtimes(2, **wide, **selsync(0.01, **settings)) as (net, (a, b)):
            nudge(a, 0.5)
            await a.after_step(step(a, 1))
            await settle()
            tensors, meta = a.state()
            reference = {k: v.clone() for k, v in a.reference.values.items()}
        async with runtimes(2, **wide, **selsync(0.01, **settings)) as (net, (restored, _)):
            restored.load_state(tensors, json.loads(json.dumps(meta)))
            assert same(restored.reference.values, reference)
            assert restored.statistics().communicated_steps == 1


async def test_an_older_checkpoint_with_a_whole_half_precision_reference_loads(autojump_clock):
    wide = {"task": "wide-linear", "params": {"millions": 0.04}}
    async with runtimes(2, **wide, **selsync(0.01, reference_mb=0.01)) as (net, (a, _)):
        old = {f"reference/{n}": (t + 1).half() for n, t in model(a).items()}  # whole
        a.load_state(old, {"steps": 3, "communicated": 1})
        half = {n: (t + 1).half() for n, t in model(a).items()}
        assert same(a.reference.values, sampled(a.reference, half))
        assert a.statistics().steps == 3


async def test_selsync_takes_no_exchange_while_a_checkpoint_is_written(autojump_clock):
    """selsync's exchanges are adpsgd's: the checkpoint's quiet (and a dropped connection)
    reached its own no-op, not them."""
    from geotrain.node.algorithms.adpsgd import Exchange
    from geotrain.node.transport import ErrorReply, PeerInfo

    async with runtimes(2, algorithm="selsync", codec="none", chunk_numel=8) as (net, (a, b)):
        pair = a.pairwise
        plan = pair.plan(pair.ctx.chunk_numel)
        opening = Exchange(algorithm="selsync", codec="none", step=0, xid=5, plan=plan.digest,
                           chunk_numel=plan.chunk_numel, chunks=len(plan))  # fmt: skip
        first = pair._mix(plan, "none").send(0)
        async with b.quiet(5.0):
            reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), opening,
                                      memoryview(first))  # fmt: skip
            assert isinstance(reply, ErrorReply) and "writing a checkpoint" in reply.reason
        reply, _ = await b.handle(PeerInfo("p0", b"", "mem://p0", "inbound"), opening,
                                  memoryview(first))  # fmt: skip
        assert not isinstance(reply, ErrorReply) and b.pairwise._sessions
        b.peer_disconnected("p0")
        assert not b.pairwise._sessions  # dropped now, not at its deadline
