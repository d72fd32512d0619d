# The baseline users would otherwise pick: synchronous data-parallel training with PyTorch DDP
# (gloo all-reduce), one process per peer, same task, same shards, same per-peer slowdown as the
# geotrain nodes. Invariants: every rank holds identical parameters after each step, so every rank
# evaluates the same model; all ranks stop at the same step (target reached, step limit, or rank 0's
# clock, agreed by an all-reduce every STOP_CHECK_EVERY steps); metrics lines use the node's format.
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from geotrain.node import TaskContext, resolve_task

STOP_CHECK_EVERY = 10


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m geotrain.testbed._ddp", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous store")
    p.add_argument("--task", default="digits-mlp")
    p.add_argument("--params", default="{}", help="task params as a JSON object")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partition", default="iid")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--slowdown", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")
    p.add_argument("--target", type=float, default=None, help="stop once the metric reaches it")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=300),
    )
    ctx = TaskContext(
        shard_index=args.rank,
        num_shards=args.world,
        seed=args.seed,
        partition=args.partition,
        alpha=args.alpha,
        params=json.loads(args.params),
    )
    task = resolve_task(args.task)(ctx)
    model = torch.nn.parallel.DistributedDataParallel(task.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr or task.lr, momentum=0.9)
    joined = time.monotonic()
    step, metric, metric_step = 0, None, None
    with open(args.metrics, "a") as out:
        while True:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model, next(task.batches))
            loss.backward()  # the gradient all-reduce happens here
            optimizer.step()
            step += 1
            if args.slowdown > 1.0:
                time.sleep((args.slowdown - 1.0) * (time.perf_counter() - t0))
            if step % args.eval_every == 0:
                model.eval()
                metric, metric_step = float(task.evaluate(task.model)), step
                model.train()
            elapsed = time.monotonic() - joined
            record = {
                "system": "ddp",
                "t": time.time(),
                "elapsed_s": round(time.monotonic() - started, 4),
                "step": step,
                "loss": float(loss.detach()),
                "metric": metric,
                "metric_step": metric_step,
                "steps_per_s": step / elapsed if elapsed > 0 else 0.0,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            if _should_stop(args, step, metric, task.reached, joined):
                break
    dist.destroy_process_group()
    return 0


def _should_stop(args, step, metric, reached, joined) -> bool:
    """All ranks agree: rank 0's view of time and step limits, every rank's view of the target."""
    if step % STOP_CHECK_EVERY:
        return False
    local = 0.0
    if args.max_steps and step >= args.max_steps:
        local = 1.0
    if args.duration and time.monotonic() - joined >= args.duration and args.rank == 0:
        local = 1.0
    if args.target is not None and metric is not None and reached(metric, args.target):
        local = 1.0
    flag = torch.tensor([local])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
