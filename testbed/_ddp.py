# The baselines users would otherwise pick on a cluster: synchronous data-parallel training with
# PyTorch DDP (gloo all-reduce), or DDP's ranks doing local SGD (torch's PeriodicModelAverager:
# the parameters all-reduced every H steps), one process per peer, same task, same shards, same
# optimizer, schedule and clipping (the task's recipe, see task_optimizer), same per-peer slowdown
# as the geotrain nodes. Invariants: with DDP every rank holds identical
# parameters after each step; with local SGD after every H-th step (each rank evaluates its own
# model); all ranks stop at the same step (target reached, step limit, or rank 0's clock, agreed
# by an all-reduce at most STOP_CHECK_EVERY steps apart, closer near the time limit, so a run
# ends within half a step of its duration); metrics lines use the node's format.
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from geotrain.node import EvalCadence, Task, TaskContext, resolve_task

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
    p.add_argument("--eval-every-s", type=float, default=0.0,
                   help="also evaluate once this many seconds passed since the last (0: off)")
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--system", default="ddp", help="the name in the metrics lines")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="compute emulation: pad each local step to this (x slowdown)")
    p.add_argument("--local-sgd-period", type=int, default=0,
                   help="0: DDP (gradients all-reduced every step); H > 0: local SGD, the "
                        "parameters averaged every H steps (torch's PeriodicModelAverager)")
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
    averager = None
    if args.local_sgd_period > 0:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        model = task.model  # local steps: no gradient all-reduce
        averager = PeriodicModelAverager(period=args.local_sgd_period, warmup_steps=0)
    else:
        model = torch.nn.parallel.DistributedDataParallel(task.model)
    optimizer, scheduler = task_optimizer(task, model.parameters(), args.lr)
    joined = time.monotonic()
    stop = StopRule(args, joined)
    cadence = EvalCadence(args.eval_every, args.eval_every_s)
    step, metric, metric_step = 0, None, None

    def evaluate() -> float:
        with cadence.evaluating():
            model.eval()
            try:
                return float(task.evaluate(task.model))
            finally:
                model.train()

    def write(step: int, loss: torch.Tensor, metric: float | None, metric_step: int | None):
        elapsed = time.monotonic() - joined
        record = {
            "system": args.system,
            "t": time.time(),
            "elapsed_s": round(time.monotonic() - started, 4),
            "step": step,
            "loss": float(loss.detach()),
            "metric": metric,
            "metric_step": metric_step,
            "steps_per_s": step / elapsed if elapsed > 0 else 0.0,
            "eval_s": round(cadence.spent_s, 4),  # (compute utilization leaves it out)
        }
        out.write(json.dumps(record) + "\n")
        out.flush()

    with open(args.metrics, "a") as out:
        while True:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model, next(task.batches))
            loss.backward()  # DDP: the gradient all-reduce happens here
            task.recipe.clip(model.parameters())  # the task's clipping, if any (after the sum)
            optimizer.step()
            scheduler.step()
            if averager is not None:
                averager.average_parameters(model.parameters())  # every period-th step
            step += 1
            # padded from the step's start: the all-reduce overlaps the pinned compute time, as
            # DDP overlaps it with the backward pass on GPUs
            pad_step(t0, args.step_ms, args.slowdown)
            if cadence.due(step):
                metric, metric_step = evaluate(), step
            write(step, loss, metric, metric_step)
            if stop.check(step, metric, task.reached):
                break
        if metric_step != step:  # the final figure is of the model the rank ends with (a
            # node evaluates at its exit too): local SGD evaluates every 20 steps, so its last
            # metric could be up to 19 steps old
            metric, metric_step = evaluate(), step
            write(step, loss, metric, metric_step)
    dist.barrier()  # every rank leaves together: rank 0 holds the store the others talk to
    dist.destroy_process_group()
    return 0


def task_optimizer(
    task: Task, params: Iterable[torch.nn.Parameter], lr: float | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and learning-rate schedule a geotrain node builds for `task` when its config
    leaves them to the task: the task's recipe (SGD with momentum 0.9 unless the task states
    another; gpt: AdamW, warmup + cosine) at `lr` (None: the task's), so every system trains the
    same way. The schedule is stepped once per local step, and `task.recipe.clip` clips."""
    optimizer = task.recipe.build_optimizer(params, lr or task.lr)
    return optimizer, task.recipe.build_scheduler(optimizer)


def pad_step(started: float, step_ms: float, slowdown: float) -> None:
    """Compute emulation, as a node's trainer does it: wait until the step that began at
    `started` (perf_counter) has taken step_ms x slowdown; 0: the plain slowdown instead."""
    compute = time.perf_counter() - started
    if step_ms > 0:
        time.sleep(max(0.0, step_ms / 1000 * slowdown - compute))
    elif slowdown > 1.0:
        time.sleep((slowdown - 1.0) * compute)


class StopRule:
    """When all ranks stop, agreed by an all-reduce: rank 0's clock and the step limit, or the
    target once every rank has reached it (DDP's ranks hold one model; local SGD's differ
    between averaging steps). Checks cost a round trip on the WAN, so they come every
    STOP_CHECK_EVERY steps, except that rank 0 brings the next one closer when the time limit
    is nearer than that, from the step time it measured since the last check, and stops at the
    check once less than half a step is left: a run ends within half a step of its duration,
    as the geotrain nodes do, instead of up to STOP_CHECK_EVERY steps past it (seen: 99 s of
    a 50 s run with 4.5 s steps on a slow link).

    Local SGD checks right after its averaging steps only, and its unit is a whole period: a
    check is a barrier, and one between two averaging steps made the fast ranks wait for the
    slowest each time (20 s at 1 s steps beside a 4x straggler) while the mean step time it
    measured hid those waits: local SGD trained 143-145 s of a 120 s run. Right after an
    averaging step every rank has just waited anyway, so the check costs a round trip, and a
    run ends within half a period of its duration, the ranks holding one model."""

    def __init__(self, args: argparse.Namespace, joined: float) -> None:
        self.args, self.joined = args, joined
        self.unit = max(1, getattr(args, "local_sgd_period", 0))
        # the first check measures the step (period) time; torch's PeriodicModelAverager
        # averages at its 1st, (1 + period)-th, ... call
        self.next_check = 1 if self.unit == 1 else 1 + self.unit
        if args.max_steps:  # (a step limit is kept to the step, averaged or not)
            self.next_check = min(self.next_check, args.max_steps)
        self.last_step, self.last_t = 0, joined

    def check(self, step: int, metric: float | None, reached) -> bool:
        if step < self.next_check:
            return False
        args, now, unit = self.args, time.monotonic(), self.unit
        step_s = (now - self.last_t) / max(1, step - self.last_step)
        self.last_step, self.last_t = step, now
        limit, interval = 0.0, 0.0
        if args.max_steps and step >= args.max_steps:
            limit = 1.0
        if args.rank == 0:  # its clock and its interval count; the others add zeros
            interval = float(max(STOP_CHECK_EVERY // unit, 1) * unit)
            if args.max_steps:
                interval = min(interval, max(1, args.max_steps - step))
            if args.duration:
                left = args.duration - (now - self.joined)
                if left < step_s * unit / 2:
                    limit = 1.0
                elif step_s > 0:
                    interval = min(interval, max(unit, int(left / step_s) // unit * unit))
        target = float(args.target is not None and metric is not None
                       and reached(metric, args.target))  # fmt: skip
        flags = torch.tensor([limit, target, interval])
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        self.next_check = step + max(1, int(flags[2].item()))
        return bool(flags[0].item() > 0 or flags[1].item() >= args.world)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    # ended without the interpreter's teardown: gloo's threads at exit aborted rank 0 once in a
    # CI run ("terminate called without an active exception", status -6) after all of its
    # figures were written, and the summary reported a failed baseline
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
