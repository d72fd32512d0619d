"""The non-default algorithms train to accuracy: four peers on digits-mlp, each until all four are
at 90% test accuracy.

The peers are the daemon's algorithm runtimes with the daemon's config and trainer, on the
in-memory network (every message encoded as on the wire) and trio's virtual clock: a step costs
STEP_S, a message LINK_DELAY_S each way. That the daemon runs every algorithm over its real
transport is tests/test_client_mode_inprocess.py's; what is left here for a process is the CLI's
refusal of another algorithm's checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import permutations

import pytest
import trio

from geotrain.node import TaskContext, config_from_toml, config_to_toml, resolve_task
from geotrain.node.cli._main import main
from geotrain.node.testing import algorithm_on, open_memory_network
from geotrain.node.training import Trainer

PEERS = 4
TRAINING = {"task": "digits-mlp", "eval_every": 25, "num_shards": PEERS}
GOSSIP = {"exchange_every": 2}
STEP_S = 0.01  # virtual seconds a step costs (digits-mlp on one core takes a few ms)
LINK_DELAY_S = 0.001  # one way, as on loopback
MAX_STEPS = 3000  # a peer that has not reached the target by then fails the test
TARGET = 0.90


def node_config(tmp_path, index: int, gossip: dict):
    doc = {"identity": {"open_swarm": True},
           "training": {**TRAINING, "shard_index": index},
           "gossip": {**GOSSIP, **gossip}}  # fmt: skip
    return config_from_toml(config_to_toml(doc), base=tmp_path)


def daemon_trainer(config) -> Trainer:
    """The trainer the daemon builds from `config.training` (node/_training_setup.py)."""
    t = config.training
    ctx = TaskContext(shard_index=t.shard_index, num_shards=t.num_shards, seed=t.seed,
                      partition=t.partition, alpha=t.alpha, params=t.params)  # fmt: skip
    return Trainer(
        resolve_task(t.task)(ctx), optimizer=t.optimizer, lr=t.lr, slowdown=t.slowdown,
        precision=t.precision, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
        schedule=t.schedule, total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
        clip_grad_norm=t.clip_grad_norm, accumulate=t.accumulate,
    )  # fmt: skip


async def train_to_accuracy(tmp_path, **gossip) -> list:
    """Four peers of `gossip`'s algorithm train until each has evaluated at TARGET; returns their
    runtimes (with their trainers, counters and statistics) once every exchange has ended."""
    configs = [node_config(tmp_path, i, gossip) for i in range(PEERS)]
    names = [f"p{i}" for i in range(PEERS)]
    metric = [0.0] * PEERS
    reached = trio.Event()
    async with open_memory_network() as net, trio.open_nursery() as nursery:
        algos = [
            algorithm_on(net, name, daemon_trainer(cfg), cfg.gossip,
                         [p for p in names if p != name], nursery.start_soon, seed=i)
            for i, (name, cfg) in enumerate(zip(names, configs, strict=True))
        ]  # fmt: skip
        for a, b in permutations(names, 2):
            net.set_delay(a, b, LINK_DELAY_S, both_ways=False)

        async def train(i: int) -> None:
            algo, trainer = algos[i], algos[i].ctx.trainer
            while not reached.is_set():
                assert trainer.step < MAX_STEPS, (gossip, metric)
                result = trainer.train_step()
                await trio.sleep(STEP_S)
                await algo.after_step(replace(result, seconds=STEP_S))
                if result.step % TRAINING["eval_every"] == 0:
                    metric[i] = trainer.evaluate()
                    if min(metric) >= TARGET:
                        reached.set()

        async with trio.open_nursery() as peers:
            for i in range(PEERS):
                peers.start_soon(train, i)
        await trio.sleep(60)  # exchanges under way end (virtual time)
        nursery.cancel_scope.cancel()
    assert min(metric) >= TARGET, metric
    for algo in algos:
        st = algo.counters.statistics()
        # every algorithm counts its exchanges, rejections and the codec used per peer
        assert st.ok > 0 and st.rejected == 0, (gossip, st)
        used = [p for p in st.peers.values() if p.ok > 0]
        assert used and all(p.codec is not None for p in used), (gossip, st)
    return algos


async def test_dpsgd_rounds_reach_accuracy(tmp_path, autojump_clock):
    algos = await train_to_accuracy(tmp_path, algorithm="dpsgd")
    stats = [a.statistics() for a in algos]
    assert all(st.rounds >= 10 for st in stats), stats
    # with four equal peers nearly every round hears from all three neighbours
    assert sum(st.full_rounds for st in stats) >= 0.8 * sum(st.rounds for st in stats)


async def test_choco_with_topk_reaches_accuracy(tmp_path, autojump_clock):
    algos = await train_to_accuracy(tmp_path, algorithm="choco", codec="topk:0.01")
    counters = [a.counters.statistics() for a in algos]
    assert sum(c.ok for c in counters) >= 8, counters
    used = [p for c in counters for p in c.peers.values() if p.ok > 0]
    assert used and all(p.codec == "topk:0.01" for p in used)


async def test_diloco_reaches_accuracy_with_outer_steps(tmp_path, autojump_clock):
    algos = await train_to_accuracy(tmp_path, algorithm="diloco", codec="int8",
                                    diloco={"inner_steps": 10, "consensus_every": 1})  # fmt: skip
    stats = [a.statistics() for a in algos]
    assert all(st.outer_steps >= 2 for st in stats), stats
    assert sum(st.peer_deltas_used for st in stats) >= 6, stats
    assert sum(st.consensus_mixes for st in stats) >= 4, stats  # outer parameters swapped


async def test_selsync_reaches_accuracy_and_reports_how_often_it_communicated(
    tmp_path, autojump_clock
):
    algos = await train_to_accuracy(tmp_path, algorithm="selsync", exchange_every=1,
                                    selsync={"threshold": 0.02})  # fmt: skip
    for algo in algos:
        st = algo.statistics()
        assert st.steps == algo.ctx.trainer.step
        assert 0 < st.communicated_steps < st.steps  # some steps, not all
        assert st.comm_fraction == pytest.approx(st.communicated_steps / st.steps)


def test_a_restart_with_another_algorithm_on_a_choco_checkpoint_is_refused(tmp_path, capsys):
    # the CLI's answer (its `main`, in this process): exit 2 and one line naming both algorithms
    assert main(["keygen", "--out", str(tmp_path / "identity.key")]) == 0
    (tmp_path / "node.toml").write_text(config_to_toml({
        "identity": {"open_swarm": True},
        "training": {**TRAINING, "threads": 1, "max_steps": 3, "wait_for_peers": 0},
        "gossip": {"algorithm": "choco", "codec": "topk:0.01"},
        "network": {"listen": "tcp://127.0.0.1:0"},
    }))  # fmt: skip
    run = ["node", "run", "--config", str(tmp_path / "node.toml")]
    assert main(run) == 0, capsys.readouterr().err
    assert list((tmp_path / "state" / "checkpoints").glob("ckpt-*.safetensors"))
    capsys.readouterr()
    assert main([*run, "--set", "gossip.algorithm=diloco", "--set", "gossip.codec=int8"]) == 2
    err = capsys.readouterr().err
    assert "algorithm 'choco'" in err and "'diloco'" in err, err
