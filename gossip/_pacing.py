# When a node starts (or checks for) its next pairwise exchange. Invariants: with fraction 0 an
# exchange is due every `every` steps (step % every == 0); with fraction f > 0 the next one is
# due once the node has stepped, since the last one was marked, at least `interval` steps, where
# interval is the last exchange's measured duration over f times the measured step time (so the
# exchanges a node starts take at most about f of its computing time, on whatever link it used),
# never fewer than `every` nor more than `most`. Pure: steps and seconds arrive as arguments.
from __future__ import annotations

import math

STEP_SMOOTHING = 0.2  # weight of the newest step time in the moving average


class ExchangePacer:
    """The cadence of one node's exchanges (adpsgd, choco, selsync).

    Args:
        every: the fewest steps between two exchanges (gossip.exchange_every).
        fraction: 0 for a fixed cadence; else the share of computing time the exchanges a node
            starts may take (gossip.comm_fraction): after an exchange of T seconds, the next one
            waits for T / (fraction x seconds per step) steps.
        most: the most steps between two exchanges (gossip.max_exchange_every).
    """

    def __init__(self, every: int, fraction: float = 0.0, most: int = 1000) -> None:
        if every < 1 or not 0 <= fraction < 1 or most < every:
            raise ValueError(f"every={every}, fraction={fraction}, most={most}: expected "
                             f"every >= 1, 0 <= fraction < 1, most >= every")  # fmt: skip
        self.every, self.fraction, self.most = every, fraction, most
        self.interval = every  # steps between exchanges now
        self.step_s: float | None = None  # seconds per step, a moving average
        self._marked: int | None = None  # the step of the last exchange started or check made
        self.typical = float(every)  # the interval's moving average over exchanges
        self._reported = float(every)  # `typical` as last reported (see `moved`)

    @property
    def adaptive(self) -> bool:
        return self.fraction > 0

    def observe_step(self, seconds: float) -> None:
        """One local step took `seconds`."""
        if seconds > 0:
            s = self.step_s
            self.step_s = seconds if s is None else s + STEP_SMOOTHING * (seconds - s)

    def due(self, step: int) -> bool:
        """Whether an exchange (or selsync's check) is due after local step `step`."""
        if not self.adaptive:
            return step % self.every == 0
        return self._marked is None or step - self._marked >= self.interval

    def mark(self, step: int) -> None:
        """An exchange started (or a check was made) after step `step`."""
        self._marked = step

    def moved(self, by: float = 0.25) -> bool:
        """Whether the typical interval moved by more than `by` (a share) since the last time
        this said so: worth reporting, where the interval's swings between a near partner and a
        far one, or a step of measuring noise, are not."""
        if abs(self.typical - self._reported) <= max(1.0, by * self._reported):
            return False
        self._reported = self.typical
        return True

    def finished(self, seconds: float) -> int:
        """An exchange this node started took `seconds` (done or failed): the interval follows.

        Returns:
            The interval in steps now.
        """
        if self.adaptive and self.step_s:
            wanted = math.ceil(seconds / (self.fraction * self.step_s) * (1 - 1e-9))
            self.interval = max(self.every, min(self.most, wanted))
            self.typical += STEP_SMOOTHING * (self.interval - self.typical)
        return self.interval
