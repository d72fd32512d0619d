"""The non-default algorithms train to accuracy: four peers on digits-mlp, each until all four are
at 90% test accuracy.

The peers are the daemon's algorithm runtimes with the daemon's config and trainer, on the
in-memory network and trio's virtual clock (tests/_memory_swarm.py). That the daemon runs every
algorithm over its real transport is tests/test_client_mode_inprocess.py's. The refusal of another
algorithm's checkpoint goes through the CLI's main.
"""

from __future__ import annotations

import pytest
from _memory_swarm import reached, train_in_memory

from geotrain.node import config_to_toml
from geotrain.node.cli._main import main

PEERS = 4
COMMON = {"training": {"task": "digits-mlp", "eval_every": 25, "num_shards": PEERS},
          "gossip": {"exchange_every": 2}}  # fmt: skip
TARGET = 0.90


async def train_to_accuracy(tmp_path, **gossip) -> list:
    """Four peers of `gossip`'s algorithm train until each has evaluated at TARGET; returns their
    runtimes (with their trainers, counters and statistics) once every exchange has ended."""
    common = {**COMMON, "gossip": {**COMMON["gossip"], **gossip}}
    peers = await train_in_memory(tmp_path, common, PEERS, lambda ps: reached(ps, TARGET))
    for peer in peers:
        st = peer.algorithm.counters.statistics()
        # every algorithm counts its exchanges, rejections and the codec used per peer
        assert st.ok > 0 and st.rejected == 0, (gossip, st)
        used = [p for p in st.peers.values() if p.ok > 0]
        assert used and all(p.codec is not None for p in used), (gossip, st)
    return [peer.algorithm for peer in peers]


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
        "training": {**COMMON["training"], "threads": 1, "max_steps": 3, "wait_for_peers": 0},
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
