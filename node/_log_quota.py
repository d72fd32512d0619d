# Log lines a peer's messages cause. Invariant: a kind of line about what peers sent is written at
# most WARNINGS_PER_MINUTE times a minute; the counters (status, metrics) count every case.
from __future__ import annotations

import time

import structlog

WARNINGS_PER_MINUTE = 20  # lines a stranger's bad frames, handshakes or messages may cost the log

log = structlog.get_logger()
_clock = time.monotonic


class _Quota:
    """How many lines of one kind may be written a minute; the rest are counted, and the next
    line written says how many were left out."""

    def __init__(self, per_minute: int = WARNINGS_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self._window_start = -60.0
        self._written = self.suppressed = 0

    def allow(self, now: float) -> bool:
        if now - self._window_start >= 60.0:
            self._window_start, self._written = now, 0
        if self._written < self.per_minute:
            self._written += 1
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n


_QUOTAS: dict[str, _Quota] = {}


def log_within_quota(event: str, level: str = "warning", **fields: object) -> None:
    """Log `event` about what a peer sent, within this process's quota for that event (an
    admitted peer's 2000 unhandled messages wrote 2000 warnings in 3 s); a line written after
    some were left out says how many (`left_out`)."""
    quota = _QUOTAS.setdefault(event, _Quota())
    if not quota.allow(_clock()):
        return
    left_out = quota.take_suppressed()
    if left_out:
        fields["left_out"] = left_out
    getattr(log, level)(event, **fields)
