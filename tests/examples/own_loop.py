"""A training script of its own, joined to a geotrain swarm: the five added lines are marked.

    python own_loop.py --config node.toml --shard 1 --shards 4 [--steps 0]

The model and data are the built-in digits task's (so that daemon nodes training `digits-mlp`
can share the swarm); the loop, optimizer (AdamW), schedule (warmup + cosine) and gradient
clipping are this script's. Runs until --steps (0: until SIGTERM/SIGINT), then leaves cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch
from torch import nn

import geotrain  # +
from geotrain.node import TaskContext, resolve_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through `with` below
    torch.set_num_threads(1)
    task = resolve_task("digits-mlp")(TaskContext(shard_index=args.shard, num_shards=args.shards))
    model = task.model
    with geotrain.join(args.config, model, evaluate=task.evaluate, metric="accuracy") as swarm:  # +
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LinearLR(adamw, start_factor=0.1, total_iters=20)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=5000)
        schedule = torch.optim.lr_scheduler.SequentialLR(adamw, [warmup, cosine], milestones=[20])
        opt = swarm.wrap(adamw, schedule)  # +
        step = swarm.step  # + (a restart resumes where its checkpoint was)
        while not args.steps or step < args.steps:
            x, y = next(task.batches)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step(loss=loss)  # + (was adamw.step())
            opt.zero_grad()
            schedule.step()
            step += 1


if __name__ == "__main__":
    main()
