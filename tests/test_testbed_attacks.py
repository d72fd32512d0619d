"""Byzantine peers (testbed only): each attack kind against 6 honest digits peers in the in-memory
harness, with and without robust mixing; the forged models themselves; an attack cannot be
enabled from a node's config; the scenario's [[attackers]] section."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import torch
from _swarm import LocalSwarm

from geotrain.node import ConfigError
from geotrain.node._config import config_from_toml
from geotrain.testbed._attacker import attacker_argv
from geotrain.testbed._attacks import Attack, AttackError, alie_z
from geotrain.testbed._byzantine import run_swarm as _run_swarm
from geotrain.testbed._scenario import ATTACK_KINDS, ScenarioError, scenario_from_dict

STEPS = 200
TWO_OF_EIGHT = (6, 7)


def run_swarm(**kwargs):
    """testbed._byzantine.run_swarm with the peers' log events below warning dropped: rendering
    eight peers' debug lines (every exchange) took a quarter of a run's time, and nothing here
    reads them (conftest's fixture resets the configuration after each test)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        return _run_swarm(**kwargs)
    finally:
        structlog.reset_defaults()


@pytest.fixture(scope="module")
def no_attack() -> float:
    """The honest peers' worst accuracy without attackers (plain averaging)."""
    return run_swarm(steps=STEPS).worst


@pytest.mark.slow
@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_robust_mixing_keeps_every_honest_peer_within_bounds(kind, no_attack):
    result = run_swarm(attackers=dict.fromkeys(TWO_OF_EIGHT, kind), robust="clip", steps=STEPS)
    assert no_attack > 0.85  # the task is learnt at all in STEPS steps
    assert result.worst >= 0.95 * no_attack, (kind, result.honest)
    if kind == "nan":
        assert result.rejected > 0  # refused by validation, never mixed
    else:
        assert result.clipped > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sign_flip", "ipm", "replay", "noise"])  # label_flip: ~-8%
def test_without_robust_mixing_the_strong_attacks_hurt(kind, no_attack):
    # Without robust mixing the damage varies from run to run (testbed/_byzantine.py says why):
    # under sign flip the worst honest peer ended at 0.19-0.74 in six runs here and at 0.78 once
    # in CI, where 0.85 x the clean run was below that (the clean run at most 0.92); a tenth
    # below the clean run is the bound. Later, 0.20-0.82 of the clean run in nine runs here and
    # 0.92 once in CI: a run that stays above the bound is followed by a second, which must not
    # (both above: about one in a hundred if one in ten is)
    results = []
    while len(results) < 2 and (not results or results[-1].worst >= 0.9 * no_attack):
        results.append(run_swarm(attackers=dict.fromkeys(TWO_OF_EIGHT, kind), robust="none",
                                 steps=STEPS))  # fmt: skip
    assert results[-1].worst < 0.9 * no_attack, (kind, [r.honest for r in results], no_attack)


@pytest.mark.slow
def test_dpsgd_with_trimmed_mean_holds_against_sign_flipping():
    attackers = dict.fromkeys(TWO_OF_EIGHT, "sign_flip")
    clean = run_swarm(steps=STEPS, algorithm="dpsgd")
    plain = run_swarm(attackers=attackers, robust="none", steps=STEPS, algorithm="dpsgd")
    trimmed = run_swarm(attackers=attackers, robust="trim", steps=STEPS, algorithm="dpsgd")
    assert trimmed.trimmed_rounds > 0
    assert trimmed.worst >= 0.95 * clean.worst, (trimmed.honest, clean.honest)
    assert plain.worst < 0.9 * clean.worst, (plain.honest, clean.honest)


def test_the_forged_models_are_what_each_attack_says():
    x0 = {"w": torch.zeros(3)}
    own = {"w": torch.tensor([1.0, 2.0, 3.0])}
    honest = [{"w": torch.tensor([1.0, 1.0, 1.0])}, {"w": torch.tensor([3.0, 3.0, 3.0])}]

    def forged(kind: str) -> torch.Tensor:
        attack = Attack(kind, x0, n_peers=8, n_attackers=2)
        attack.observe(honest)
        return attack.forge(own)["w"]

    assert torch.equal(forged("sign_flip"), -own["w"])
    std = torch.stack([h["w"] for h in honest]).std(dim=0)
    assert torch.allclose(forged("alie"), 2.0 - alie_z(8, 2) * std)
    assert torch.allclose(forged("ipm"), torch.full((3,), -1.0))  # x0 - 0.5 (mean - x0)
    assert torch.equal(forged("replay"), x0["w"])
    assert bool(torch.isnan(forged("nan")).all())
    assert not torch.equal(forged("noise"), own["w"])
    assert torch.equal(forged("label_flip"), own["w"])
    assert torch.equal(own["w"], torch.tensor([1.0, 2.0, 3.0]))  # never changed in place
    with pytest.raises(AttackError, match="attack 'flood'"):
        Attack("flood", x0)


def test_a_node_config_cannot_enable_an_attack():
    base, ident = Path("."), "[identity]\nopen_swarm = true\n"
    with pytest.raises(ConfigError, match=r"attack = .*expected one of the sections"):
        config_from_toml(ident + '[attack]\nkind = "sign_flip"\n', base=base)
    with pytest.raises(ConfigError, match=r"gossip.attack = 'sign_flip': expected one of the keys"):
        config_from_toml(ident + '[gossip]\nattack = "sign_flip"\n', base=base)
    with pytest.raises(ConfigError, match=r"training.attack = 'label_flip'"):
        config_from_toml(ident + '[training]\nattack = "label_flip"\n', base=base)


def test_a_scenario_names_its_attackers_and_refuses_bad_ones():
    doc = {
        "regions": [{"name": "lan", "peers": 4}],
        "links": {"inside": {"delay_ms": 1}},
        "attackers": [{"peer": 2, "kind": "alie"}, {"peer": 3, "kind": "ipm"}],
    }
    sc = scenario_from_dict(doc)
    assert sc.attackers == {2: "alie", 3: "ipm"}
    assert scenario_from_dict(sc.to_json()).attackers == sc.attackers
    assert sc.with_peers(3).attackers == {2: "alie"}
    with pytest.raises(ScenarioError, match=r"attackers\[3\].kind = 'flood'"):
        scenario_from_dict({**doc, "attackers": [{"peer": 3, "kind": "flood"}]})
    with pytest.raises(ScenarioError, match=r"attackers.peer = 9: expected a peer index in 0..3"):
        scenario_from_dict({**doc, "attackers": [{"peer": 9, "kind": "nan"}]})
    with pytest.raises(ScenarioError, match=r"attackers\[0\]"):
        scenario_from_dict({**doc, "attackers": [{"peer": 1}]})
    restart = {"faults": [{"at_s": 1, "action": "restart", "peer": 2}]}
    with pytest.raises(ScenarioError, match="no restart of an attacker"):
        scenario_from_dict({**doc, **restart})


@pytest.mark.slow
def test_the_attacker_process_is_a_node_whose_neighbours_clip_it(tmp_path):
    # Two real honest nodes (robust = clip) and the testbed's attacker entry point (sign flip) on
    # loopback: the attacker says it is armed, the honest nodes clip it and still learn. The three
    # run together until both honest nodes have evaluated at step 300, then all are stopped: with
    # a max_steps each, the first honest node to finish left the other with the attacker as its
    # only partner, more than clipping promises to withstand (gossip/_robust.py: fewer than 3/4
    # of a node's updates Byzantine), and that one ended at 0.38 / 0.62 (once in CI, once in 22
    # runs here).
    swarm = LocalSwarm(tmp_path, {
        "training": {"task": "digits-mlp", "max_steps": 100_000, "num_shards": 3,
                     "eval_every": 50, "threads": 1, "wait_for_peers": 2},
        "gossip": {"state_sync": False, "robust": "clip"},
    })  # fmt: skip
    first = swarm.start(swarm.add("first", training={"shard_index": 0}))
    try:
        bootstrap = {"bootstrap": [first.address(120)]}
        second = swarm.start(swarm.add("second", training={"shard_index": 1}, network=bootstrap))
        bad = swarm.add("bad", training={"shard_index": 2}, network=bootstrap)
        bad.argv = attacker_argv(bad.config, [], "sign_flip", 3, 1)
        bad.start()

        def evaluated_at_300() -> bool:
            statuses = [node.status() for node in (first, second)]
            return all(s is not None and (s["metric_step"] or 0) >= 300 for s in statuses)

        swarm.wait_until(evaluated_at_300, 300, "both honest nodes evaluated at step 300")
        statuses = {node.name: node.status() for node in (first, second)}
        for node in (first, second, bad):
            assert node.proc.poll() is None, node.log_text()  # all three ran to the end
    finally:
        swarm.stop_all()
    assert '"event": "attacker_armed"' in bad.log_text()
    for name, status in statuses.items():
        assert status["algorithm_stats"]["robust_clipped"] > 0, name
        assert status["metric"] > 0.8, (name, status["metric"])


@pytest.mark.parametrize(("task", "params", "classes"),
                         [("digits-mlp", {}, 10), ("charlm", {"max_bytes": 20_000}, 256)])
def test_label_flip_flips_every_label_within_the_models_classes(task, params, classes):
    from geotrain.node import TaskContext, Trainer, resolve_task
    from geotrain.testbed._attacks import arm

    honest = resolve_task(task)(TaskContext(shard_index=0, num_shards=2, params=params))
    poisoned = Trainer(resolve_task(task)(TaskContext(shard_index=0, num_shards=2, params=params)))
    arm(poisoned, Attack("label_flip", poisoned.snapshot()))
    for _ in range(3):  # the same shard, the same order: each label y became classes - 1 - y
        (x, y), (px, py) = next(honest.batches), next(poisoned.task.batches)
        assert torch.equal(x, px) and torch.equal(py, classes - 1 - y)


def test_label_flip_refuses_a_task_without_integer_labels():
    from geotrain.node import TaskContext, Trainer, resolve_task
    from geotrain.testbed._attacks import arm

    trainer = Trainer(resolve_task("synthetic-linreg")(TaskContext()))  # float targets
    arm(trainer, Attack("label_flip", trainer.snapshot()))
    with pytest.raises(AttackError, match="needs a classification task"):
        next(trainer.task.batches)
