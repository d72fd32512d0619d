"""Built-in tasks, task resolution and data sharding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geotrain.node.training._builtin import load_digits
from geotrain.node.training._tasks import TaskContext, resolve_task, shard_indices


def test_shipped_digits_are_the_full_set():
    images, labels = load_digits()
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    assert 0.0 <= images.min() and images.max() == 1.0
    assert sorted(np.bincount(labels)) == sorted([178, 182, 177, 183, 181, 182, 181, 179, 174, 180])


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_shards_are_disjoint_and_cover_everything(partition):
    labels = np.random.default_rng(0).integers(0, 10, size=1000)
    shards = [
        shard_indices(labels, TaskContext(shard_index=i, num_shards=4, seed=3, partition=partition))
        for i in range(4)
    ]
    together = np.concatenate(shards)
    assert len(together) == 1000 and len(np.unique(together)) == 1000


def test_dirichlet_skews_labels_and_iid_does_not():
    labels = np.repeat(np.arange(10), 100)

    def label_share(partition, alpha):
        ctx = TaskContext(shard_index=0, num_shards=4, seed=1, partition=partition, alpha=alpha)
        counts = np.bincount(labels[shard_indices(labels, ctx)], minlength=10)
        return counts.max() / max(counts.sum(), 1)

    assert label_share("iid", 0.5) < 0.2  # about 1/10 each
    assert label_share("dirichlet", 0.1) > 0.3  # a few labels dominate


def test_same_seed_gives_same_initial_model_on_every_node():
    a = resolve_task("digits-mlp")(TaskContext(shard_index=0, num_shards=2, seed=5))
    b = resolve_task("digits-mlp")(TaskContext(shard_index=1, num_shards=2, seed=5))
    for (na, pa), (nb, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert na == nb and torch.equal(pa, pb)
    xa, _ = next(a.batches)
    xb, _ = next(b.batches)
    assert not torch.equal(xa, xb)  # different shards


def test_digits_mlp_learns_alone():
    task = resolve_task("digits-mlp")(TaskContext(seed=0))
    opt = torch.optim.SGD(task.model.parameters(), lr=task.lr, momentum=0.9)
    before = task.evaluate(task.model)
    for _ in range(300):
        opt.zero_grad()
        task.loss(task.model, next(task.batches)).backward()
        opt.step()
    assert before < 0.3 and task.evaluate(task.model) > 0.9


def test_wide_digits_mlp_has_over_a_million_parameters():
    task = resolve_task("digits-mlp")(TaskContext(params={"hidden": 1024, "layers": 2}))
    assert sum(p.numel() for p in task.model.parameters()) > 1_000_000


def test_charlm_runs_on_a_small_corpus(tmp_path):
    (tmp_path / "a.py").write_text("def f(x):\n    return x + 1\n" * 800)
    ctx = TaskContext(params={"corpus": str(tmp_path), "d_model": 32, "layers": 1, "heads": 2})
    task = resolve_task("charlm")(ctx)
    loss = task.loss(task.model, next(task.batches))
    assert loss.item() == pytest.approx(np.log(256), rel=0.2)
    assert 0.0 <= task.evaluate(task.model) <= 1.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "expected one of"),
        ("no_such_module_xyz:f", "cannot import module"),
        ("json:no_such_function", "has no function"),
    ],
)
def test_bad_task_names_say_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_task(name)


def test_bad_task_param_names_the_field():
    with pytest.raises(ValueError, match=r"training.params.hidden='wide': expected int"):
        resolve_task("digits-mlp")(TaskContext(params={"hidden": "wide"}))


def test_user_task_by_module_and_function():
    task_fn = resolve_task("geotrain.node.training._builtin:synthetic_linreg")
    assert task_fn(TaskContext()).metric == "mse"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_index": 4, "num_shards": 4}, "shard_index=4"),
        ({"partition": "zipf"}, "partition='zipf'"),
        ({"alpha": 0.0}, "alpha=0.0"),
    ],
)
def test_bad_context_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TaskContext(**kwargs)


def test_a_task_module_that_fails_to_import_is_a_clear_error(tmp_path, monkeypatch):
    """A plugin module with a syntax error, or one that raises on import, was a traceback."""
    from geotrain.node.training import resolve_task

    (tmp_path / "broken_syntax.py").write_text("def task(ctx:\n")
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"task 'broken_syntax:task': cannot import module "
                                         r"'broken_syntax': SyntaxError"):  # fmt: skip
        resolve_task("broken_syntax:task")
    with pytest.raises(ValueError, match=r"cannot import module 'raises_at_import': "
                                         r"RuntimeError: no GPU here"):  # fmt: skip
        resolve_task("raises_at_import:task")


@pytest.mark.parametrize(("params", "message"), [
    ({"hidden": -4}, r"training.params.hidden=-4: expected int >= 1"),
    ({"batch_size": 0}, r"training.params.batch_size=0: expected int >= 1"),
    ({"layers": -1}, r"training.params.layers=-1: expected int >= 0"),
])  # fmt: skip
def test_a_built_in_tasks_size_out_of_range_is_refused_naming_it(params, message):
    """hidden = -4 passed the type check and failed inside torch with a traceback."""
    from geotrain.node.training import TaskContext, resolve_task

    with pytest.raises(ValueError, match=message):
        resolve_task("digits-mlp")(TaskContext(params=params))
    task = resolve_task("digits-mlp")(TaskContext(params={"layers": 0}))  # a linear model
    assert len(list(task.model.parameters())) == 2


def test_an_evaluate_that_returns_a_string_is_an_error_not_a_metric(tmp_path, monkeypatch):
    """float("0.5") made a plugin's string its metric, shown as accuracy 0.5000."""
    from geotrain.node.training import TaskError, resolve_task

    (tmp_path / "str_eval.py").write_text(
        "import dataclasses\n"
        "from geotrain.node import resolve_task\n\n"
        "def task(ctx):\n"
        "    t = resolve_task('synthetic-linreg')(ctx)\n"
        "    return dataclasses.replace(t, evaluate=lambda model: '0.5')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = resolve_task("str_eval:task")(TaskContext())
    with pytest.raises(TaskError, match=r"its evaluate raised or returned no number: TypeError: "
                                        r"evaluate returned '0.5': expected a number"):  # fmt: skip
        task.evaluate(task.model)
