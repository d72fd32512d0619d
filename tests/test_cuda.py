"""The GPU path on a CUDA device: a training step in bf16 autocast, codecs on the device, an
exchange between two nodes from device memory through pinned staging buffers, and no host copy
of the model on the way. Every test here is marked `cuda` and skips, saying so, where torch sees
no CUDA device (the staging logic itself is tested on the CPU in test_cuda_staging.py);
`python -m geotrain.node.bench.gpu` runs the same checks and prints the figures."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from geotrain.node import GossipConfig, TaskContext, Trainer, resolve_task
from geotrain.node._memory import BUFFERS_PER_CHUNK, peak_rss_mb, reset_peak_rss, rss_mb
from geotrain.node.algorithms import CHUNKS_IN_FLIGHT, ChunkPlan, decode_chunk, encode_chunk
from geotrain.node.testing import algorithm_on, open_memory_network

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here (torch.cuda.is_available() is false)"),
]  # fmt: skip


def _wide(index: int, millions: float) -> Trainer:
    ctx = TaskContext(device=torch.device("cuda"), shard_index=index, num_shards=2,
                      params={"millions": millions})  # fmt: skip
    made = Trainer(resolve_task("wide-linear")(ctx))
    made.update(lambda live: [t.add_(0.01 * index) for t in live.values()])  # models apart
    return made


def test_a_training_step_on_cuda_runs_in_bf16_autocast_and_keeps_float32_weights():
    task = resolve_task("gpt")(TaskContext(device=torch.device("cuda"), params={"size": "1m"}))
    trainer = Trainer(task)  # precision "auto", the node's default
    assert trainer.precision == "bf16"
    seen: list[torch.dtype] = []
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    result = trainer.train_step()
    assert seen and seen[0] == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trainer.model.parameters())
    assert math.isfinite(result.loss)
    assert Trainer(task, precision="fp32").precision == "fp32"


@pytest.mark.parametrize("spec", ["int8", "fp16", "bf16", "none"])
def test_a_chunk_is_encoded_and_decoded_on_the_device(spec):
    x = torch.randn(2**20, device="cuda")
    plan = ChunkPlan.build([("w", (2**20,))], 2**18)
    slices = [(s, x[s.start : s.stop].clone()) for s in plan.chunks[1]]
    payload = encode_chunk(slices, spec)
    decoded = decode_chunk(payload, spec, plan, 1, torch.device("cuda"))
    assert decoded[0].is_cuda
    tolerance = {"int8": 0.02, "fp16": 1e-3, "bf16": 1e-2, "none": 0.0}[spec]
    assert float((decoded[0] - x[2**18 : 2**19]).abs().max()) <= tolerance * 4 + 1e-6


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_two_nodes_exchange_from_device_memory_through_pinned_buffers(autojump_clock, codec):
    trainers = [_wide(i, 1.0) for i in range(2)]
    before = [t.snapshot() for t in trainers]
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        gossip = GossipConfig(codec=codec)
        a, _ = (algorithm_on(net, f"p{i}", trainers[i], gossip, [f"p{1 - i}"],
                             nursery.start_soon, seed=i, chunk_numel=2**18)
                for i in range(2))  # fmt: skip
        assert await a.exchange_once()
        nursery.cancel_scope.cancel()
    tolerance = 1e-5 if codec == "none" else 2e-3
    for t in trainers:
        for name, value in t.params().items():
            assert value.is_cuda
            mean = (before[0][name] + before[1][name]) / 2
            assert float((value - mean).abs().max()) < tolerance, name
    if codec == "none":  # the values crossed through each stream's one pinned buffer
        for t in trainers:
            stats = t.chunk_staging("exchange").statistics()
            assert stats.pinned and stats.allocations == 1 and stats.to_host >= 4
            assert stats.nbytes <= 4 * 2**18 + 16


def test_an_exchange_of_a_device_model_adds_no_host_copy_of_it():
    trainers = [_wide(i, 100.0) for i in range(2)]  # 400 MB each on the device
    model_bytes = sum(t.numel() * 4 for t in trainers[0].params().values())
    # what the node's estimate allows each node for its chunks in flight, and one pinned buffer
    # each: 4 MiB chunks, 0.14 GB a node (a host copy of a model would be 0.4 GB by itself)
    budget = 2 * (CHUNKS_IN_FLIGHT * BUFFERS_PER_CHUNK + 1) * 4 * 2**20

    async def exchange() -> bool:
        async with open_memory_network() as net, trio.open_nursery() as nursery:
            gossip = GossipConfig(codec="none")
            a, _ = (algorithm_on(net, f"p{i}", trainers[i], gossip, [f"p{1 - i}"],
                                 nursery.start_soon, seed=i, chunk_numel=2**20)
                    for i in range(2))  # fmt: skip
            done = await a.exchange_once()
            nursery.cancel_scope.cancel()
        return done

    torch.cuda.synchronize()
    held = rss_mb()
    if held is None or not reset_peak_rss():
        pytest.skip("this OS does not let the peak resident memory be reset and read")
    assert trio.run(exchange)
    extra = (peak_rss_mb() - held) * 1e6
    assert extra <= budget, (extra / 1e6, budget / 1e6, model_bytes / 1e6)


def test_a_checkpoint_of_a_device_model_is_written_a_piece_at_a_time(tmp_path):
    from geotrain.node.state import Checkpoint, CheckpointStore
    from geotrain.node.state._checkpoint import PIECE_BYTES

    trainer = _wide(1, 100.0)  # 400 MB on the device
    tensors, meta = trainer.state_tensors(copy=False)
    store = CheckpointStore(tmp_path)
    torch.cuda.synchronize()
    held = rss_mb()
    if held is None or not reset_peak_rss():
        pytest.skip("this OS does not let the peak resident memory be reset and read")
    store.save(Checkpoint(1, "adpsgd", tensors, meta))
    extra = (peak_rss_mb() - held) * 1e6
    # one pinned piece and the file's pages (written, not held): far below the 400 MB tensor
    assert extra < 4 * PIECE_BYTES + 64 * 2**20, extra / 1e6
    loaded, skipped = store.load_latest()
    assert not skipped and loaded is not None
    for name, t in tensors.items():
        assert torch.equal(loaded.tensors[name], t.cpu()), name
