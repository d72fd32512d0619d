"""Algorithm runtimes on geotrain's in-memory network, for the runtimes' unit tests.

Tests that use `runtimes(...)` take pytest-trio's `autojump_clock` fixture: time is virtual, the
tensor work runs inline, so every deadline and delay is exact and nothing depends on the machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
import trio

from geotrain.node import GossipConfig, TaskContext, Trainer, resolve_task
from geotrain.node.testing import MemoryNetwork, algorithm_on, open_memory_network
from geotrain.node.training import StepResult


def trainer(
    index: int, n: int, task: str = "synthetic-linreg", params: dict | None = None,
    init_seed: int | None = None,
) -> Trainer:  # fmt: skip
    """The trainer of peer `index` of `n` (same seed, so the same initial model everywhere;
    with `init_seed`, that model moved by N(0, 1) noise drawn from it: one of its own, as a loop
    that builds its model without a common seed has)."""
    ctx = TaskContext(shard_index=index, num_shards=n, params=params or {})
    made = Trainer(resolve_task(task)(ctx))
    if init_seed is not None:
        gen = torch.Generator().manual_seed(init_seed)
        made.update(lambda live: [t.add_(torch.randn(t.shape, generator=gen)) for t in
                                  live.values()])  # fmt: skip
    return made


@asynccontextmanager
async def runtimes(
    n: int = 2, *, task: str = "synthetic-linreg", params: dict | None = None,
    chunk_numel: int | None = None, init_seeds: list[int | None] | None = None, **gossip
) -> AsyncIterator[tuple[MemoryNetwork, list]]:
    """`n` runtimes of `gossip["algorithm"]`, peers "p0".."p<n-1>", each seeing all others live
    (model streams in chunks of `chunk_numel` elements when given; initial models of their own
    where `init_seeds` gives a seed, see `trainer`)."""
    config = GossipConfig(**gossip)
    names = [f"p{i}" for i in range(n)]
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        algos = [
            algorithm_on(net, name, trainer(i, n, task, params, (init_seeds or [None] * n)[i]),
                         config, [p for p in names if p != name], nursery.start_soon, seed=i,
                         chunk_numel=chunk_numel)
            for i, name in enumerate(names)
        ]  # fmt: skip
        yield net, algos
        nursery.cancel_scope.cancel()


def step(algorithm, number: int) -> StepResult:
    """A StepResult for step `number` (after a real step of its trainer when `number` is 0)."""
    return StepResult(step=number, loss=0.0, seconds=0.001)


def model(algorithm) -> dict[str, torch.Tensor]:
    return algorithm.ctx.trainer.snapshot()


def averaged_where_sent(after: dict, mine: dict, theirs: dict) -> float:
    """Asserts that every value of `after` is either `mine` (not sent by the peer) or the mean
    of `mine` and `theirs` (sent); returns the share of values averaged."""
    averaged = total = 0
    for name, now in after.items():
        mean = (mine[name] + theirs[name]) / 2
        kept = now == mine[name]
        assert torch.allclose(now[~kept], mean[~kept], atol=1e-6), name
        averaged += int((~kept).sum())
        total += now.numel()
    return averaged / total


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def poison(algorithm) -> None:
    """Turn its model's parameters NaN."""
    algorithm.ctx.trainer.update(lambda live: [t.fill_(float("nan")) for t in live.values()])


async def settle() -> None:
    """Let background exchanges run to their end (virtual time moves on)."""
    await trio.sleep(60)
