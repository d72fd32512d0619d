"""diloco with SparseLoCo-class outer updates (top-k 2%, 2-bit values, error feedback) trains:
four daemon peers in memory on trio's virtual clock (tests/_memory_swarm.py), digits-mlp."""

from __future__ import annotations

from _memory_swarm import reached, train_in_memory

PEERS = 4


async def test_diloco_with_topk_two_bit_updates_reaches_accuracy(tmp_path, autojump_clock):
    common = {
        "training": {"task": "digits-mlp", "eval_every": 25, "num_shards": PEERS},
        "gossip": {"algorithm": "diloco", "codec": "topk:0.02+int2",
                   "diloco": {"inner_steps": 10}},
    }  # fmt: skip
    peers = await train_in_memory(tmp_path, common, PEERS, lambda ps: reached(ps, 0.9))
    for peer in peers:
        st = peer.algorithm.statistics()
        assert st.outer_steps >= 2 and st.peer_deltas_used >= 2, st
        counters = peer.algorithm.counters.statistics()
        assert counters.rejected == 0, counters
        used = [p for p in counters.peers.values() if p.ok > 0]
        assert used and all(p.codec == "topk:0.02+int2" for p in used), counters
