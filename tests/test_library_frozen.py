"""Fine-tuning with a frozen base through geotrain.join: what trains is averaged, what is frozen
stays as each peer loaded it, and peers that froze other parameters or loaded other frozen values
are told so instead of training a mix."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from test_library import PACE_S, config, distance, joined, make_model, train

import geotrain
from geotrain.node import ConfigError
from geotrain.node.training import LoopTrainer


def fine_tuned(base_seed: int = 0, head_seed: int = 0, freeze: int = 0) -> torch.nn.Module:
    """make_model's network with layer `freeze` frozen: a 'pretrained' base from `base_seed`
    (what every peer loads), the rest from `head_seed`."""
    model = make_model(head_seed)
    base = make_model(base_seed)
    with torch.no_grad():
        model[freeze].load_state_dict(base[freeze].state_dict())
    model[freeze].requires_grad_(False)
    return model


def test_a_frozen_base_is_neither_averaged_nor_synced_and_the_head_trains_together(tmp_path):
    models = [fine_tuned(head_seed=0), fine_tuned(head_seed=0)]
    base = {k: v.clone() for k, v in models[0][0].state_dict().items()}
    # int8 exchanges would move every value they average: a frozen base averaged would change
    extra = ('gossip.codec="int8"',)
    with joined(tmp_path, "a", models[0], *extra) as a:
        with joined(tmp_path, "b", models[1], *extra,
                    f'network.bootstrap=["{a.address}"]') as b:  # fmt: skip
            threads = [threading.Thread(target=train, args=(s, m, 200, i, PACE_S))
                       for i, (s, m) in enumerate([(a, models[0]), (b, models[1])])]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            statuses = [a.status(), b.status()]
    assert all(s.step == 200 and s.exchanges_ok >= 3 for s in statuses), statuses
    for model in models:  # bit for bit what was loaded
        for name, value in model[0].state_dict().items():
            assert torch.equal(value, base[name]), name
    # the heads were averaged: far closer than two loops alone
    alone = [fine_tuned(head_seed=0), fine_tuned(head_seed=0)]
    for i, m in enumerate(alone):
        from test_library import _train_alone

        _train_alone(m, 200, i)
    assert distance(*models) < 0.5 * distance(*alone), (distance(*models), distance(*alone))


def test_only_the_parameters_that_train_at_join_are_exchanged_and_counted_in_memory(tmp_path):
    from geotrain.node._memory import estimate_memory
    from geotrain.node.algorithms import algorithm_specs

    model = fine_tuned()
    loop = LoopTrainer(model)
    assert sorted(loop.params()) == ["2.bias", "2.weight"]
    assert loop.frozen_numel == 8 * 16 + 16
    estimate = estimate_memory(config(tmp_path, "m"), loop, algorithm_specs()["adpsgd"])
    assert estimate.numel == 17 and estimate.frozen_gb == pytest.approx(144 * 4 / 1e9)
    assert "GB frozen" in estimate.explain()


@pytest.mark.parametrize(
    ("theirs", "what"),
    [
        (lambda: fine_tuned(base_seed=1), "other frozen values (another base)"),
        (lambda: fine_tuned(freeze=2), "another layer frozen"),
    ],
)
def test_a_peer_with_another_frozen_base_is_told_at_join(tmp_path, theirs, what):
    first = joined(tmp_path, "a", fine_tuned(), "training.wait_for_peers=0")
    try:
        with pytest.raises(ConfigError, match=r"the model differs .* froze other parameters .* "
                           r"[0-9]+ frozen.* load the same frozen values"):  # fmt: skip
            joined(tmp_path, "b", theirs(), f'network.bootstrap=["{first.address}"]',
                   "training.wait_for_peers=1")  # fmt: skip
    finally:
        first.close()


def test_a_base_loaded_in_bfloat16_digests_as_the_same_base_in_float32():
    ours, theirs = fine_tuned(), fine_tuned()
    theirs[0].to(torch.bfloat16)
    assert LoopTrainer(ours).frozen_digest == LoopTrainer(theirs).frozen_digest != 0
    assert LoopTrainer(fine_tuned(base_seed=1)).frozen_digest != LoopTrainer(ours).frozen_digest
    assert LoopTrainer(make_model()).frozen_digest == 0  # nothing frozen: plans as before


def test_freezing_everything_or_unfreezing_after_join_is_a_clear_error_or_warning():
    everything = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter is frozen"):
        LoopTrainer(everything)
    model = fine_tuned()
    loop = LoopTrainer(model)
    model[0].requires_grad_(True)  # unfrozen after join, before wrap
    with pytest.raises(ValueError, match=r"trains 2 parameter\(s\) that were frozen .* joined"):
        loop.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop.attach(opt)  # frozen params in the optimizer are fine: it never steps them
    model[0].requires_grad_(True)  # unfrozen after wrap: warned once
    with capture_logs() as logs:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            loop.stepped(opt.step, 0.0)
    said = [e for e in logs if e["event"] == "unfrozen_after_join"]
    assert len(said) == 1 and said[0]["parameters"] == ["0.weight", "0.bias"], said


def test_freezing_between_join_and_wrap_is_warned():
    """A stranger froze the base after join: it travelled in every exchange and int8 moved it,
    silently."""
    model = make_model()
    loop = LoopTrainer(model)
    model[0].requires_grad_(False)
    with capture_logs() as logs:
        loop.attach(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    said = [e for e in logs if e["event"] == "frozen_after_join"]
    assert len(said) == 1 and said[0]["parameters"] == ["0.weight", "0.bias"], said


def test_join_refuses_a_model_with_every_parameter_frozen(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text("[identity]\nopen_swarm = true\n")
    with pytest.raises(ValueError, match="every parameter is frozen"):
        geotrain.join(Path(toml), make_model().requires_grad_(False))


def test_checkpoints_leave_the_frozen_base_out_and_a_resume_keeps_the_one_loaded():
    """A 7B base rewritten at every checkpoint (under the model lock) would be 14 GB a time;
    and a resume that took the checkpoint's frozen values split the swarm when they differed."""
    saved = LoopTrainer(fine_tuned(base_seed=0))
    tensors, meta = saved.state_tensors()
    assert sorted(tensors) == ["model/2.bias", "model/2.weight"]
    assert meta["frozen_digest"] == saved.frozen_digest
    model = fine_tuned(base_seed=0, head_seed=5)
    base = model[0].weight.detach().clone()
    with capture_logs() as logs:
        LoopTrainer(model).restore(tensors, meta, 7)
    assert torch.equal(model[2].weight, saved.model[2].weight)  # the head resumed
    assert torch.equal(model[0].weight, base)
    assert not [e for e in logs if e["event"] == "frozen_parameters_differ"]
    # a checkpoint holding the frozen values too (written before they were left out) with
    # another base: the base loaded now stays, and it is said
    old = {f"model/{k}": v for k, v in fine_tuned(base_seed=1).state_dict().items()}
    other = fine_tuned(base_seed=0)
    with capture_logs() as logs:
        LoopTrainer(other).restore(old, {**meta, "frozen_digest": 12345}, 7)
    assert torch.equal(other[0].weight, base)
    assert [e["event"] for e in logs].count("frozen_parameters_differ") == 1
    with pytest.raises(RuntimeError, match=r"missing \['2.bias'\]"):
        LoopTrainer(fine_tuned()).restore({"model/2.weight": tensors["model/2.weight"]}, meta, 7)


def test_the_digest_sees_a_tensors_last_values_and_reads_a_transposed_one_in_place():
    ours, theirs = fine_tuned(), fine_tuned()
    with torch.no_grad():
        theirs[0].weight[-1, -1] += 1.0  # the last value (a resized embedding's new rows)
    assert LoopTrainer(ours).frozen_digest != LoopTrainer(theirs).frozen_digest
    a = torch.nn.Linear(300, 200)
    b = torch.nn.Linear(300, 200)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)
        b.weight = torch.nn.Parameter(b.weight.detach().t().contiguous().t())  # non-contiguous
    for layer in (a, b):
        layer.weight.requires_grad_(False)
    assert not b.weight.is_contiguous()
    assert LoopTrainer(a).frozen_digest == LoopTrainer(b).frozen_digest


def test_parameters_on_the_meta_device_or_lazy_buffers_are_refused_with_what_to_do():
    with torch.device("meta"):
        empty = make_model()
    with pytest.raises(ValueError, match="on the meta device"):
        LoopTrainer(empty)
    lazy = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LazyBatchNorm1d(affine=False))
    with pytest.raises(ValueError, match=r"\['1.running_mean'.*not initialized yet"):
        LoopTrainer(lazy)


def test_a_diloco_resume_after_freezing_one_more_layer_starts_its_round_afresh(tmp_path):
    """diloco's checkpointed round start held the layer frozen since: the first round end
    raised KeyError and the node died."""
    extra = ('gossip.algorithm="diloco"', "gossip.diloco.inner_steps=5",
             "training.wait_for_peers=0")  # fmt: skip
    with joined(tmp_path, "a", make_model(), *extra) as swarm:
        train(swarm, swarm._loop.model, 12, 0)
    model = fine_tuned()
    with capture_logs() as logs:
        with joined(tmp_path, "a", model, *extra) as swarm:
            train(swarm, model, 12, 0)
            assert swarm.step == 24
    # a round end ran on the restored parameters (the KeyError came at the first; close()
    # finishes the round end under way, and steps queued behind it on a slow box are dropped)
    events = [e["event"] for e in logs]
    assert events.count("diloco_state_dropped") == 1 and events.count("outer_step") >= 1, events


def test_a_resumed_node_whose_base_the_swarm_refuses_stops_instead_of_training_alone(tmp_path):
    """State sync checks a joiner's model; a node resuming from its own checkpoint skips it,
    and with another base every exchange it started failed at info level while opt.step()
    went on (a stranger's find). Two peers refusing and none accepting: it stops, cleanly."""
    odd = fine_tuned(base_seed=1)
    with joined(tmp_path, "odd", odd, "training.wait_for_peers=0") as swarm:
        train(swarm, odd, 3, 0)  # its own checkpoint: it resumes, no state sync
    with joined(tmp_path, "a", fine_tuned(), "training.wait_for_peers=0") as a:
        with joined(tmp_path, "b", fine_tuned(), f'network.bootstrap=["{a.address}"]') as b:
            threads = [threading.Thread(target=train, args=(s, s._loop.model, 150, i))
                       for i, s in enumerate([a, b])]  # fmt: skip
            for t in threads:
                t.start()
            swarm = joined(tmp_path, "odd", odd, f'network.bootstrap=["{a.address}"]',
                           "training.wait_for_peers=2")  # fmt: skip
            try:
                with pytest.raises(geotrain.LoopClosed) as stopped:
                    train(swarm, odd, 10_000, 2)
            finally:
                with contextlib.suppress(geotrain.LoopClosed):  # (it failed: said again)
                    swarm.close()
            for t in threads:
                t.join(120)
            assert a.status().exchanges_ok >= 1 and b.status().step == 150  # they went on
    cause = stopped.value.__cause__
    assert isinstance(cause, ConfigError) and "refused this node's exchanges" in str(cause)
    assert "none accepted one" in str(cause) and "144 frozen" in str(cause)
