"""A swarm of daemon peers that train in memory, on trio's virtual clock: each peer is the
daemon's algorithm runtime with the daemon's config and trainer (tensor work inline), on the
in-memory network (every message encoded as on the wire). A step costs `step_s` x the peer's
training.slowdown of virtual time and a message `link_delay_s` each way, so a test's outcome
does not depend on how busy the machine is. Tests that use it take pytest-trio's
`autojump_clock` fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import permutations
from pathlib import Path

import trio

from geotrain.node import TaskContext, config_from_toml, config_to_toml, resolve_task
from geotrain.node.algorithms import Algorithm
from geotrain.node.testing import algorithm_on, open_memory_network
from geotrain.node.training import Trainer


@dataclass
class MemoryPeer:
    """One peer: its runtime (with its trainer, counters and statistics) and its latest test
    metric (None before its first evaluation)."""

    algorithm: Algorithm
    slowdown: float
    metric: float | None = None

    @property
    def trainer(self) -> Trainer:
        return self.algorithm.ctx.trainer


def node_config(root: Path, common: dict, index: int, special: dict | None = None):
    """The config of peer `index`: `common`'s sections, its shard, then `special`'s on top
    (section by section, as LocalSwarm merges them)."""
    special = special or {}
    doc = {section: {**common.get(section, {}), **special.get(section, {})}
           for section in {*common, *special}}  # fmt: skip
    doc.setdefault("training", {})["shard_index"] = index
    doc.setdefault("identity", {})["open_swarm"] = True
    return config_from_toml(config_to_toml(doc), base=root)


def daemon_trainer(config) -> Trainer:
    """The trainer the daemon builds from `config.training` (node/_training_setup.py), without its
    slowdown: that one costs virtual time here, not the machine's."""
    t = config.training
    ctx = TaskContext(shard_index=t.shard_index, num_shards=t.num_shards, seed=t.seed,
                      partition=t.partition, alpha=t.alpha, params=t.params)  # fmt: skip
    trainer = Trainer(
        resolve_task(t.task)(ctx), optimizer=t.optimizer, lr=t.lr,
        precision=t.precision, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
        schedule=t.schedule, total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
        clip_grad_norm=t.clip_grad_norm, accumulate=t.accumulate,
    )  # fmt: skip
    trainer.max_bad_losses = t.max_nonfinite_steps  # as the node sets it
    return trainer


async def train_in_memory(
    root: Path, common: dict, n: int, until: Callable[[list[MemoryPeer]], bool], *,
    special: dict[int, dict] | None = None, step_s: float = 0.01, link_delay_s: float = 0.001,
    max_steps: int = 3000, settle_s: float = 60.0,
) -> list[MemoryPeer]:  # fmt: skip
    """Train `n` peers (configs: `common`, peer i's `special[i]` on top) until `until(peers)`
    holds after some peer's step, then let the exchanges under way end (`settle_s` virtual
    seconds). Each peer evaluates every training.eval_every steps.

    Raises:
        AssertionError: a peer passed `max_steps` first (the swarm never got there).
    """
    special = special or {}
    configs = [node_config(root, common, i, special.get(i)) for i in range(n)]
    names = [f"p{i}" for i in range(n)]
    done = trio.Event()
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        peers = [
            MemoryPeer(algorithm_on(net, name, daemon_trainer(cfg), cfg.gossip,
                                    [p for p in names if p != name], nursery.start_soon, seed=i),
                       cfg.training.slowdown)
            for i, (name, cfg) in enumerate(zip(names, configs, strict=True))
        ]  # fmt: skip
        for a, b in permutations(names, 2):
            net.set_delay(a, b, link_delay_s, both_ways=False)

        async def train(peer: MemoryPeer, eval_every: int) -> None:
            while not done.is_set():
                steps = [p.trainer.step for p in peers]
                assert peer.trainer.step < max_steps, ("never got there", steps, peers)
                result = peer.trainer.train_step()
                cost = step_s * peer.slowdown
                await trio.sleep(cost)
                await peer.algorithm.after_step(replace(result, seconds=cost))
                if result.step % eval_every == 0:
                    peer.metric = peer.trainer.evaluate()
                if until(peers):
                    done.set()

        async with trio.open_nursery() as training:
            for peer, cfg in zip(peers, configs, strict=True):
                training.start_soon(train, peer, cfg.training.eval_every)
        await trio.sleep(settle_s)
        nursery.cancel_scope.cancel()
    return peers


def reached(peers: list[MemoryPeer], value: float) -> bool:
    return all(p.metric is not None and p.metric >= value for p in peers)
