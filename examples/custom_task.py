"""A task plugin for the daemon: what `geotrain node run` trains when training.task names this
module's function (`custom_task:sine_regression`, found in the working directory). The daemon
owns the loop (optimizer, schedule, checkpoints) and calls `loss` on each batch.

    geotrain local -n 3 --set training.task=custom_task:sine_regression \\
        -- sh -c 'exec geotrain node run --config "$GEOTRAIN_CONFIG"'

or, on each machine of a real swarm: task = "custom_task:sine_regression" in its node.toml.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import geotrain


def sine_regression(ctx: geotrain.TaskContext) -> geotrain.Task:
    """Fit y = sin(x) on [-pi, pi]; each node draws its own shard of the points."""
    torch.manual_seed(ctx.seed)  # the same initial model on every node
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))
    xs = torch.linspace(-math.pi, math.pi, 4096).unsqueeze(1)
    mine = xs[ctx.shard_index :: ctx.num_shards]  # (training.shard_index of num_shards)
    g = torch.Generator().manual_seed(1)
    held_out = torch.rand(512, 1, generator=g) * 2 * math.pi - math.pi

    def batches():
        g = torch.Generator().manual_seed(ctx.seed + ctx.shard_index)
        while True:
            x = mine[torch.randint(len(mine), (64,), generator=g)]
            yield x, torch.sin(x)

    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            return F.mse_loss(model(held_out), torch.sin(held_out)).item()

    return geotrain.Task(model=model.to(ctx.device), batches=batches(), loss=loss,
                         evaluate=evaluate, metric="mse", higher_is_better=False, lr=0.05,
                         train_size=len(mine))
