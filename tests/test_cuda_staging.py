"""The device path's staging and precision, on the CPU: the host chunk buffer a stream's chunks
cross through (one, reused, never larger than the largest chunk), exchanges and state sync
reads through it giving the bytes and averages the direct path gives, and training.precision.
The same code on a CUDA device (pinned buffer, side stream) is tested in test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from _runtimes import model, runtimes

from geotrain.node import ConfigError, TaskContext, Trainer, resolve_task
from geotrain.node._config import TrainingConfig
from geotrain.node.algorithms import ChunkPlan, decode_chunk, read_chunk_encoded
from geotrain.node.training import ChunkStaging
from geotrain.node.training._trainer import resolve_precision


def test_chunks_cross_through_one_buffer_reused_and_no_larger_than_the_largest_chunk():
    staging = ChunkStaging("cpu", pin=False)
    assert not staging.pinned and staging.statistics().nbytes == 0
    sizes = [1000, 400, 1000, 3, 1000]
    for n in sizes:
        source = [torch.arange(n, dtype=torch.float32), torch.full((7,), 2.0)]
        with staging.to_host() as copy:
            copy.start(source)
            host = copy.host()
            assert all(torch.equal(h, s) for h, s in zip(host, source, strict=True))
    stats = staging.statistics()
    assert stats.allocations == 1 and stats.to_host == len(sizes)
    largest = ChunkStaging.nbytes_of([torch.empty(1000), torch.empty(7)])
    assert stats.nbytes == largest <= 4 * 1007 + 2 * 16
    with staging.to_host() as copy:  # a bigger chunk grows it, once
        copy.start([torch.ones(5000)])
        assert torch.equal(copy.host()[0], torch.ones(5000))
    assert staging.statistics().allocations == 2
    assert staging.statistics().nbytes == 4 * 5000


def test_values_reach_the_device_side_through_the_buffer_and_owe_nothing_to_the_source():
    staging = ChunkStaging("cpu", pin=False)
    values = [torch.randn(300), torch.randn(5, dtype=torch.float64)]
    out = staging.to_device(values)
    kept = [v.clone() for v in values]
    for v in values:
        v.zero_()  # (a received message's buffer, reused once this returns)
    assert all(torch.equal(o, k) and o.dtype == k.dtype for o, k in zip(out, kept, strict=True))
    into = [torch.empty(300), torch.empty(5, dtype=torch.float64)]
    staging.to_device(kept, into)
    assert all(torch.equal(o, k) for o, k in zip(into, kept, strict=True))
    assert staging.statistics().to_device == 2 and staging.statistics().allocations == 1


def test_a_read_through_the_staging_buffer_is_the_payload_the_direct_read_makes():
    trainer = Trainer(resolve_task("digits-mlp")(TaskContext()))
    plan = ChunkPlan.for_model(trainer.params(), chunk_bytes=4 * 1000)
    staging = ChunkStaging("cpu", pin=False)
    for index in range(len(plan)):
        direct, _ = read_chunk_encoded(trainer, plan, index, seed=index)
        staged, views = read_chunk_encoded(trainer, plan, index, seed=index, staging=staging)
        assert bytes(staged) == bytes(direct)
        decoded = decode_chunk(staged, "none", plan, index, torch.device("cpu"), staging=staging)
        assert all(torch.equal(d, v) for d, v in zip(decoded, views, strict=True))
    assert staging.statistics().to_host == len(plan) == staging.statistics().to_device
    assert staging.statistics().nbytes <= 4 * 1000 + 16 * max(len(c) for c in plan.chunks)


def test_a_model_in_host_memory_has_no_staging_buffer():
    trainer = Trainer(resolve_task("digits-mlp")(TaskContext()))
    assert trainer.chunk_staging("exchange") is None


async def test_an_exchange_through_staging_buffers_averages_as_the_direct_one(autojump_clock):
    # what a model on a device does (read a chunk copy, carry it through the host buffer; the
    # peer's chunk back through it), run on the CPU by handing each trainer a buffer
    async with runtimes(2, algorithm="adpsgd", codec="none", chunk_numel=8,
                        init_seeds=[1, 2]) as (net, (a, b)):  # fmt: skip
        stagings = {}
        for algo in (a, b):
            staging = stagings[algo] = ChunkStaging("cpu", pin=False)
            algo.ctx.trainer.chunk_staging = lambda stream, s=staging: s
        before_a, before_b = model(a), model(b)
        assert await a.exchange_once()
        mean = {k: (before_a[k] + before_b[k]) / 2 for k in before_a}
        assert all(torch.allclose(model(a)[k], mean[k]) for k in mean)
        assert all(torch.allclose(model(b)[k], mean[k]) for k in mean)
        chunks = len(a.plan(8))
        for staging in stagings.values():
            stats = staging.statistics()
            assert stats.to_host == chunks == stats.to_device and stats.allocations == 1
            assert stats.nbytes <= 4 * 8 + 16 * 2  # one chunk (8 values, at most 2 slices)


def test_precision_auto_is_fp32_on_a_cpu_and_an_unknown_one_is_refused_by_name():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert Trainer(resolve_task("digits-mlp")(TaskContext())).precision == "fp32"
    assert TrainingConfig().precision == "auto"
    with pytest.raises(ConfigError, match="training.precision"):
        TrainingConfig(precision="fp16")
    with pytest.raises(ValueError, match="precision='int8'"):
        resolve_precision("int8", torch.device("cpu"))
