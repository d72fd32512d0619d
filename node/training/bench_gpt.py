"""Parameters and single-process training speed of the `gpt` task's named sizes.

    python -m geotrain.node.training.bench_gpt [--sizes 1m,5m] [--steps 20] [--threads 1]

For each size: the parameter count, steps/s of the daemon's Trainer (the task's recipe: AdamW,
warmup + cosine, clipping) after two warm-up steps, and the seconds one evaluation of the held-out
slice takes (in steps, the evaluation's share of the default eval_every = 50 follows). With
--curve N, the 1m model is also trained N steps alone and its bits per byte printed every N/10.
One process, one torch thread unless told: figures for docs/benchmarks.md, on the machine they name.
"""

from __future__ import annotations

import argparse
import time

import torch

from ._gpt import SIZES
from ._tasks import TaskContext, resolve_task
from ._trainer import Trainer


def _measure(size: str, steps: int) -> dict[str, float]:
    task = resolve_task("gpt")(TaskContext(params={"size": size}))
    trainer = Trainer(task)
    for _ in range(2):
        trainer.train_step()
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    per_step = (time.perf_counter() - started) / steps
    started = time.perf_counter()
    trainer.evaluate()
    evaluation = time.perf_counter() - started
    return {
        "params": sum(p.numel() for p in task.model.parameters()),
        "steps_per_s": 1 / per_step,
        "eval_s": evaluation,
        "eval_in_steps": evaluation / per_step,
    }


def _curve(steps: int) -> None:
    task = resolve_task("gpt")(TaskContext(params={"size": "1m"}))
    trainer = Trainer(task)
    started = time.perf_counter()
    print(f"step 0: {trainer.evaluate():.3f} bits/byte")
    for step in range(1, steps + 1):
        trainer.train_step()
        if step % max(1, steps // 10) == 0:
            seconds = time.perf_counter() - started
            print(f"step {step}: {trainer.evaluate():.3f} bits/byte ({seconds:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m geotrain.node.training.bench_gpt")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--curve", type=int, default=0, help="also train 1m alone this many steps")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), context 128, batch 16")
    print("| size | parameters | steps/s | evaluation (s) | evaluation (steps) |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        m = _measure(size, args.steps)
        print(f"| {size} | {m['params']:,} | {m['steps_per_s']:.2f} | {m['eval_s']:.2f} | "
              f"{m['eval_in_steps']:.1f} |", flush=True)  # fmt: skip
    if args.curve:
        _curve(args.curve)


if __name__ == "__main__":
    main()
