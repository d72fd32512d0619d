"""selsync's runtime on the in-memory network, on a virtual clock: the threshold decides, the
reference moves after an exchange (started or answered), restart from state."""

from __future__ import annotations

import json

import pytest
import torch
from _runtimes import model, runtimes, same, settle, step

from geotrain.node.algorithms.selsync import SelsyncSettings


def selsync(threshold: float) -> dict:
    return {
        "algorithm": "selsync", "codec": "none", "exchange_every": 1,
        "algorithm_settings": {"selsync": SelsyncSettings(threshold=threshold)},
    }  # fmt: skip


def nudge(algorithm, by: float) -> None:
    algorithm.ctx.trainer.update(lambda live: [t.add_(by * t.norm() / t.numel() ** 0.5 + by)
                                               for t in live.values()])  # fmt: skip


async def test_small_changes_stay_local_and_a_large_one_is_exchanged(autojump_clock):
    async with runtimes(2, **selsync(0.05)) as (net, (a, b)):
        nudge(a, 1e-4)
        await a.after_step(step(a, 1))
        await settle()
        assert a.statistics().communicated_steps == 0 and a.counters.statistics().ok == 0
        assert a.statistics().last_relative_change < 0.05
        nudge(a, 0.5)
        await a.after_step(step(a, 2))
        await settle()
        stats = a.statistics()
        assert stats.communicated_steps == 1 and stats.steps == 2
        assert stats.comm_fraction == pytest.approx(0.5)
        assert a.counters.statistics().ok == 1 and b.counters.statistics().ok == 1
        # both reset their reference to the mixed model (in half precision): the next check
        # sees only its rounding
        for x in (a, b):
            assert same(x.reference, {k: v.half() for k, v in model(x).items()})
        await a.after_step(step(a, 3))
        assert a.statistics().last_relative_change < 1e-3


async def test_the_reference_is_rewritten_in_place_and_kept_in_float32_where_half_cannot(
    autojump_clock,
):
    async with runtimes(2, **selsync(0.001)) as (net, (a, b)):  # a tiny threshold: float32
        assert all(t.dtype == torch.float32 for t in a.reference.values())
        nudge(a, 0.5)
        await a.after_step(step(a, 1))
        await settle()
        assert same(a.reference, model(a))
        await a.after_step(step(a, 2))
        assert a.statistics().last_relative_change == pytest.approx(0.0, abs=1e-9)
    async with runtimes(2, **selsync(0.05)) as (net, (a, b)):
        buffers = {k: t.data_ptr() for k, t in a.reference.items()}
        a.ctx.trainer.update(lambda live: live["bias"].fill_(1e6))  # beyond float16's range
        nudge(a, 0.5)
        await a.after_step(step(a, 1))
        await settle()
        assert a.statistics().communicated_steps == 1
        assert a.reference["weight"].data_ptr() == buffers["weight"]  # no new copy was made
        assert a.reference["weight"].dtype == torch.float16
        assert a.reference["bias"].dtype == torch.float32 and same(
            {"bias": a.reference["bias"]}, {"bias": model(a)["bias"]})
        tensors, meta = a.state()
    async with runtimes(2, **selsync(0.05)) as (net, (restored, _)):
        restored.load_state(tensors, json.loads(json.dumps(meta)))
        assert restored.reference["bias"].dtype == torch.float32  # not turned into inf
        assert torch.equal(restored.reference["bias"], tensors["reference/bias"])


async def test_the_reference_and_counts_survive_a_restart_from_state(autojump_clock):
    async with runtimes(2, **selsync(0.01)) as (net, (a, b)):
        nudge(a, 0.5)
        await a.after_step(step(a, 1))
        await settle()
        tensors, meta = a.state()
        reference = {k: v.clone() for k, v in a.reference.items()}
    async with runtimes(2, **selsync(0.01)) as (net, (restored, _)):
        restored.load_state(tensors, json.loads(json.dumps(meta)))
        assert same(restored.reference, reference)
        assert restored.statistics().communicated_steps == 1

