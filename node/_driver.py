# The training driver: local steps in a worker thread, the algorithm told after each, evaluation
# and checkpoints at their cadence, and a clean finish. Invariants: the event loop never waits on
# a step synchronously; the algorithm's `after_step` runs on the loop between two steps (it may
# start exchanges in the background or hold the loop for one of its deadlines, never longer); on
# stop, an exchange in flight gets at most `grace_s` to finish before the last evaluation and
# checkpoint.
from __future__ import annotations

import structlog
import trio

from ._checkpointer import Checkpointer
from ._status_report import Progress
from .algorithms import Algorithm
from .training import LoopClosed, Trainer

log = structlog.get_logger()


class TrainingDriver:
    """Runs the training loop of one node.

    Args:
        trainer: the local model; algorithm: told after each step; checkpointer: writes.
        progress: where evaluations are recorded (the status reads it).
        max_steps: stop after this many local steps (0: until stopped); eval_every,
            checkpoint_every: cadences in steps.
        stop: set to end the loop after the current step.
    """

    def __init__(
        self,
        trainer: Trainer,
        algorithm: Algorithm,
        checkpointer: Checkpointer,
        progress: Progress,
        *,
        max_steps: int,
        eval_every: int,
        checkpoint_every: int,
        stop: trio.Event,
    ) -> None:
        self._trainer = trainer
        self._algorithm = algorithm
        self._checkpointer = checkpointer
        self._progress = progress
        self._max_steps = max_steps
        self._eval_every = eval_every
        self._checkpoint_every = checkpoint_every
        self._stop = stop

    def _done(self) -> bool:
        return self._stop.is_set() or bool(
            self._max_steps and self._trainer.step >= self._max_steps
        )

    async def run(self) -> None:
        """Train until stopped or at max_steps."""
        progress = self._progress
        while not self._done():
            if progress.training_since is None:
                progress.training_since, progress.train_s = trio.current_time(), 0.0
            result = await trio.to_thread.run_sync(self._trainer.train_step)
            progress.train_s = (progress.train_s or 0.0) + result.seconds
            if result.samples:
                progress.samples = (progress.samples or 0) + result.samples
            await self._algorithm.after_step(result)
            if result.step % self._eval_every == 0:
                await self.evaluate()
            if result.step % self._checkpoint_every == 0:
                await self._checkpointer.write()

    async def evaluate(self) -> None:
        """Evaluate the held-out metric now (a worker thread)."""
        self._progress.metric = await trio.to_thread.run_sync(self._trainer.evaluate)
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
        await self._checkpointer.write()


class LoopDriver(TrainingDriver):
    """The training driver of a loop of the user's own: its steps arrive on `steps` (sent by the
    wrapped optimizer from the user's thread); the algorithm, evaluations and checkpoints follow
    them as they do the daemon's own steps. Ends when the channel closes or on stop."""

    def __init__(self, steps: trio.MemoryReceiveChannel, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps = steps

    async def run(self) -> None:
        async with self._steps:
            async for result in self._steps:
                if self._stop.is_set():
                    return
                try:
                    await self._algorithm.after_step(result)
                except LoopClosed:  # a change for the loop's next step, and none came: it closed
                    return
                if self._eval_every and result.step % self._eval_every == 0:
                    await self.evaluate()
                if result.step % self._checkpoint_every == 0:
                    await self._checkpointer.write()
