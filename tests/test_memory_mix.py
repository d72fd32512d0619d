"""A big model's uncompressed exchange mixes through a bfloat16 buffer (half a model copy less
at a node's peak): the pair's sum is kept exactly, each end lands within bfloat16's rounding of
the difference from the mean, and a refused peer still leaves the model as it was."""

from __future__ import annotations

import torch
from _runtimes import model, runtimes, same

from geotrain.node.algorithms import _stream


async def test_codec_none_above_the_threshold_mixes_in_bfloat16_and_keeps_the_pairs_sum(
    autojump_clock, monkeypatch
):
    monkeypatch.setattr(_stream, "MIX_HALF_ABOVE_BYTES", 0)
    wide = {"task": "wide-linear", "params": {"millions": 0.01}}
    async with runtimes(2, algorithm="adpsgd", codec="none", init_seeds=[1, 2], chunk_numel=3000,
                        **wide) as (net, (a, b)):  # fmt: skip
        assert len(a.plan(3000)) > 2
        for _ in range(2):
            a.ctx.trainer.train_step()
            before_a, before_b = model(a), model(b)
            assert await a.exchange_once()
            for k in before_a:
                total = before_a[k] + before_b[k]
                assert torch.allclose(model(a)[k] + model(b)[k], total, atol=1e-6), k
                # each value within 2^-9 of its half-difference from the mean (bfloat16's
                # rounding), and not exactly there everywhere (the buffer is bfloat16)
                half_diff = (before_b[k] - before_a[k]).abs() / 2
                off = (model(a)[k] - total / 2).abs()
                assert bool((off <= half_diff * 2**-8 + 1e-6).all()), k
                assert float(off.max()) > 0, k
        assert all(t.dtype == torch.bfloat16 for t in a._spare._spare.values())
        # a peer whose model is 100x ours: the whole refused at the commit, ours as it was
        b.ctx.trainer.update(lambda live: [t.mul_(100) for t in live.values()])
        before_a = model(a)
        assert not await a.exchange_once()
        assert same(model(a), before_a) and a.counters.statistics().rejected == 1


async def test_codec_none_below_the_threshold_averages_exactly(autojump_clock):
    wide = {"task": "wide-linear", "params": {"millions": 0.01}}
    async with runtimes(2, algorithm="adpsgd", codec="none", init_seeds=[1, 2], chunk_numel=3000,
                        **wide) as (net, (a, b)):  # fmt: skip
        before_a, before_b = model(a), model(b)
        assert await a.exchange_once()
        for k in before_a:
            mean = (before_a[k] + before_b[k]) / 2
            assert torch.allclose(model(a)[k], mean, atol=1e-6, rtol=0), k
        assert all(t.dtype == torch.float32 for t in a._spare._spare.values())
