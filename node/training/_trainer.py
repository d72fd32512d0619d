# The local trainer. Invariants: one lock guards the model and optimizer, so a training step (run
# in a worker thread) and a mix or snapshot (also run in worker threads by the event loop) never
# interleave; every tensor stays on the task's device; nothing here touches the network.
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import structlog
import torch

from geotrain.gossip import check_update, pairwise_mix

from ..state import (
    adopt_optimizer_state,
    optimizer_from_checkpoint,
    optimizer_to_checkpoint,
)
from ._optimizer_sync import OptimizerSync
from ._privacy import PrivateTraining, mixing_only_step
from ._recipe import OPTIMIZERS as OPTIMIZERS
from ._recipe import SCHEDULES as SCHEDULES
from ._recipe import schedule_factor as schedule_factor
from ._tasks import Task, batch_samples

log = structlog.get_logger()

PRECISIONS = ("fp32", "bf16")
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    seconds: float  # wall time of the step, including any emulated slowdown
    samples: int = 0  # training samples the step took (0: not known, as in a user's own loop)


class Trainer(OptimizerSync):
    """A task's model and optimizer, stepped from a worker thread.

    Args:
        task: what to train; its `recipe` says how, for every setting below left None.
        optimizer: "sgd" (with momentum), "adam" or "adamw"; None: the task's recipe.
        lr: learning rate; None takes the task's.
        momentum: SGD momentum; None: the task's recipe (0.9 unless it says otherwise).
        slowdown: emulate a slower machine: after each step, wait (slowdown - 1) x its compute
            time (the testbed's stragglers). 1.0 = full speed.
        precision: "fp32", or "bf16" to run the forward pass and loss under torch.autocast in
            bfloat16 (weights, gradients and optimizer state stay float32).
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

    def __init__(
        self,
        task: Task,
        *,
        optimizer: str | None = None,
        lr: float | None = None,
        momentum: float | None = None,
        slowdown: float = 1.0,
        precision: str = "fp32",
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
        self.task = task
        self.model = task.model
        self.lr = task.lr if lr is None else lr
        self.optimizer: torch.optim.Optimizer = self.recipe.build_optimizer(
            list(self.model.parameters()), self.lr
        )
        self.scheduler = self.recipe.build_scheduler(self.optimizer)
        self.clip_grad_norm = self.recipe.clip_grad_norm if self.recipe.clips else None
        self.accumulate = accumulate
        self.slowdown = slowdown
        self.step_time_s = step_time_s
        self.overran_steps = 0  # compute emulation: steps whose compute exceeded the pinned time
        self.precision = precision
        self._sleep = sleep
        self._lock = threading.RLock()  # re-entrant: `locked()` callers use the methods too
        self.step = 0
        self.last_loss = math.nan
        self._step_ends: deque[float] = deque(maxlen=50)  # monotonic end times of recent steps
        # [privacy]: Opacus' per-sample clipping and noise (set by make_private), or None
        self.private: PrivateTraining | None = None
        self._said_spent = [False]

    def params(self) -> dict[str, torch.Tensor]:
        """The live parameters by name (do not modify outside the trainer's methods)."""
        return {name: p.data for name, p in self.model.named_parameters()}

    def train_step(self) -> StepResult:
        """One optimizer step on the next batch. Blocking: run it in a worker thread.

        With [privacy] the step is Opacus' (per-sample clipping, noise) and accounted; once the
        budget is spent it is mixing-only: no batch is read and no gradient taken.
        """
        started = time.perf_counter()
        if self.private is not None and self.private.would_exceed():
            seconds = mixing_only_step(self, started, self._said_spent, log)
            with self._lock:
                self.step += 1
                step = self.step
            self._step_ends.append(time.monotonic())
            return StepResult(step, self.last_loss, seconds)
        optimizer = self.optimizer if self.private is None else self.private.optimizer
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
            optimizer.step()
            # the gradients' memory goes back now, not at the next step: exchanges and mixes
            # between steps then fit where they were (one model copy less at the peak)
            optimizer.zero_grad(set_to_none=True)
            if self.private is not None:
                self.private.stepped()
            self.scheduler.step()
            self.step += 1
            self.last_loss = total / self.accumulate
            step = self.step
        compute = time.perf_counter() - started
        if self.step_time_s > 0:
            pinned = self.step_time_s * self.slowdown
            if compute > pinned:
                self.overran_steps += 1
            else:
                self._sleep(pinned - compute)
        elif self.slowdown > 1.0:
            self._sleep((self.slowdown - 1.0) * compute)
        self._step_ends.append(time.monotonic())
        return StepResult(step, self.last_loss, time.perf_counter() - started, samples)

    def step_interval_s(self) -> float | None:
        """Mean seconds from one step's end to the next's over the last 50 steps (what the loop
        around the steps adds included), or None before two steps ended."""
        ends = list(self._step_ends)
        if len(ends) < 2:
            return None
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the parameters as they are now (what an exchange sends)."""
        with self._lock:
            return {name: t.detach().clone() for name, t in self.params().items()}

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
        with self._lock:
            live = self.params()
            check_update(live, remote, max_norm_ratio=max_norm_ratio)
            return pairwise_mix(live, snapshot, remote, weight=weight, clip=clip)

    def update(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """Run `fn(live parameters)` under the model lock, without autograd; returns its result.

        For reading the model (and changes that must happen now); never beside a training step.
        """
        with self._lock, torch.no_grad():
            return fn(self.params())

    def apply(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """Change the model by `fn(live parameters)` between two training steps (a mix, an outer
        step); returns its result. Here that is `update`; a training loop of the user's own
        runs it at its next step instead (LoopTrainer)."""
        return self.update(fn)

    def load_params(self, remote: dict[str, torch.Tensor], *, max_norm_ratio: float) -> None:
        """Replace the parameters with a peer's (state sync for a node that joins late)."""
        remote = {k: v.to(self.task_device) for k, v in remote.items()}
        with self._lock:
            live = self.params()
            check_update(live, remote, max_norm_ratio=max_norm_ratio)
            with torch.no_grad():
                for name, tensor in live.items():
                    tensor.copy_(remote[name])

    # -- optimizer state for a joiner (state sync) ------------------------------------------
    def adopt_optimizer_state(self, cls: str, tensors: dict[str, torch.Tensor],
                              scalars: dict) -> bool:  # fmt: skip
        """A peer's optimizer state, fetched by state sync (our hyperparameters stay). Returns
        True: it is in the optimizer now.

        Raises:
            ValueError: it does not fit our optimizer; nothing was changed.
        """
        with self._lock:
            adopt_optimizer_state(self.optimizer, cls, tensors, scalars)
            return True

    @property
    def task_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def evaluate(self) -> float:
        """The task's metric on the held-out set. Blocking: run it in a worker thread."""
        with self._lock:
            self.model.eval()
            try:
                return float(self.task.evaluate(self.model))
            finally:
                self.model.train()

    def state_tensors(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """Model and optimizer state for a checkpoint: tensors by name, and JSON-able scalars.

        Args:
            copy: copies (True), or the live tensors themselves: only for a caller that holds
                `locked()` for as long as it uses them (a checkpoint written without a copy).
        """
        with self._lock:
            sd = self.model.state_dict()
            tensors = {f"model/{k}": v.detach() for k, v in sd.items()}
            opt_tensors, opt_meta = optimizer_to_checkpoint(self.optimizer)
            tensors.update({k: v.detach() for k, v in opt_tensors.items()})
            if copy:
                tensors = {k: v.clone() for k, v in tensors.items()}
            scheduler = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
            meta = {"optimizer": opt_meta, "scheduler": scheduler, "step": self.step}
            if self.private is not None:  # the budget spent so far travels with the model
                meta["privacy"] = self.private.state()
            return tensors, meta

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the model lock: no step, mix or snapshot runs meanwhile (blocks them)."""
        with self._lock:
            yield

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict, step: int) -> None:
        """Load what `state_tensors` produced (from a checkpoint)."""
        device = self.task_device
        model_sd = {k[6:]: v.to(device) for k, v in tensors.items() if k.startswith("model/")}
        opt_tensors = {k: v.to(device) for k, v in tensors.items() if k.startswith("optim/")}
        with self._lock:
            self.model.load_state_dict(model_sd)
            optimizer_from_checkpoint(self.optimizer, opt_tensors, meta["optimizer"])
            if isinstance(meta.get("scheduler"), dict):  # (checkpoints before schedules had none)
                self.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
            if self.private is not None and isinstance(meta.get("privacy"), dict):
                self.private.load_state(meta["privacy"])
            self.step = step
