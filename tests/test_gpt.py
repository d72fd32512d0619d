"""The `gpt` task: named sizes, causal masking, bits per byte, its held-out slice, bad params."""

from __future__ import annotations

import pytest
import torch

from geotrain.node import TaskContext, Trainer, resolve_task
from geotrain.node.training._gpt import GPT, SIZES

SMALL = {"d_model": 64, "layers": 2, "heads": 2, "context": 64, "max_bytes": 200_000}


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# the ranges the docs (reference/tasks.md) state for each named size
RANGES = {"1m": (0.8e6, 1.25e6), "5m": (4e6, 6e6), "10m": (8e6, 12.5e6), "25m": (20e6, 30e6)}


@pytest.mark.parametrize("size", sorted(SIZES))
def test_each_named_size_has_the_parameters_its_name_says(size):
    task = resolve_task("gpt")(TaskContext(params={"size": size, "max_bytes": 20_000}))
    low, high = RANGES[size]
    assert low <= _params(task.model) <= high


def test_explicit_shape_params_override_the_named_size():
    task = resolve_task("gpt")(TaskContext(params={"size": "25m", **SMALL}))
    d, layers = SMALL["d_model"], SMALL["layers"]
    # blocks: 12 d^2 + two LayerNorms; embeddings of 256 bytes and 64 positions; norm; head
    expected = layers * (12 * d * d + 4 * d) + 256 * d + 64 * d + 2 * d + 256 * d
    assert _params(task.model) == expected


def test_a_later_byte_never_changes_the_logits_of_earlier_positions():
    torch.manual_seed(0)
    model = GPT(context=32, d_model=32, layers=2, heads=4).eval()
    tokens = torch.randint(0, 256, (3, 32))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])  # positions before 20 cannot see it
    assert not torch.allclose(a[:, 20:], b[:, 20:])  # position 20 on do


def test_bits_per_byte_start_near_8_and_fall_with_training():
    task = resolve_task("gpt")(TaskContext(params=SMALL))
    assert task.metric == "bits_per_byte" and not task.higher_is_better
    trainer = Trainer(task)
    before = trainer.evaluate()
    assert before == pytest.approx(8.0, abs=0.3)  # a uniform guess over 256 bytes is 8 bits
    for _ in range(60):
        trainer.train_step()
    after = trainer.evaluate()
    assert after < before - 2.0
    assert task.reached(after, before - 1.0) and not task.reached(before, after)


def test_the_held_out_slice_is_fixed_and_the_same_on_every_node():
    a = resolve_task("gpt")(TaskContext(shard_index=0, num_shards=2, params=SMALL))
    b = resolve_task("gpt")(TaskContext(shard_index=1, num_shards=2, params=SMALL))
    assert a.evaluate(a.model) == a.evaluate(a.model) == b.evaluate(b.model)
    xa, ya = next(a.batches)
    xb, _ = next(b.batches)
    assert xa.shape == (16, 64) and xa.dtype == torch.int64 and not torch.equal(xa, xb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # the targets are the next bytes


def test_a_users_directory_is_the_corpus(tmp_path):
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 500)
    params = {**SMALL, "corpus": str(tmp_path), "files": "*.txt"}
    task = resolve_task("gpt")(TaskContext(params=params))
    x, _ = next(task.batches)
    assert set(x.flatten().tolist()) <= set(b"the quick brown fox jumps over the lazy dog\n")


def test_the_schedule_params_set_the_recipe_every_system_trains_by():
    # the testbed's DDP, local SGD and hivemind ranks build their optimizer and schedule from
    # task.recipe, as a node's Trainer does: a run of few, large steps can shorten the warmup
    # for all of them alike
    task = resolve_task("gpt")(
        TaskContext(params={**SMALL, "warmup_steps": 2, "total_steps": 100})
    )
    assert (task.recipe.warmup_steps, task.recipe.total_steps) == (2, 100)
    trainer = Trainer(task)
    assert trainer.recipe.lr_factor(0) == pytest.approx(0.5)
    assert trainer.recipe.lr_factor(2) == pytest.approx(1.0)  # warmed up after two steps
    assert trainer.recipe.lr_factor(100) == pytest.approx(trainer.recipe.min_lr_ratio)
    default = resolve_task("gpt")(TaskContext(params=SMALL)).recipe
    assert (default.warmup_steps, default.total_steps) == (20, 2000)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"size": "3m"}, "training.params.size='3m': expected one of"),
        ({"heads": 5}, "training.params.heads=5: expected a divisor of d_model (128)"),
        ({"d_model": 0}, "training.params.d_model=0: expected an integer >= 1"),
        ({"layers": 2.5}, "training.params.layers=2.5: expected int"),
        ({"context": 1}, "training.params.context=1: expected an integer >= 2"),
        ({"batch_size": -1}, "training.params.batch_size=-1"),
        ({"corpus": "/no/such/dir"}, "training.params.corpus='/no/such/dir': not a directory"),
        ({"max_bytes": 100}, "training.params.max_bytes=100: expected an integer >= 10000"),
        ({"warmup_steps": -1}, "training.params.warmup_steps=-1: expected an integer >= 0"),
        ({"warmup_steps": 50, "total_steps": 50},
         "training.params.total_steps=50: expected more than warmup_steps (50)"),
        ({"warmup_steps": 3000},
         "training.params.warmup_steps=3000: expected fewer than total_steps"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, message):
    with pytest.raises(ValueError) as info:
        resolve_task("gpt")(TaskContext(params=params))
    assert message in str(info.value)
