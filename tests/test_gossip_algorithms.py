"""gossip/_algorithms: the tensor rules and decisions of dpsgd, choco, diloco and selsync."""

from __future__ import annotations

import random

import pytest
import torch

from geotrain import compress
from geotrain.gossip import consensus_distance
from geotrain.gossip._algorithms import (
    NesterovOuter,
    RoundAttendance,
    average,
    choco_consensus,
    choco_difference,
    choco_update_estimate,
    fresh_deltas,
    metropolis_hastings_weights,
    neighbourhood_mix,
    pseudo_gradient,
)
from geotrain.gossip._averaging import pairwise_mix
from geotrain.node.training._tasks import TaskContext, resolve_task
from geotrain.node.training._trainer import Trainer


def test_metropolis_hastings_row_sums_to_one_and_missing_weight_stays_home():
    self_w, w = metropolis_hastings_weights(3, {"a": 1, "b": 3, "c": 5})
    assert w == {"a": 0.25, "b": 0.25, "c": 1 / 6}
    assert self_w + sum(w.values()) == pytest.approx(1.0)
    # "c" missed the deadline: its weight goes back to us, the others' are unchanged
    self_w2, w2 = metropolis_hastings_weights(3, {"a": 1, "b": 3})
    assert w2 == {"a": 0.25, "b": 0.25}
    assert self_w2 == pytest.approx(self_w + 1 / 6)


def test_metropolis_hastings_is_doubly_stochastic_on_a_graph():
    # a path a - b - c - d plus the edge b - d; every row and column of W sums to one
    edges = {"a": ["b"], "b": ["a", "c", "d"], "c": ["b", "d"], "d": ["b", "c"]}
    rows = {}
    for node, nbrs in edges.items():
        self_w, w = metropolis_hastings_weights(len(nbrs), {p: len(edges[p]) for p in nbrs})
        rows[node] = {node: self_w, **w}
    for node in edges:
        assert sum(rows[node].values()) == pytest.approx(1.0)
        assert sum(rows[other].get(node, 0.0) for other in edges) == pytest.approx(1.0)


def _model(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.full((2,), value)}


def test_neighbourhood_mix_averages_a_full_round_and_keeps_local_progress():
    sent = {"x": _model(0.0), "y": _model(3.0), "z": _model(6.0)}
    _, weights = metropolis_hastings_weights(2, {"y": 2, "z": 2})
    live = _model(0.0)
    live["w"] += 1.0  # a step taken after the round's model was published
    neighbourhood_mix(live, sent["x"], {"y": sent["y"], "z": sent["z"]}, weights)
    assert torch.allclose(live["b"], torch.full((2,), 3.0))  # the average of 0, 3, 6
    assert torch.allclose(live["w"], torch.full((3, 2), 4.0))  # ... plus our own step


def test_round_attendance_skips_a_straggler_longer_each_time_and_forgives():
    att = RoundAttendance(max_skip=4)
    assert att.eligible(["a", "b"], 1) == ["a", "b"]
    att.record("b", 1, answered=False)
    assert [r for r in range(2, 5) if "b" in att.eligible(["a", "b"], r)] == [4]  # 2 rounds off
    att.record("b", 4, answered=False)  # second miss: 4 rounds off
    assert [r for r in range(5, 10) if "b" in att.eligible(["b"], r)] == [9]
    att.record("b", 9, answered=True)
    assert att.eligible(["b"], 10) == ["b"]
    att.record("a", 10, answered=False)
    att.forget(["b"])
    assert att.eligible(["a"], 11) == ["a"]


def test_round_attendance_waits_for_a_neighbour_that_is_behind_but_catching_up():
    # We started first and are at round 40; b started late and has been asking us for its rounds
    # at 100 rounds a second: it misses round 40 now, but gets there in well under catch_up_s.
    att = RoundAttendance(catch_up_s=5.0)
    for i in range(8):
        att.heard("b", 10 + i, now=1.0 + i * 0.01)
    att.record("b", 40, answered=False, now=1.08)
    assert att.eligible(["b"], 41) == ["b"]  # asked again next round, not skipped
    assert att.forgiven == 1


def test_round_attendance_still_skips_a_straggler_and_a_silent_or_unknown_neighbour():
    att = RoundAttendance(catch_up_s=5.0)
    att.heard("slow", 1, now=0.0)  # one round every 6 s: 40 rounds behind is minutes away
    att.heard("slow", 2, now=6.0)
    att.heard("gone", 30, now=0.0)  # was fast, then nothing for 10 s
    att.heard("gone", 38, now=0.08)
    for peer in ("slow", "gone", "never-heard"):
        att.record(peer, 40, answered=False, now=10.0)
    assert att.eligible(["slow", "gone", "never-heard"], 41) == []
    assert att.forgiven == 0
    att.heard("ahead", 45, now=9.9)  # fast, and already past the round we asked for:
    att.heard("ahead", 46, now=9.95)
    att.record("ahead", 41, answered=False, now=10.0)  # its miss is not a catch-up
    assert att.eligible(["ahead"], 42) == []


def test_round_attendance_starts_a_restarted_neighbours_pace_anew():
    # b got to round 500, restarted from a checkpoint at round 100, and is racing back up
    att = RoundAttendance(catch_up_s=5.0)
    att.heard("b", 499, now=0.0)
    att.heard("b", 500, now=0.1)
    for i in range(4):
        att.heard("b", 100 + i, now=10.0 + i * 0.01)
    att.record("b", 120, answered=False, now=10.05)
    assert att.eligible(["b"], 121) == ["b"] and att.forgiven == 1


def test_round_attendance_forgives_a_bounded_number_of_misses_between_answers():
    # A neighbour that keeps telling us it is close behind but never answers (a one-way link, or
    # a liar) is forgiven max_forgiven times, then skipped like any other; an answer resets that.
    att = RoundAttendance(catch_up_s=5.0, max_forgiven=3)
    now, skipped_at = 0.0, None
    for r in range(100, 120):
        for i in range(2):
            now += 0.01
            att.heard("liar", r - 3 + i, now)
        if "liar" not in att.eligible(["liar"], r):
            skipped_at = r
            break
        att.record("liar", r, answered=False, now=now)
    assert skipped_at == 104 and att.forgiven == 3  # 3 forgiven, the 4th miss counts
    att.record("liar", 110, answered=True)
    att.record("liar", 111, answered=False, now=now)  # still close behind: forgiven again
    assert att.forgiven == 4 and att.eligible(["liar"], 112) == ["liar"]
    att.forget([])
    assert att.catching_up("liar", 112, now) is False  # its record went with it


def test_choco_estimates_stay_equal_on_both_ends_and_absorb_the_compression_error():
    torch.manual_seed(0)
    codec = compress.get_codec("topk:0.1")
    x_i = {"w": torch.randn(40, 10)}
    x_j = {"w": torch.randn(40, 10)}
    # each end keeps (ours as the peer sees it, the peer's)
    at_i = {"mine": {"w": torch.zeros(40, 10)}, "theirs": {"w": torch.zeros(40, 10)}}
    at_j = {"mine": {"w": torch.zeros(40, 10)}, "theirs": {"w": torch.zeros(40, 10)}}

    def wire(d):
        data = compress.encode_named(sorted(d.items()), codec)
        return dict(compress.decode_named(data, max_numel=10**6))

    start_gap = float((x_i["w"] - x_j["w"]).norm())
    for _ in range(200):
        q_i = wire(choco_difference(x_i, at_i["mine"]))
        q_j = wire(choco_difference(x_j, at_j["mine"]))
        choco_update_estimate(at_i["mine"], q_i)
        choco_update_estimate(at_j["theirs"], q_i)
        choco_update_estimate(at_j["mine"], q_j)
        choco_update_estimate(at_i["theirs"], q_j)
        choco_consensus(x_i, at_i["mine"], at_i["theirs"], gamma=0.3)
        choco_consensus(x_j, at_j["mine"], at_j["theirs"], gamma=0.3)
    assert torch.equal(at_i["mine"]["w"], at_j["theirs"]["w"])
    assert torch.equal(at_j["mine"]["w"], at_i["theirs"]["w"])
    assert float((x_i["w"] - x_j["w"]).norm()) < 0.05 * start_gap
    assert float((at_i["mine"]["w"] - x_i["w"]).norm()) < 0.05 * start_gap


def test_choco_gamma_is_checked():
    with pytest.raises(ValueError, match="gamma"):
        choco_consensus(_model(0), _model(0), _model(1), gamma=0.0)


def test_nesterov_outer_step_matches_torch_sgd_nesterov():
    torch.manual_seed(1)
    start = {"w": torch.randn(5)}
    reference = torch.nn.Parameter(start["w"].clone())
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    for _ in range(4):
        g = torch.randn(5)
        outer.step(start, {"w": g})
        reference.grad = g.clone()
        opt.step()
    assert torch.allclose(start["w"], reference.detach(), atol=1e-6)


def test_nesterov_outer_momentum_held_in_bfloat16_stays_close_to_float32():
    # a 100M diloco node holds its outer momentum in bfloat16 (half a model copy): the round
    # start must still move as float32 momentum moves it, to its rounding, over many rounds
    torch.manual_seed(2)
    start = {"w": torch.randn(4096) * 0.02}
    exact, half = {"w": start["w"].clone()}, {"w": start["w"].clone()}
    full, narrow = NesterovOuter(0.7, 0.9), NesterovOuter(0.7, 0.9, torch.bfloat16)
    for _ in range(100):
        g = torch.randn(4096) * 1e-3 + 5e-4  # noise around a steady direction
        full.step(exact, {"w": g})
        narrow.step(half, {"w": g})
    assert narrow.buffers["w"].dtype == torch.bfloat16 and half["w"].dtype == torch.float32
    moved, off = (exact["w"] - start["w"]).norm(), (half["w"] - exact["w"]).norm()
    assert 0 < off < 0.01 * moved, (off, moved)  # rounded, not lost nor scaled


def test_pseudo_gradient_and_average():
    start, now = _model(1.0), _model(0.25)
    assert torch.allclose(pseudo_gradient(start, now)["w"], torch.full((3, 2), 0.75))
    mean = average([_model(1.0), _model(2.0), _model(6.0)])
    assert torch.allclose(mean["b"], torch.full((2,), 3.0))
    with pytest.raises(ValueError):
        average([])


def test_fresh_deltas_use_each_update_once_and_drop_stale_ones():
    offered = {"a": 5, "b": 4, "c": 3, "d": 5}
    assert fresh_deltas(5, offered, {"d": 5}, max_staleness=1) == ["a", "b"]
    assert fresh_deltas(5, offered, {}, max_staleness=0) == ["a", "d"]


def _gossip_digits(mode: str, steps: int = 300, gamma: float = 0.05) -> tuple[list[float], float]:
    """4 digits-mlp trainers, pairwise gossip every 2 steps with topk:0.01, in one process."""
    torch.manual_seed(0)
    rng = random.Random(0)
    trainers = [
        Trainer(resolve_task("digits-mlp")(TaskContext(shard_index=i, num_shards=4)))
        for i in range(4)
    ]
    base = trainers[0].snapshot()  # every node starts here (same seed)
    codec = compress.get_codec("topk:0.01")
    links: dict[tuple[int, int], dict[int, dict]] = {}

    def wire(d):
        data = compress.encode_named(sorted(d.items()), codec)
        return dict(compress.decode_named(data, max_numel=10**7))

    for step in range(1, steps + 1):
        for t in trainers:
            t.train_step()
        if step % 2:
            continue
        for i in range(4):
            j = rng.choice([k for k in range(4) if k != i])
            a, b = trainers[i], trainers[j]
            if mode == "choco":
                est = links.setdefault(
                    (min(i, j), max(i, j)),
                    {k: {n: t.clone() for n, t in base.items()} for k in (i, j)},
                )
                q_a, q_b = (
                    wire(choco_difference(a.params(), est[i])),
                    wire(choco_difference(b.params(), est[j])),
                )
                choco_update_estimate(est[i], q_a)
                choco_update_estimate(est[j], q_b)
                a.update(
                    lambda live, e=est, i=i, j=j: choco_consensus(live, e[i], e[j], gamma=gamma)
                )
                b.update(
                    lambda live, e=est, i=i, j=j: choco_consensus(live, e[j], e[i], gamma=gamma)
                )
            else:  # plain averaging of top-k-compressed models (adpsgd with codec topk:0.01)
                s_a, s_b = a.snapshot(), b.snapshot()
                r_a, r_b = wire(s_a), wire(s_b)
                a.update(lambda live, s=s_a, r=r_b: pairwise_mix(live, s, r))
                b.update(lambda live, s=s_b, r=r_a: pairwise_mix(live, s, r))
    accuracy = [t.evaluate() for t in trainers]
    return accuracy, consensus_distance([t.params() for t in trainers], relative=True)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # small model: more threads only stall on the shared machine
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_choco_converges_with_topk_where_plain_topk_averaging_does_not(one_thread):
    # In one process (no network), same shards, same schedule, same codec (topk:0.01).
    choco_acc, choco_spread = _gossip_digits("choco")
    plain_acc, _ = _gossip_digits("plain")
    assert min(choco_acc) >= 0.90, choco_acc
    assert max(plain_acc) < 0.6, plain_acc  # top-k of a whole model zeroes most weights
    # and choco's models agree: their spread is well under that of the same shards alone
    torch.manual_seed(0)
    alone = [
        Trainer(resolve_task("digits-mlp")(TaskContext(shard_index=i, num_shards=4)))
        for i in range(4)
    ]
    for t in alone:
        for _ in range(300):
            t.train_step()
    assert choco_spread < 0.5 * consensus_distance([t.params() for t in alone], relative=True)
