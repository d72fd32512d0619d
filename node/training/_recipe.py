# How a task is trained: optimizer, learning-rate schedule and gradient clipping. Invariants: a
# Recipe is validated when made, naming the `training.*` field a user would set; the defaults are
# the recipe every task had before tasks could state one (SGD with momentum 0.9 at the task's
# rate, no decay, no schedule, no clipping), so a task that states nothing trains as it always
# did; the daemon's Trainer and the testbed's baselines build their optimizer and schedule here,
# so every system trains a task the same way.
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


def schedule_factor(step: int, warmup: int, total: int, kind: str, floor: float = 0.0) -> float:
    """The learning-rate multiplier at `step`: linear warmup over `warmup` steps, then constant,
    cosine or linear decay to `floor` at `total` steps (constant past it)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"training.{name}={value!r}: expected {expected}")


@dataclass(frozen=True)
class Recipe:
    """How to train a task; each field is the `training.*` setting of the same name, which wins
    where the user's config sets it (`Recipe.with_settings`).

    Attributes:
        optimizer: "sgd" (with `momentum`), "adam" or "adamw" (decoupled weight decay).
        momentum: SGD's momentum (ignored by adam and adamw).
        weight_decay: L2 (sgd, adam) or decoupled (adamw) weight decay.
        warmup_steps: the learning rate rises linearly from lr / warmup_steps to lr over these.
        schedule: after the warmup, "constant", or "cosine" / "linear" decay to
            lr x min_lr_ratio at total_steps (and that rate past it).
        total_steps: where a decaying schedule ends (steps of the local optimizer).
        min_lr_ratio: the decayed rate's floor as a fraction of lr (0: decay to zero).
        clip_grad_norm: scale each step's gradients down to at most this total L2 norm (None or
            0: no clipping).
    """

    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_grad_norm: float | None = None

    def __post_init__(self) -> None:
        _check(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        _check(0 <= self.momentum < 1, "momentum", self.momentum, "0 <= momentum < 1")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        _check(self.schedule in SCHEDULES, "schedule", self.schedule, f"one of {SCHEDULES}")
        _check(self.total_steps >= 0, "total_steps", self.total_steps, ">= 0")
        decaying = f"> training.warmup_steps ({self.warmup_steps}) for a decaying schedule"
        _check(self.schedule == "constant" or self.total_steps > self.warmup_steps,
               "total_steps", self.total_steps, decaying)  # fmt: skip
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "0..1")
        clip = self.clip_grad_norm
        _check(clip is None or clip >= 0, "clip_grad_norm", clip, ">= 0 (0: no clipping)")

    def with_settings(self, **settings: Any) -> Recipe:
        """This recipe with the settings that are not None put in its place (a user's config
        over a task's recipe: an explicit setting always wins, an unset one takes the task's).

        Raises:
            ValueError: a setting that is not a Recipe field, or a result that is not valid.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"not recipe settings: {unknown}; expected some of {sorted(names)}")
        return dataclasses.replace(self, **{k: v for k, v in settings.items() if v is not None})

    @property
    def clips(self) -> bool:
        return bool(self.clip_grad_norm)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier after `step` optimizer steps (see schedule_factor)."""
        return schedule_factor(
            step, self.warmup_steps, self.total_steps, self.schedule, self.min_lr_ratio
        )

    def build_optimizer(self, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        """The optimizer this recipe names, over `params` (tensors or param groups), at `lr`."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(
                params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> LambdaLR:
        """The warmup and decay, stepped once after every optimizer step."""
        return LambdaLR(optimizer, lambda step: self.lr_factor(step))

    def clip(self, params: Iterable[torch.Tensor]) -> None:
        """Clip the gradients of `params` to clip_grad_norm (nothing when the recipe has none)."""
        if self.clips:
            torch.nn.utils.clip_grad_norm_(params, float(self.clip_grad_norm))  # type: ignore[arg-type]
