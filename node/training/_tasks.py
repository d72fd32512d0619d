# What a node trains. Invariants: a task is a function `(TaskContext) -> Task`; the same config and
# seed give every node the same model initialisation and the same held-out evaluation set, while the
# training shard depends on the node's shard index; batches are already on the task's device.
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._recipe import Recipe

PARTITIONS = ("iid", "dirichlet")
TaskParams = Mapping[str, int | float | str | bool]


class UnknownTaskParam(ValueError):
    """A parameter given to a built-in task that has no such parameter (`key` names it)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class TaskContext:
    """What a task function is told about the node it runs on.

    Attributes:
        shard_index: this node's shard, 0 <= shard_index < num_shards.
        num_shards: how many shards the training data is split into (usually the swarm size).
        seed: the swarm-wide seed: same model initialisation and evaluation set on every node.
        partition: "iid" (uniform shards) or "dirichlet" (label skew, federated-style).
        alpha: Dirichlet concentration; smaller means more skew. Used only by "dirichlet".
        device: where the model and batches must live.
        params: task-specific settings from the config's [training.params] table.
    """

    shard_index: int = 0
    num_shards: int = 1
    seed: int = 0
    partition: str = "iid"
    alpha: float = 0.5
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    params: TaskParams = field(default_factory=dict)
    # the names `param` was asked for (a given parameter never asked for is likely a typo)
    asked: set[str] = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards}: expected >= 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"shard_index={self.shard_index}: expected 0 <= shard_index < {self.num_shards}"
            )
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r}: expected one of {PARTITIONS}")
        if not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha}: expected > 0")

    def param(self, name: str, default: Any, kind: type, at_least: float | None = None) -> Any:
        """A task parameter, checked against the expected type (int accepted where float is)
        and, when given, a lower bound (a size of 0 or -4 failed inside torch)."""
        self.asked.add(name)
        value = self.params.get(name, default)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ValueError(f"training.params.{name}={value!r}: expected {kind.__name__}")
        if at_least is not None and not value >= at_least:
            raise ValueError(f"training.params.{name}={value!r}: expected {kind.__name__} >= "
                             f"{at_least}")  # fmt: skip
        return value

    def unasked(self) -> list[str]:
        """Given parameters the task never asked for through `param` (typos, most likely)."""
        return sorted(set(self.params) - self.asked)

    def check_unasked(self, task: str) -> list[str]:
        """The given parameters task `task` (after it ran on this context) never asked for:
        refused for a built-in task (one was ignored: a typo'd hidden size trained the default
        one), returned for a plugin's, to be warned about (it may read `params` itself).

        Raises:
            UnknownTaskParam: a built-in task's unasked parameter (the first).
        """
        unasked = self.unasked()
        if unasked and ":" not in task:
            known = ", ".join(sorted(self.asked)) or "none"
            raise UnknownTaskParam(unasked[0], f"task {task!r} has no such parameter (its "
                                               f"parameters: {known})")  # fmt: skip
        return unasked


@dataclass
class Task:
    """A model with its data, loss and evaluation, as a task function returns it.

    Attributes:
        model: the torch module to train, on the context's device.
        batches: an endless iterator over this node's training shard.
        loss: `(model, batch) -> scalar tensor`.
        evaluate: `(model) -> float`, the metric on the shared held-out set (no grad needed).
        metric: the metric's name, e.g. "accuracy".
        higher_is_better: direction of the metric.
        default_target: a value worth reaching, used when the user states none.
        lr: a learning rate known to work for this task with its recipe.
        recipe: how the task is best trained (optimizer, warmup and decay, clipping); the
            default is SGD with momentum 0.9 at `lr`, constant, unclipped. The daemon uses it for
            every `training.*` setting the user leaves unset, and the testbed's baselines use it
            whole, so every system trains the task the same way.
        train_size: how many training examples this node's shard holds (None: unknown, e.g. an
            endless generator); differential privacy's sampling rate is batch size / train_size.
    """

    model: torch.nn.Module
    batches: Iterator[Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], float]
    metric: str
    higher_is_better: bool = True
    default_target: float | None = None
    lr: float = 0.05
    train_size: int | None = None  # examples in this node's shard ([privacy]'s sample rate)
    recipe: Recipe = field(default_factory=Recipe)  # default: SGD + momentum, as tasks always had

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


TaskFunction = Callable[[TaskContext], Task]


class TaskError(ValueError):
    """A task plugin broke its contract (not a Task, a loss that is not a scalar tensor, batches
    that end) or raised; the message names the task and what it did."""


def _checked_task(name: str, func: TaskFunction) -> TaskFunction:
    """`func` whose Task is checked, and whose batches, loss and evaluation say which task and
    which part failed when they raise (a plugin's bug otherwise surfaced as an AttributeError
    deep in the trainer, or a bare traceback)."""

    def build(ctx: TaskContext) -> Task:
        try:
            task = func(ctx)
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"task {name!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(task, Task):
            raise TaskError(f"task {name!r} returned {type(task).__name__}, expected a "
                            "geotrain.node.Task (model, batches, loss, evaluate, metric)")
        if not isinstance(task.model, torch.nn.Module):
            raise TaskError(f"task {name!r}: its model is {type(task.model).__name__}, "
                            "expected a torch.nn.Module")
        try:
            batches = iter(task.batches)
        except TypeError:
            raise TaskError(f"task {name!r}: its batches are {type(task.batches).__name__}, "
                            "expected an endless iterator") from None
        task.batches = _named_batches(name, batches)
        task.loss = _named_loss(name, task.loss)
        task.evaluate = _named_evaluate(name, task.evaluate)
        return task

    return build


def _named_batches(name: str, batches: Iterator[Any]) -> Iterator[Any]:
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            raise TaskError(f"task {name!r}: its batches ended; expected an endless iterator "
                            "(endless_batches makes one)") from None
        except Exception as exc:
            raise TaskError(f"task {name!r}: its batches raised {type(exc).__name__}: "
                            f"{exc}") from exc
        yield batch


def _named_loss(name: str, loss: Callable[[torch.nn.Module, Any], torch.Tensor]):
    def checked(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        try:
            value = loss(model, batch)
        except Exception as exc:
            raise TaskError(f"task {name!r}: its loss raised {type(exc).__name__}: "
                            f"{exc}") from exc
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise TaskError(f"task {name!r}: its loss returned {what}, expected a scalar "
                            "tensor (one element, with a gradient) to call backward() on")
        return value

    return checked


def _named_evaluate(name: str, evaluate: Callable[[torch.nn.Module], float]):
    def checked(model: torch.nn.Module) -> float:
        try:
            value = evaluate(model)
            if isinstance(value, str | bytes):  # (float("0.5") took a string as the metric)
                raise TypeError(f"evaluate returned {value!r:.60}: expected a number")
            return float(value)
        except Exception as exc:
            raise TaskError(f"task {name!r}: its evaluate raised or returned no number: "
                            f"{type(exc).__name__}: {exc}") from exc

    return checked


def shard_indices(labels: np.ndarray, ctx: TaskContext) -> np.ndarray:
    """Indices of this node's training examples.

    IID: a seeded permutation cut into `num_shards` near-equal parts. Dirichlet: for each label, the
    examples are split across shards by proportions drawn from Dirichlet(alpha) (seeded, the same
    on every node), so shards are disjoint and together cover every example.
    """
    rng = np.random.default_rng(ctx.seed)
    n = len(labels)
    if ctx.partition == "iid":
        return np.sort(np.array_split(rng.permutation(n), ctx.num_shards)[ctx.shard_index])
    mine: list[np.ndarray] = []
    for label in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(ctx.num_shards, ctx.alpha))
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
        mine.append(np.split(idx, cuts)[ctx.shard_index])
    return np.sort(np.concatenate(mine))


def endless_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled minibatches of (x, y) forever; a fresh seeded permutation each epoch."""
    if len(x) == 0:
        raise ValueError("this node's shard is empty: use fewer shards or more data")
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=gen).to(x.device)
        for start in range(0, len(x), batch_size):
            pick = order[start : start + batch_size]
            yield x[pick], y[pick]


def batch_samples(batch: Any) -> int:
    """Samples in one batch: the first dimension of its first tensor (a tensor, or a tuple or
    list whose first item is one); 1 when that tensor has no dimension, 0 when there is none."""
    first = batch[0] if isinstance(batch, tuple | list) and batch else batch
    if not isinstance(first, torch.Tensor):
        return 0
    return int(first.shape[0]) if first.dim() > 0 else 1


def resolve_task(name: str) -> TaskFunction:
    """Find a task by built-in name or as `package.module:function`.

    Raises:
        ValueError: unknown built-in, a module that does not import, or a missing function.
    """
    from ._builtin import BUILTIN_TASKS

    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    module_name, sep, func_name = name.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(
            f"task {name!r}: expected one of {sorted(BUILTIN_TASKS)} or 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error (a SyntaxError, a raise)
        raise ValueError(f"task {name!r}: cannot import module {module_name!r}: "
                         f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"task {name!r}: module {module_name!r} has no function {func_name!r}")
    return _checked_task(name, func)
