# A swarm with Byzantine peers in memory: the node's algorithm runtimes on geotrain's in-memory
# network, on trio's virtual clock, tensor work inline. Invariants: every peer trains the same
# task from the same initial model (same seed) on its own shard; attackers are armed here and
# nowhere else; the result names each honest peer's final metric, so a test or a benchmark can
# compare the worst honest peer with and without attack and robust mixing. Shards, partner
# choice and noise are seeded and time is virtual, yet two runs with the same arguments are not
# identical: trio orders tasks that become ready at the same virtual instant differently from run
# to run, and under an attack without robust mixing that alone moved the worst honest accuracy
# from 0.36 to 0.67 (sign flip); with robust mixing runs agree within about 0.01.
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import trio
import trio.testing

from geotrain.node import GossipConfig, TaskContext, Trainer, resolve_task
from geotrain.node.testing import algorithm_on, open_memory_network
from geotrain.node.training import StepResult, make_private

from ._attacks import Attack, arm

STEP_S = 0.01  # virtual seconds per local step; links add LINK_DELAY_S each way
LINK_DELAY_S = 0.002


@dataclass(frozen=True)
class SwarmResult:
    """Final metrics of one in-memory run.

    Attributes:
        honest: peer index -> final metric (accuracy for digits) of every honest peer.
        robust: the gossip.robust rule used; attackers: peer index -> attack kind.
        clipped: updates the honest peers clipped; rejected: updates they refused.
    """

    honest: Mapping[int, float]
    robust: str
    attackers: Mapping[int, str]
    clipped: int = 0
    rejected: int = 0
    trimmed_rounds: int = 0
    reached_s: float | None = None  # virtual seconds until every honest peer reached `target`
    epsilon: float | None = None  # [privacy]: the largest epsilon an honest peer spent

    @property
    def worst(self) -> float:
        return min(self.honest.values())

    @property
    def mean(self) -> float:
        return sum(self.honest.values()) / len(self.honest)


def run_swarm(
    *,
    n: int = 8,
    attackers: Mapping[int, str] | None = None,
    robust: str = "none",
    steps: int = 300,
    task: str = "digits-mlp",
    params: Mapping | None = None,
    algorithm: str = "adpsgd",
    optimizer: str = "sgd",
    exchange_every: int = 2,
    seed: int = 0,
    omniscient: bool = True,
    partition: str = "iid",
    alpha: float = 0.5,
    target: float | None = None,
    eval_every: int = 10,
    privacy: Mapping | None = None,
) -> SwarmResult:
    """Train `n` peers for `steps` local steps each, `attackers` among them, and evaluate.

    Args:
        n: peers; attackers: peer index -> attack kind (see testbed/_attacks.py).
        robust: gossip.robust of every honest peer (attackers mix plainly; it does not matter).
        steps: local steps per peer; task/params: what they train.
        algorithm: gossip.algorithm; exchange_every: its gossip.exchange_every.
        optimizer: every peer's ("sgd" with momentum, "adam", "adamw"; the task's learning rate).
        omniscient: attackers see the honest peers' models (ALIE, IPM); else only their own.
        partition, alpha: the shards (iid, or Dirichlet label skew).
        target: a metric every honest peer must reach (higher is better); each honest peer is
            evaluated every `eval_every` steps until it does, and the result says when all had.
        privacy: keyword arguments of make_private (epsilon, delta, max_grad_norm, ...) for every
            honest peer (planned_steps defaults to `steps`), or None: no privacy.

    Raises:
        ValueError: an attacker index outside the swarm, or an unknown attack kind.
    """
    attackers = dict(attackers or {})
    bad = [i for i in attackers if not 0 <= i < n]
    if bad:
        raise ValueError(f"attackers {bad}: expected peer indices in 0..{n - 1}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only wait for each other on a busy box
    try:
        return trio.run(
            _run, n, attackers, robust, steps, task, dict(params or {}), algorithm, optimizer,
            exchange_every, seed, omniscient, partition, alpha, target, eval_every,
            {"planned_steps": steps, **privacy} if privacy else None,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _trainer(i: int, n: int, task: str, params: dict, seed: int, partition: str,
             alpha: float, optimizer: str) -> Trainer:  # fmt: skip
    ctx = TaskContext(shard_index=i, num_shards=n, seed=seed, partition=partition, alpha=alpha,
                      params=params)  # fmt: skip
    return Trainer(resolve_task(task)(ctx), optimizer=optimizer)


async def _run(n, attackers, robust, steps, task, params, algorithm, optimizer, exchange_every,
               seed, omniscient, partition, alpha, target, eval_every,
               privacy) -> SwarmResult:  # fmt: skip
    torch.manual_seed(seed)
    names = [f"p{i}" for i in range(n)]
    honest_cfg = GossipConfig(algorithm=algorithm, codec="none", exchange_every=exchange_every,
                              robust=robust, policy="uniform")  # fmt: skip
    bad_cfg = GossipConfig(algorithm=algorithm, codec="none", exchange_every=exchange_every,
                           policy="uniform")  # fmt: skip
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        for a in names:
            for b in names:
                if a < b:
                    net.set_delay(a, b, LINK_DELAY_S)
        algos, attacks = [], {}
        for i, name in enumerate(names):
            is_bad = i in attackers
            trainer = _trainer(i, n, task, params, seed, partition, alpha, optimizer)
            if privacy is not None and not is_bad:
                make_private(trainer, **privacy)
            if is_bad:
                attack = Attack(attackers[i], trainer.snapshot(), n_peers=n,
                                n_attackers=len(attackers), seed=seed * 100 + i)  # fmt: skip
                arm(trainer, attack, observe_own=not omniscient)
                attacks[i] = attack
            algos.append(algorithm_on(
                net, name, trainer, bad_cfg if is_bad else honest_cfg,
                [p for p in names if p != name], nursery.start_soon, seed=seed * 100 + i,
            ))  # fmt: skip
        honest = [i for i in range(n) if i not in attackers]

        reached: dict[int, float] = {}
        t0 = trio.current_time()

        async def peer(i: int, algo) -> None:  # each peer steps on its own, as a driver does
            for step in range(1, steps + 1):
                result = algo.ctx.trainer.train_step()
                await algo.after_step(StepResult(step, result.loss, STEP_S))
                await trio.sleep(STEP_S)
                watch = target is not None and i in honest and i not in reached
                if watch and step % eval_every == 0 and algo.ctx.trainer.evaluate() >= target:
                    reached[i] = trio.current_time() - t0

        async def spy() -> None:  # omniscient attackers look at the honest models now and then
            while True:
                models = [algos[i].ctx.trainer.snapshot() for i in honest]
                for attack in attacks.values():
                    attack.observe(models)
                await trio.sleep(5 * STEP_S)

        async with trio.open_nursery() as peers:
            if omniscient and attacks:
                peers.start_soon(spy)
            async with trio.open_nursery() as running:
                for i, algo in enumerate(algos):
                    running.start_soon(peer, i, algo)
            peers.cancel_scope.cancel()
        await trio.sleep(10 * STEP_S)  # exchanges still on the way finish
        nursery.cancel_scope.cancel()
    metrics = {i: algos[i].ctx.trainer.evaluate() for i in honest}
    robust_stats = [algos[i].ctx.robust for i in honest]
    return SwarmResult(
        honest=metrics, robust=robust, attackers=attackers,
        clipped=sum(r.clipped for r in robust_stats if r is not None),
        rejected=sum(algos[i].counters.statistics().rejected for i in honest),
        trimmed_rounds=sum(r.trimmed_rounds for r in robust_stats if r is not None),
        reached_s=max(reached.values()) if len(reached) == len(honest) else None,
        epsilon=max(_spent(algos[i].ctx.trainer) for i in honest) if privacy else None,
    )  # fmt: skip


def _spent(trainer: Trainer) -> float:
    private = trainer.private
    return private.epsilon() if private is not None else 0.0
