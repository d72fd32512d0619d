# When to evaluate: every so many steps, and also once so many seconds have passed since the
# last evaluation ended. A node's training driver and the testbed's baseline workers share it,
# so every system in a comparison evaluates by the same rule.
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class EvalCadence:
    """Evaluate every `every` steps (0: never by steps), and also once `every_s` seconds of
    `clock` have passed since the last evaluation ended or the first step (0: by steps only).
    With slow steps a step count alone puts minutes between evaluations, and a time to a
    quality level is then only known to within those minutes."""

    def __init__(self, every: int, every_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.every, self.every_s, self._clock = every, every_s, clock
        self._last: float | None = None
        self.spent_s = 0.0  # seconds in evaluations timed by `evaluating`

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` (then call `evaluated` when it is done)."""
        if self.every and step % self.every == 0:
            return True
        if not self.every_s:
            return False
        now = self._clock()
        if self._last is None:  # the clock starts at the first step
            self._last = now
        return now - self._last >= self.every_s

    def evaluated(self) -> None:
        """An evaluation ended: the clock starts again from its end (from its start, one as
        long as every_s made every step one)."""
        self._last = self._clock()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around an evaluation: `evaluated` at its end, and its seconds added to `spent_s`
        (compute utilization leaves them out). One that raises is neither."""
        began = self._clock()
        yield
        self.evaluated()
        self.spent_s += self._last - began  # type: ignore[operator]
