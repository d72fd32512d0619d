# What a node trains, built before it starts: the task and its trainer (or a loop of the
# user's own), the memory estimate with the algorithm's settings fitted to it, and the newest
# checkpoint. Invariants: a config that does not fit limits.memory_gb is refused here, before
# the node listens or writes a file; [privacy] wraps the daemon's trainer only.
from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from ._checkpointer import load_checkpoint
from ._config import ConfigError, NodeConfig
from ._memory import LOOP_OPTIMIZER, MemoryEstimate, check_budget, fit_budget
from ._privacy_ledger import PrivacyLedger
from ._startup import unasked_task_params
from .algorithms import AlgorithmSpec
from .state import Checkpoint, CheckpointStore, StateDir
from .training import LoopTrainer, Task, TaskContext, Trainer, resolve_device, resolve_task

log = structlog.get_logger()


@dataclass(frozen=True)
class Prepared:
    """What `build_training` made: the node runs with these."""

    task: Task | None  # None: a loop of the user's own
    trainer: LoopTrainer  # a Trainer for a task
    checkpoint: Checkpoint | None  # the newest one of this algorithm, or None
    store: CheckpointStore
    config: NodeConfig  # with the algorithm's settings fitted to the memory there is
    memory: MemoryEstimate


def build_training(config: NodeConfig, state: StateDir, spec: AlgorithmSpec,
                   loop: LoopTrainer | None, ledger: PrivacyLedger) -> Prepared:  # fmt: skip
    """Build the trainer (a worker thread: tasks load data, models are allocated).

    Args:
        config: the node's configuration; state: its state directory; spec: its algorithm.
        loop: a loop of the user's own (geotrain.join), or None for the config's task.
        ledger: [privacy], attached to the daemon's trainer.

    Raises:
        ConfigError: [privacy] with a loop of the user's own, an unknown task parameter, the
            privacy settings or ledger. MemoryBudgetError: the config does not fit
            limits.memory_gb. ResumeError: the state directory holds another algorithm's
            checkpoint. ValueError: the task cannot be built.
    """
    t = config.training
    store = CheckpointStore(state.checkpoints, keep=config.state.keep)
    if loop is not None:
        if config.privacy.enabled:  # the user's own optimizer is not ours to wrap
            raise ConfigError("privacy.epsilon: [privacy] covers the daemon's own training "
                              "only, not a loop of your own (geotrain.join)")  # fmt: skip
        config, memory = fit_memory(config, loop, spec, LOOP_OPTIMIZER,
                                    "assumed until wrap() shows yours")  # fmt: skip
        ckpt = load_checkpoint(store, config.gossip.algorithm)
        return Prepared(None, loop, ckpt, store, config, memory)
    if t.threads:
        torch.set_num_threads(t.threads)
    ctx = TaskContext(shard_index=t.shard_index, num_shards=t.num_shards, seed=t.seed,
                      partition=t.partition, alpha=t.alpha, device=resolve_device(t.device),
                      params=t.params)  # fmt: skip
    task = resolve_task(t.task)(ctx)
    for warning in unasked_task_params(t.task, ctx):
        warning.log(log)
    # unset settings (None) take the task's recipe; with [privacy] its per-sample clipping
    # replaces the recipe's clipping of the whole gradient
    clip = 0.0 if config.privacy.enabled else t.clip_grad_norm
    trainer = Trainer(
        task, optimizer=t.optimizer, lr=t.lr, slowdown=t.slowdown,
        precision=t.precision, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
        schedule=t.schedule, total_steps=t.total_steps, min_lr_ratio=t.min_lr_ratio,
        clip_grad_norm=clip, accumulate=t.accumulate, step_time_s=t.step_time_ms / 1000,
    )  # fmt: skip
    ledger.attach(trainer)
    config, memory = fit_memory(config, trainer, spec, trainer.recipe.optimizer)
    return Prepared(task, trainer, load_checkpoint(store, config.gossip.algorithm), store,
                    config, memory)  # fmt: skip


def fit_memory(config: NodeConfig, trainer: LoopTrainer, spec: AlgorithmSpec,
               optimizer: str | None, described: str = "") -> tuple[NodeConfig, MemoryEstimate]:
    """Estimate the memory the node needs, lower the algorithm's settings that grow with it to
    what fits (logged), and refuse a config that still does not.

    Returns:
        The config (fitted, or as given) and its estimate.

    Raises:
        MemoryBudgetError: it does not fit limits.memory_gb.
    """
    config, memory, fitted = fit_budget(config, trainer, spec, optimizer, described)
    if fitted:
        log.warning("memory_fitted", detail=fitted)
    say_estimate(memory, config.limits.memory_gb)
    check_budget(config, memory)
    return config, memory


def say_estimate(memory: MemoryEstimate, limit_gb: float | None, hint: str = "") -> None:
    """Log the memory estimate (a warning, with `hint`, when it says something is wrong)."""
    (log.warning if hint else log.info)(
        "memory_estimate", need_gb=round(memory.total_gb, 3), detail=memory.explain(),
        limit_gb=limit_gb, **({"hint": hint} if hint else {}))  # fmt: skip
