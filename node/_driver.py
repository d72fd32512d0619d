# The training driver, one for the daemon and a loop of the user's own: each local step (the
# daemon's taken in a worker thread, a user's sent from their thread), the algorithm told after
# it, evaluation and checkpoints at their cadence, and a clean finish. Invariants: the event loop
# never waits on a step synchronously; the algorithm's `after_step` runs on the loop between two
# steps (it may start exchanges in the background or hold the loop for one of its deadlines,
# never longer); on stop, an exchange in flight gets at most `grace_s` to finish before the last
# evaluation and checkpoint.
from __future__ import annotations

import structlog
import trio

from ._cadence import EvalCadence
from ._checkpointer import Checkpointer
from ._status_report import Progress
from .algorithms import Algorithm
from .training import LoopClosed, LoopTrainer, StepResult

log = structlog.get_logger()


class TrainingDriver:
    """Runs the training loop of one node.

    Args:
        trainer: the local model; algorithm: told after each step; checkpointer: writes.
        progress: where evaluations are recorded (the status reads it).
        max_steps: stop after this many local steps (0: until stopped); eval_every,
            checkpoint_every: cadences in steps; eval_every_s: also evaluate once this many
            seconds have passed since the last evaluation (0: by steps only).
        stop: set to end the loop after the current step.
    """

    def __init__(
        self,
        trainer: LoopTrainer,
        algorithm: Algorithm,
        checkpointer: Checkpointer,
        progress: Progress,
        *,
        max_steps: int,
        eval_every: int,
        checkpoint_every: int,
        stop: trio.Event,
        eval_every_s: float = 0.0,
    ) -> None:
        self._trainer = trainer
        self._algorithm = algorithm
        self._checkpointer = checkpointer
        self._progress = progress
        self._max_steps = max_steps
        self._evaluations = EvalCadence(eval_every, eval_every_s, clock=trio.current_time)
        self._checkpoint_every = checkpoint_every
        self._stop = stop

    def _done(self) -> bool:
        return self._stop.is_set() or bool(
            self._max_steps and self._trainer.step >= self._max_steps
        )

    async def next_step(self) -> StepResult | None:
        """The daemon's next step, taken now in a worker thread (None: stop)."""
        if self._done():
            return None
        progress = self._progress
        if progress.training_since is None:
            progress.training_since, progress.train_s = trio.current_time(), 0.0
        result = await trio.to_thread.run_sync(self._trainer.train_step)
        progress.train_s = (progress.train_s or 0.0) + result.seconds
        if result.samples:
            progress.samples = (progress.samples or 0) + result.samples
        return result

    async def run(self) -> None:
        """Train until stopped (or at max_steps, or the loop's end): each step, the algorithm,
        then evaluations and checkpoints at their cadence."""
        while (result := await self.next_step()) is not None:
            try:
                await self._algorithm.after_step(result)
            except LoopClosed:  # a change for the loop's next step, and none came: it closed
                return
            if self._evaluations.due(result.step):
                await self.evaluate()
            if result.step % self._checkpoint_every == 0:
                await self._checkpointer.write()

    async def evaluate(self) -> None:
        """Evaluate the held-out metric now (a worker thread)."""
        with self._evaluations.evaluating():
            metric = await trio.to_thread.run_sync(self._trainer.evaluate)
        self._progress.eval_s = self._evaluations.spent_s  # (compute utilization leaves it out)
        if metric is not None:  # (None: it failed, logged; the last metric stays)
            self._progress.metric = metric
            self._progress.metric_step = self._trainer.step
        private = getattr(self._trainer, "private", None)  # [privacy]: the spent epsilon, logged
        if private is not None:  # at every evaluation (status and metrics have it all the time)
            stats = private.statistics()
            log.info("privacy_epsilon", step=self._trainer.step,
                     epsilon=round(stats.epsilon_spent, 4), budget=stats.epsilon_budget,
                     exhausted=stats.exhausted)  # fmt: skip

    async def finish(self, grace_s: float) -> None:
        """Let an exchange in flight end (at most `grace_s`), then evaluate and checkpoint."""
        with trio.move_on_after(grace_s):
            while self._algorithm.busy():
                await trio.sleep(0.01)
        await self.evaluate()
        await self._checkpointer.write(final=True)


class LoopDriver(TrainingDriver):
    """The training driver of a loop of the user's own: its steps arrive on `steps` (sent by the
    wrapped optimizer from the user's thread) instead of being taken here; the rest is the
    daemon's. Ends when the channel closes or on stop."""

    def __init__(self, steps: trio.MemoryReceiveChannel, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = steps

    async def next_step(self) -> StepResult | None:
        try:
            result = await self._steps.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        return None if self._stop.is_set() else result

    async def run(self) -> None:
        async with self._steps:
            await super().run()
