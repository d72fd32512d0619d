# The daemon's trainer: a task's model, optimizer, schedule and loop on the node's one trainer
# core (LoopTrainer, the class a loop of the user's own runs on): the task's step goes through the
# same `stepped`, and checkpoints, restores and state sync are the same code. Invariants: the
# lock is held for the whole iteration (data, forward, backward, step), so a change of the model
# (a mix, an outer step, run in a worker thread by the event loop) runs at once between two steps
# and never beside one; every tensor stays on the task's device; nothing here touches the network.
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import torch

from geotrain.gossip import check_update, pairwise_mix

from ._loop import LoopTrainer, StepResult
from ._privacy import PrivateTraining, mixing_only_step
from ._recipe import OPTIMIZERS as OPTIMIZERS
from ._recipe import SCHEDULES as SCHEDULES
from ._recipe import schedule_factor as schedule_factor
from ._tasks import Task, batch_samples

log = structlog.get_logger()

PRECISIONS = ("auto", "fp32", "bf16")
T = TypeVar("T")
__all__ = ["PRECISIONS", "StepResult", "Trainer", "resolve_precision"]


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a setting means on `device`: "fp32" or "bf16" ("auto": bf16 on a CUDA
    device with bfloat16 support, else fp32).

    Raises:
        ValueError: an unknown setting, or bf16 asked of a CUDA device without it.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    cuda = device.type == "cuda"
    bf16_ok = not cuda or torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if cuda and bf16_ok else "fp32"
    if precision == "bf16" and not bf16_ok:
        raise ValueError(f"precision='bf16': {torch.cuda.get_device_name(device)} has no "
                         "bfloat16; use 'fp32'")  # fmt: skip
    return precision


class Trainer(LoopTrainer):
    """A task's model, optimizer, schedule and loop, stepped from a worker thread: the daemon's
    training, as a loop of the user's own would be (the optimizer is attached as `wrap` attaches
    the user's).

    Args:
        task: what to train; its `recipe` says how, for every setting below left None.
        optimizer: "sgd" (with momentum), "adam" or "adamw"; None: the task's recipe.
        lr: learning rate; None takes the task's.
        momentum: SGD momentum; None: the task's recipe (0.9 unless it says otherwise).
        slowdown: emulate a slower machine: after each step, wait (slowdown - 1) x its compute
            time (the testbed's stragglers). 1.0 = full speed.
        precision: "fp32", or "bf16" to run the forward pass and loss under torch.autocast in
            bfloat16 (weights, gradients and optimizer state stay float32); "auto": bf16 on a
            CUDA device that has it (tensor cores run bfloat16 matmuls several times faster
            than float32 ones), fp32 elsewhere (a CPU gains little and rounds more).
        weight_decay: for adamw (decoupled), adam and sgd; warmup_steps, schedule, total_steps,
            min_lr_ratio: the learning rate's warmup and decay (see schedule_factor); each None
            takes the task's recipe.
        clip_grad_norm: scale the gradients down to at most this total norm (0: no clipping;
            None: the task's recipe, which for most tasks is no clipping).
        accumulate: batches whose gradients are summed (averaged) into one optimizer step.
        step_time_s: compute emulation: pad every step to this many seconds (times `slowdown`),
            so a step takes what the emulated machine would, whatever the cores here do; a step
            whose compute alone took longer is counted in `overran_steps`. 0: off.
        sleep: the function used for that wait (tests pass a fake).
    """

    steps_beside_algorithm = False  # the driver steps only after after_step returns

    def __init__(
        self,
        task: Task,
        *,
        optimizer: str | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        slowdown: float = 1.0,
        precision: str = "auto",
        weight_decay: float | None = None,
        warmup_steps: int | None = None,
        schedule: str | None = None,
        total_steps: int | None = None,
        min_lr_ratio: float | None = None,
        clip_grad_norm: float | None = None,
        accumulate: int = 1,
        step_time_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        if slowdown < 1.0:
            raise ValueError(f"slowdown={slowdown}: expected >= 1.0")
        if not (math.isfinite(step_time_s) and step_time_s >= 0):
            raise ValueError(f"step_time_s={step_time_s}: expected a number >= 0")
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate}: expected >= 1")
        # the user's settings over the task's recipe: a setting given here always wins
        self.recipe = task.recipe.with_settings(
            optimizer=optimizer, momentum=momentum, weight_decay=weight_decay,
            warmup_steps=warmup_steps, schedule=schedule, total_steps=total_steps,
            min_lr_ratio=min_lr_ratio, clip_grad_norm=clip_grad_norm,
        )  # fmt: skip
        super().__init__(task.model, task.evaluate, metric=task.metric,
                         higher_is_better=task.higher_is_better)  # fmt: skip
        self.task = task
        self.lr = task.lr if lr is None else lr
        built = self.recipe.build_optimizer(list(self.model.parameters()), self.lr)
        self.attach(built, self.recipe.build_scheduler(built))  # as wrap() does
        self.clip_grad_norm = self.recipe.clip_grad_norm if self.recipe.clips else None
        self.accumulate = accumulate
        self.slowdown = slowdown
        self.step_time_s = step_time_s
        self.overran_steps = 0  # compute emulation: steps whose compute exceeded the pinned time
        self.precision = resolve_precision(precision, self.task_device)
        self._sleep = sleep
        # [privacy]: Opacus' per-sample clipping and noise (set by make_private), or None
        self.private: PrivateTraining | None = None
        self._said_spent = [False]

    def train_step(self) -> StepResult:
        """One optimizer step on the next batch. Blocking: run it in a worker thread.

        With [privacy] the step is Opacus' (per-sample clipping, noise) and accounted; once the
        budget is spent it is mixing-only: no batch is read and no gradient taken.
        """
        started = time.perf_counter()
        if self.private is not None and self.private.would_exceed():
            mixing_only_step(self, started, self._said_spent, log)
            _, result = self.stepped(lambda: None, None)
            return dataclasses.replace(result, seconds=time.perf_counter() - started)
        optimizer = self.optimizer if self.private is None else self.private.optimizer
        if self.private is not None:
            self.private.record_ahead()  # (durably counted before any gradient is taken)

        def optimizer_step() -> None:
            optimizer.step()
            # the gradients' memory goes back now, not at the next step: exchanges and mixes
            # between steps then fit where they were (one model copy less at the peak)
            optimizer.zero_grad(set_to_none=True)
            if self.private is not None:
                self.private.stepped()
            self.scheduler.step()

        with self._lock:
            optimizer.zero_grad(set_to_none=True)
            total, samples = 0.0, 0
            for _ in range(self.accumulate):
                batch = next(self.task.batches)
                samples += batch_samples(batch)
                if self.precision == "bf16":
                    with torch.autocast(self.task_device.type, dtype=torch.bfloat16):
                        loss = self.task.loss(self.model, batch)
                else:
                    loss = self.task.loss(self.model, batch)
                (loss / self.accumulate).backward()
                total += float(loss.detach())
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
            _, result = self.stepped(optimizer_step, total / self.accumulate)  # as opt.step()
        compute = time.perf_counter() - started
        if self.step_time_s > 0:
            pinned = self.step_time_s * self.slowdown
            if compute > pinned:
                self.overran_steps += 1
            else:
                self._sleep(pinned - compute)
        elif self.slowdown > 1.0:
            self._sleep((self.slowdown - 1.0) * compute)
        seconds = time.perf_counter() - started
        if self.private is not None:  # (the pace of its mixing-only steps once it is spent)
            self.private.observe_step(seconds)
        return dataclasses.replace(result, seconds=seconds, samples=samples)

    def mix(
        self,
        snapshot: dict[str, torch.Tensor],
        remote: dict[str, torch.Tensor],
        *,
        weight: float = 0.5,
        clip: float | None = None,
        max_norm_ratio: float = 10.0,
    ) -> float:
        """Check a peer's parameters and mix them in (see gossip's pairwise_mix).

        Raises:
            RejectedUpdate: the peer's tensors failed a check; nothing was changed.
        """
        remote = {k: v.to(self.task_device) for k, v in remote.items()}
        with self._lock, self._writing:
            live = self.params()
            check_update(live, remote, max_norm_ratio=max_norm_ratio)
            return pairwise_mix(live, snapshot, remote, weight=weight, clip=clip)

    def apply(self, fn: Callable[[dict[str, torch.Tensor]], T], *, changes: bool = True) -> T:
        """Change the model by `fn(live parameters)` now, between two steps (the lock keeps it
        from running beside one): the daemon's iteration is all under the lock, so nothing
        waits for a next step as a loop of the user's own makes it. With `changes` False (an
        evaluation: eval mode must not meet a step's passes, but no value changes) the reads
        of exchanges and state sync go on beside it."""
        if changes:
            return self.update(fn)
        with self._lock, torch.no_grad():
            return fn(self.params())

    def checkpoint_extra(self) -> dict[str, Any]:
        # the privacy budget spent so far travels with the model
        return {} if self.private is None else {"privacy": self.private.state()}

    def restore_extra(self, meta: dict) -> None:
        if self.private is not None and isinstance(meta.get("privacy"), dict):
            self.private.load_state(meta["privacy"])
