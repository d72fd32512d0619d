"""Tasks used by the daemon's tests (loaded by nodes as `tests_tasks:NAME`)."""

from __future__ import annotations

from geotrain.node.training._builtin import digits_mlp
from geotrain.node.training._tasks import Task, TaskContext


def nan_digits(ctx: TaskContext) -> Task:
    """digits-mlp whose loss is NaN: a broken peer whose parameters become NaN after one step."""
    task = digits_mlp(ctx)
    inner = task.loss
    task.loss = lambda model, batch: inner(model, batch) * float("nan")
    return task


def broken_loss(ctx: TaskContext) -> Task:
    """digits-mlp whose loss raises: a task plugin with a bug (the testbed must say so)."""
    task = digits_mlp(ctx)

    def loss(model, batch):
        raise RuntimeError("deliberate failure inside my loss")

    task.loss = loss
    return task
