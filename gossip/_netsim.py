# An in-memory network of Membership machines on a simulated clock, for tests and the simulator.
# Invariants: nothing here reads a clock or global randomness (delays and losses come from the
# injected rng); messages are delivered in time order; a crashed node neither receives nor ticks;
# a message between two partition groups is dropped, as is one drawn lost.
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable

from ._membership import Membership, Send


class MemoryNetwork:
    """Delivers Sends between Membership instances with delay, seeded loss and partitions.

    Args:
        rng: draws losses and delay jitter.
        delay_s: one-way delay of every message.
        jitter_s: uniform extra delay in [0, jitter_s).
    """

    def __init__(self, rng: random.Random, delay_s: float = 0.05, jitter_s: float = 0.0) -> None:
        self.now = 0.0
        self.rng = rng
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.nodes: dict[str, Membership] = {}
        self.loss: dict[str, float] = {}  # peer id -> loss of every message to or from it
        self.crashed: set[str] = set()
        self.delivered = 0
        self.dropped = 0
        self._by_address: dict[str, str] = {}
        self._group: dict[str, int] = {}
        self._queue: list[tuple[float, int, str, str, object]] = []
        self._seq = 0

    def add(self, node: Membership, address: str) -> None:
        self.nodes[node.self_id] = node
        self._by_address[address] = node.self_id

    def send(self, sender_id: str, sends: Iterable[Send]) -> None:
        """Put `sender_id`'s outgoing messages on the wire."""
        for send in sends:
            dest = send.peer_id or self._by_address.get(send.address)
            if dest is None:
                self.dropped += 1
                continue
            delay = self.delay_s + (self.rng.random() * self.jitter_s if self.jitter_s else 0.0)
            self._seq += 1
            heapq.heappush(
                self._queue, (self.now + delay, self._seq, dest, sender_id, send.message)
            )

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        """Split the network: messages cross no group boundary until heal()."""
        self._group = {peer: i for i, group in enumerate(groups) for peer in group}

    def heal(self) -> None:
        self._group = {}

    def _lost(self, src: str, dst: str) -> bool:
        if self._group and self._group.get(src, -1) != self._group.get(dst, -1):
            return True
        p = max(self.loss.get(src, 0.0), self.loss.get(dst, 0.0))
        return p > 0 and self.rng.random() < p

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None) -> None:
        """Deliver messages and run timers in time order up to `t_end` (or until `stop()`)."""
        while True:
            live = [n for p, n in self.nodes.items() if p not in self.crashed]
            node = min(live, key=lambda n: n.next_deadline(), default=None)
            t_node = node.next_deadline() if node is not None else float("inf")
            t_msg = self._queue[0][0] if self._queue else float("inf")
            t = min(t_node, t_msg)
            if t > t_end:
                self.now = t_end
                return
            self.now = max(self.now, t)
            if t_msg <= t_node:
                _, _, dest, src, msg = heapq.heappop(self._queue)
                if dest in self.crashed or dest not in self.nodes or self._lost(src, dest):
                    self.dropped += 1
                    continue
                self.delivered += 1
                self.send(dest, self.nodes[dest].receive(msg, src, self.now))
            else:
                self.send(node.self_id, node.tick(self.now))
            if stop is not None and stop():
                return
