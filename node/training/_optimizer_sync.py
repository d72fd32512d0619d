# The trainers' side of state sync for optimizer state (Trainer and LoopTrainer share it).
# Invariants: everything runs under the trainer's lock (a worker thread, never beside a step);
# nothing is copied but the chunk a caller reads; a trainer without an optimizer (a library node
# before wrap) has no state to serve and checks nothing it cannot know yet.
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from ..state import check_optimizer_state, optimizer_layout, optimizer_to_checkpoint

T = TypeVar("T")


class OptimizerSync:
    """Mixed into a trainer that has `optimizer` (or None) and `_lock`."""

    optimizer: torch.optim.Optimizer | None
    _lock: threading.Lock | threading.RLock

    def optimizer_layout(self) -> dict | None:
        """The optimizer's class and state tensors, for a joiner (None: no optimizer yet)."""
        with self._lock:
            return None if self.optimizer is None else optimizer_layout(self.optimizer)

    def optimizer_tensors(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """Run `fn(the optimizer's state tensors by name)` under the lock (a reader)."""
        with self._lock, torch.no_grad():
            tensors = {} if self.optimizer is None else optimizer_to_checkpoint(self.optimizer)[0]
            return fn(tensors)

    def optimizer_fits(self, cls: str, shapes: dict[str, tuple[int, ...]], scalars: dict) -> None:
        """Whether a peer's optimizer state (class, tensor shapes, scalars) fits ours (with no
        optimizer yet there is nothing to check: `adopt_optimizer_state` checks it later).

        Raises:
            ValueError: it does not; the message says why.
        """
        with self._lock:
            if self.optimizer is not None:
                check_optimizer_state(self.optimizer, cls, shapes, scalars)
