"""A task's training recipe: what the daemon uses where the config is silent, what the user's
settings change, and the same optimizer in the testbed's DDP and hivemind workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geotrain.node import (
    Admission,
    ConfigError,
    Identity,
    TaskContext,
    Trainer,
    config_from_toml,
    resolve_task,
)
from geotrain.node._node import Node
from geotrain.node.training._recipe import Recipe, schedule_factor
from geotrain.testbed._ddp import task_optimizer
from geotrain.testbed._hivemind import follow_recipe

GPT_SMALL = {"d_model": 32, "layers": 1, "heads": 2, "context": 32, "max_bytes": 50_000}


def _gpt():
    return resolve_task("gpt")(TaskContext(params=GPT_SMALL))


def _hyper(opt: torch.optim.Optimizer) -> tuple[type, list[dict]]:
    """The optimizer's class and its param groups' settings (without the tensors)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return type(opt), groups


def _lrs(opt, scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_a_task_that_states_no_recipe_trains_as_before():
    task = resolve_task("digits-mlp")(TaskContext())
    trainer = Trainer(task)
    assert type(trainer.optimizer) is torch.optim.SGD
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == task.lr and group["momentum"] == 0.9 and group["weight_decay"] == 0
    assert trainer.clip_grad_norm is None
    for _ in range(3):
        trainer.train_step()
    assert trainer.optimizer.param_groups[0]["lr"] == task.lr  # constant


def test_the_gpt_recipe_is_used_where_the_trainer_is_told_nothing():
    task = _gpt()
    trainer = Trainer(task)
    assert type(trainer.optimizer) is torch.optim.AdamW
    assert trainer.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    assert trainer.clip_grad_norm == 1.0
    warmup = task.recipe.warmup_steps
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(task.lr / warmup)
    for _ in range(warmup):
        trainer.train_step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(task.lr)  # warmed up


def test_a_users_setting_wins_over_the_tasks_recipe_one_by_one():
    trainer = Trainer(_gpt(), optimizer="sgd", weight_decay=0.0, schedule="constant",
                      warmup_steps=0, clip_grad_norm=0.0, lr=0.01)  # fmt: skip
    assert type(trainer.optimizer) is torch.optim.SGD and trainer.clip_grad_norm is None
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.0
    assert trainer.optimizer.param_groups[0]["lr"] == 0.01
    # only the optimizer changed: the rest of the recipe stays
    adam = Trainer(_gpt(), optimizer="adam")
    assert type(adam.optimizer) is torch.optim.Adam and adam.clip_grad_norm == 1.0
    assert adam.recipe.schedule == "cosine"
    assert adam.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1)


def _node_trainer(tmp_path: Path, training: str) -> tuple[Node, Trainer]:
    text = ('[identity]\nkey = "me.key"\nopen_swarm = true\n[training]\ntask = "gpt"\n'
            f"{training}\n[training.params]\n" + "\n".join(
                f"{k} = {v}" for k, v in GPT_SMALL.items()))  # fmt: skip
    config = config_from_toml(text, base=tmp_path)
    node = Node(config, Identity.generate(), Admission.open_swarm("geotrain"))
    trainer = node._build_training().trainer
    return node, trainer


def test_the_daemon_takes_the_tasks_recipe_for_what_its_config_leaves_unset(tmp_path):
    node, trainer = _node_trainer(tmp_path, "threads = 1")
    assert trainer.recipe == resolve_task("gpt")(TaskContext(params=GPT_SMALL)).recipe
    assert type(trainer.optimizer) is torch.optim.AdamW
    # weights, gradients, AdamW's two moments, and its step's temporaries (twice the largest
    # tensor over the model's size: torch's one-tensor-at-a-time step on CPU)
    params = list(trainer.params().values())
    largest = 2 * max(p.numel() for p in params) / sum(p.numel() for p in params)
    assert 0 < largest < 1 and node.memory.plain_copies == pytest.approx(4.0 + largest)
    settings = (
        'optimizer = "sgd"\nweight_decay = 0.0\nclip_grad_norm = 0\nschedule = "linear"\n'
        "total_steps = 500\nmin_lr_ratio = 0.0"
    )
    _, mine = _node_trainer(tmp_path, settings)
    assert type(mine.optimizer) is torch.optim.SGD and mine.clip_grad_norm is None
    assert mine.recipe.schedule == "linear" and mine.recipe.total_steps == 500
    assert mine.recipe.warmup_steps == 20  # the one setting left unset: the task's
    assert mine.optimizer.param_groups[0]["weight_decay"] == 0.0


def test_config_keeps_unset_apart_from_zero_and_names_bad_values():
    base = '[identity]\nkey = "k"\nopen_swarm = true\n[training]\n'
    t = config_from_toml(base, base=Path("/x")).training
    assert (t.optimizer, t.weight_decay, t.warmup_steps, t.schedule, t.total_steps,
            t.min_lr_ratio, t.clip_grad_norm) == (None,) * 7  # fmt: skip
    t = config_from_toml(base + "weight_decay = 0\nclip_grad_norm = 0\n", base=Path("/x")).training
    assert t.weight_decay == 0.0 and t.clip_grad_norm == 0.0
    for line, message in [
        ("min_lr_ratio = 2", "training.min_lr_ratio = 2.0: expected 0..1"),
        ("clip_grad_norm = -1", "training.clip_grad_norm = -1.0: expected >= 0"),
        ('schedule = "cosine"\ntotal_steps = 5\nwarmup_steps = 9', "training.total_steps = 5"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_toml(base + line, base=Path("/x"))


def test_a_recipe_merged_into_nonsense_names_the_field():
    with pytest.raises(ValueError, match="training.total_steps=0: expected > training.warmup"):
        Trainer(resolve_task("digits-mlp")(TaskContext()), schedule="cosine")
    with pytest.raises(ValueError, match="training.optimizer='lamb'"):
        Recipe(optimizer="lamb")


def test_the_decay_ends_at_its_floor_and_stays_there():
    assert schedule_factor(14, 4, 14, "cosine", floor=0.1) == pytest.approx(0.1)
    assert schedule_factor(99, 4, 14, "linear", floor=0.1) == pytest.approx(0.1)
    assert schedule_factor(9, 4, 14, "cosine", floor=0.1) == pytest.approx(0.55)


@pytest.mark.parametrize("name", ["digits-mlp", "gpt"])
def test_the_ddp_worker_builds_the_daemons_optimizer_and_schedule(name):
    params = GPT_SMALL if name == "gpt" else {}
    daemon = Trainer(resolve_task(name)(TaskContext(params=params)))
    task = resolve_task(name)(TaskContext(params=params))
    opt, scheduler = task_optimizer(task, task.model.parameters())
    assert _hyper(opt) == _hyper(daemon.optimizer)
    assert _lrs(opt, scheduler, 30) == _lrs(daemon.optimizer, daemon.scheduler, 30)
    assert task.recipe == daemon.recipe  # and so the same clipping (recipe.clip)


def test_the_hivemind_worker_follows_the_recipe_per_local_step():
    task = _gpt()
    daemon = Trainer(_gpt())
    inner = task.recipe.build_optimizer(task.model.parameters(), task.lr)  # what hivemind holds
    assert _hyper(inner)[0] is type(daemon.optimizer)
    expected = _lrs(daemon.optimizer, daemon.scheduler, 30)
    for step in range(30):
        task.loss(task.model, next(task.batches)).mul(1e4).backward()  # a gradient to clip
        follow_recipe(task, inner, task.lr, step)
        norm = torch.nn.utils.clip_grad_norm_(task.model.parameters(), float("inf"))
        assert inner.param_groups[0]["lr"] == pytest.approx(expected[step])
        assert float(norm) <= 1.0 + 1e-4
        inner.step()
        inner.zero_grad()
