# Dial backoff: after repeated failed handshakes to one address, the transport waits before it
# tries that address again. Invariants: the first retry after a single failure is immediate (a
# peer that restarted or a one-off mismatch costs nothing); from the second consecutive failure on
# the wait doubles from BASE_S up to CAP_S, each wait drawn in [half, full] (jitter, so many nodes
# refused by one peer do not retry in lockstep); one success clears the address; the table holds
# at most MAX_ADDRESSES entries (the oldest is forgotten first), so addresses from the network
# cannot grow it without bound.
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

BASE_S = 1.0
CAP_S = 300.0
MAX_ADDRESSES = 4096


@dataclass
class _Failures:
    count: int
    retry_at: float


class DialBackoff:
    """Consecutive handshake failures per address, and when the next try is allowed."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._by_address: OrderedDict[str, _Failures] = OrderedDict()

    def wait_s(self, address: str, now: float) -> float:
        """Seconds until `address` may be dialled again (0: now)."""
        failures = self._by_address.get(address)
        return 0.0 if failures is None else max(0.0, failures.retry_at - now)

    def failures(self, address: str) -> int:
        failures = self._by_address.get(address)
        return 0 if failures is None else failures.count

    def failed(self, address: str, now: float) -> float:
        """Record a failed handshake; returns the wait before the next try."""
        failures = self._by_address.pop(address, None) or _Failures(0, now)
        failures.count += 1
        wait = 0.0
        if failures.count >= 2:
            full = min(CAP_S, BASE_S * 2 ** (failures.count - 2))
            wait = self._rng.uniform(full / 2, full)
        failures.retry_at = now + wait
        self._by_address[address] = failures
        while len(self._by_address) > MAX_ADDRESSES:
            self._by_address.popitem(last=False)
        return wait

    def succeeded(self, address: str) -> None:
        self._by_address.pop(address, None)
