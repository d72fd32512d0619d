# The trainer's side of state sync for optimizer state and the schedule's position (LoopTrainer,
# and so the daemon's Trainer).
# Invariants: a joiner's reads of the optimizer's state run under the trainer's `_writing` lock,
# which an optimizer step holds (so beside a step's forward and backward passes, which never
# change that state: a read that waited for a whole step at 10^8 missed its request's deadline
# and the joiner started with a fresh optimizer); checks run under the trainer's lock; nothing
# is copied but the chunk a caller reads; a trainer without an optimizer (a library node
# before wrap) has no state to serve and checks nothing it cannot know yet.
from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..state import (
    OptimizerStateError,
    check_optimizer_state,
    optimizer_layout,
    optimizer_to_checkpoint,
)

T = TypeVar("T")


class OptimizerSync:
    """Mixed into a trainer that has `optimizer` (or None), `_lock` and `_writing`."""

    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    model: torch.nn.Module
    _lock: threading.Lock | threading.RLock
    _writing: threading.RLock

    def optimizer_names(self, optimizer: torch.optim.Optimizer | None) -> list[str] | None:
        """The model's names of `optimizer`'s parameters, in its order (None: it holds one the
        model does not name): what optimizer state is matched by (renumber_by_name)."""
        if optimizer is None:
            return None
        names = {id(p): n for n, p in self.model.named_parameters()}
        listed = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        return None if None in listed else listed  # type: ignore[return-value]

    def optimizer_layout(self) -> dict | None:
        """The optimizer's class and state tensors, and how far its scheduler went, for a
        joiner (None: no optimizer yet)."""
        with self._writing:
            if self.optimizer is None:
                return None
            steps = getattr(self.scheduler, "last_epoch", None)
            schedule = steps if isinstance(steps, int) and steps >= 0 else None
            try:
                layout = optimizer_layout(self.optimizer, self.optimizer_names(self.optimizer))
            except OptimizerStateError:  # state no checkpoint holds (LBFGS): none to hand over
                return None
            return {**layout, "schedule_steps": schedule}

    def optimizer_tensors(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """Run `fn(the optimizer's state tensors by name)` under the lock (a reader)."""
        with self._writing, torch.no_grad():
            try:
                tensors = {} if self.optimizer is None else optimizer_to_checkpoint(
                    self.optimizer)[0]  # fmt: skip
            except OptimizerStateError:
                tensors = {}
            return fn(tensors)

    def optimizer_fits(self, cls: str, shapes: dict[str, tuple[int, ...]], scalars: dict,
                       params: list[str] | None = None) -> None:  # fmt: skip
        """Whether a peer's optimizer state (class, tensor shapes, scalars; by name with the
        names of its parameters, `params`) fits ours (with no optimizer yet there is nothing to
        check: `adopt_optimizer_state` checks it later).

        Raises:
            ValueError: it does not; the message says why.
        """
        with self._lock:
            if self.optimizer is not None:
                check_optimizer_state(self.optimizer, cls, shapes, scalars, params,
                                      self.optimizer_names(self.optimizer))  # fmt: skip


MAX_SCHEDULE_STEPS = 1_000_000  # a scheduler without a closed form is stepped at most this often


def advance_schedule(scheduler: Any, steps: int) -> str | None:
    """Move `scheduler` on to where a peer's is (`steps`: its `last_epoch`), so that a joiner's
    learning rate goes on from the swarm's point in the schedule instead of warming up from zero.
    A LambdaLR (the daemon's schedules) is set at once; any other is stepped there. Returns why
    it was not moved, or None when it was (or was there already).
    """
    from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

    current = getattr(scheduler, "last_epoch", None)
    if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(current, int):
        return f"{type(scheduler).__name__} has no step count to move on"
    if steps <= current:
        return None
    if not isinstance(scheduler, LambdaLR) and steps - current > MAX_SCHEDULE_STEPS:
        return (f"{type(scheduler).__name__} would take {steps - current} steps to catch up "
                f"(at most {MAX_SCHEDULE_STEPS})")  # fmt: skip
    # what the steps change, put back if one fails: the scheduler's own state and its
    # optimizer's hyperparameters (OneCycleLR sets the momentum too)
    saved = scheduler.state_dict()
    with contextlib.suppress(Exception):  # (a user's lambda object that cannot be copied)
        saved = copy.deepcopy(saved)
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", [])
    hyper = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
              for k, v in g.items() if k != "params"} for g in groups]  # fmt: skip
    with warnings.catch_warnings():  # "step() before optimizer.step()": meant for training
        warnings.simplefilter("ignore")
        try:
            if isinstance(scheduler, LambdaLR):  # closed form: lr = base_lr * lambda(epoch)
                scheduler.last_epoch = steps - 1
                scheduler.step()
            else:
                for _ in range(steps - current):
                    scheduler.step()
        except Exception as exc:  # the user's scheduler refused (OneCycleLR past its end, ...)
            scheduler.load_state_dict(saved)  # (it stopped at its end: its steps were spent)
            for group, values in zip(groups, hyper, strict=True):
                for k, v in values.items():  # (a tensor lr is set in place: keep the tensor)
                    if isinstance(v, torch.Tensor) and isinstance(group.get(k), torch.Tensor):
                        group[k].copy_(v)
                    else:
                        group[k] = v
            return f"{type(scheduler).__name__}.step() failed: {exc}"
    return None
