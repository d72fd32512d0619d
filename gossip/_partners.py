# Gossip partner choice. Invariants: a selector never returns its own id or an id outside the
# candidates; randomness only from the injected rng; under "bandwidth", every candidate keeps a
# probability of at least exploration/len(candidates) per choice (the floor that keeps the gossip
# graph connected however slow some links are), and no peer takes more than max_share of a
# selector's recent choices (plus declines and cool-downs against hot spots).
from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ._errors import LocalProtocolError, require_config
from ._links import LinkTable

POLICIES = ("uniform", "ring", "exponential", "bandwidth")
"""uniform: any candidate alike. ring: alternately the next and previous id in sorted order.
exponential: the one-peer exponential graph, hops of 2^0, 2^1, ... 2^(ceil(log2 n) - 1).
bandwidth: the partner whose exchange is expected to finish soonest, kept mixing (see
PartnerConfig)."""


_require = functools.partial(require_config, "PartnerConfig")


@dataclass(frozen=True)
class PartnerConfig:
    """Knobs of partner choice.

    Attributes:
        exploration: chance that a choice is uniform at random (the exploration floor: every
            candidate stays reachable, unknown links get measured).
        long_range_every: every n-th choice is uniform at random too (a periodic long-range
            edge: in a geo swarm most random partners are in another region); 0 disables.
            With exploration 0.2 this makes 40% of choices random, about 30% cross-region on
            geo3: pure averaging needs that much inter-region mixing. In the simulator (64
            peers, 5 seeds) it was the fastest of (0.1, 8), (0.2, 0), (0.2, 4), (0.3, 0), (0.3, 4).
        sample_size: random candidates scored per choice, besides the remembered best; keeps a
            choice O(sample_size + memory) in swarms of thousands.
        memory: how many of the best partners found so far are remembered and re-scored.
        slack: choose at random among candidates expected within (1 + slack) of the best time,
            so equally good partners share the load.
        max_share: at most this share of the last share_window choices may go to one peer.
        share_window: how many recent choices max_share looks at.
        busy_cooldown_s: a peer that declined (busy) or failed is skipped this long; doubled per
            consecutive failure, up to 16 times.
    """

    exploration: float = 0.2
    long_range_every: int = 4
    sample_size: int = 8
    memory: int = 16
    slack: float = 0.25
    max_share: float = 0.25
    share_window: int = 16
    busy_cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        _require(0 < self.exploration <= 1, "exploration", self.exploration, "in (0, 1]")
        _require(self.long_range_every >= 0, "long_range_every", self.long_range_every, ">= 0")
        _require(self.sample_size >= 1, "sample_size", self.sample_size, ">= 1")
        _require(self.memory >= 0, "memory", self.memory, ">= 0")
        _require(self.slack >= 0, "slack", self.slack, ">= 0")
        _require(0 < self.max_share <= 1, "max_share", self.max_share, "in (0, 1]")
        _require(self.share_window >= 1, "share_window", self.share_window, ">= 1")
        _require(self.busy_cooldown_s >= 0, "busy_cooldown_s", self.busy_cooldown_s, ">= 0")


PayloadSize = Callable[[str], int] | int


class Candidates:
    """Peer ids sorted once, shareable by many selectors (the simulator's 10,000 share one).

    Args:
        ids: the live peers; duplicates are dropped. Build a new one when membership changes.
    """

    __slots__ = ("ids", "_pos")

    def __init__(self, ids: Iterable[str]) -> None:
        self.ids: tuple[str, ...] = tuple(sorted(set(ids)))
        self._pos = {p: i for i, p in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)

    def position(self, peer: str) -> int | None:
        return self._pos.get(peer)

    def ring_peer(self, self_id: str, offset: int) -> str:
        """The peer `offset` places after self_id on the ring of these ids plus self_id."""
        ids, pos = self.ids, self._pos.get(self_id)
        if pos is not None:
            return ids[(pos + offset) % len(ids)]
        at = bisect.bisect_left(ids, self_id)  # where self_id would sit
        target = (at + offset) % (len(ids) + 1)
        return ids[target if target < at else target - 1]


class PartnerSelector:
    """Chooses the next gossip partner of one node under one policy.

    Args:
        policy: one of POLICIES.
        self_id: this node's id (never chosen).
        config: exploration, sampling and anti-hot-spot knobs.
        rng: the only source of randomness.
    """

    def __init__(
        self,
        policy: str,
        self_id: str,
        config: PartnerConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise LocalProtocolError(f"policy must be one of {POLICIES}, got {policy!r}")
        if rng is None:
            raise LocalProtocolError("PartnerSelector needs an injected random.Random")
        self.policy = policy
        self.self_id = self_id
        self.config = config or PartnerConfig()
        self._rng = rng
        self._choices = 0
        self._source: Sequence[str] | None = None
        self._view = Candidates(())
        self._known: dict[str, float] = {}  # best partners found: peer -> last expected time
        self._recent: deque[str] = deque()
        self._recent_count: dict[str, int] = {}
        self._cool: dict[str, tuple[float, int]] = {}  # peer -> (skip until, failures)
        self._sampled: list[str] = []  # candidates looked at by the last bandwidth choice

    # -- outcomes ------------------------------------------------------------------------------
    def record_outcome(self, peer: str, ok: bool, now: float) -> None:
        """An exchange with `peer` succeeded or failed (timeout, error, bad payload)."""
        if ok:
            self._cool.pop(peer, None)
            return
        failures = self._cool.get(peer, (0.0, 0))[1] + 1
        pause = self.config.busy_cooldown_s * 2 ** min(failures - 1, 4)  # (_may_retry too)
        self._cool[peer] = (now + pause, failures)
        self._known.pop(peer, None)

    def record_busy(self, peer: str, now: float) -> None:
        """`peer` declined because it is busy: skip it for busy_cooldown_s, no failure counted."""
        failures = self._cool.get(peer, (0.0, 0))[1]
        self._cool[peer] = (now + self.config.busy_cooldown_s, failures)

    def probe_targets(self, links: LinkTable, now: float, limit: int = 2) -> list[str]:
        """Up to `limit` peers the last choice looked at whose links need an active probe.

        Under "bandwidth" node/ should probe these in the background (RTT, then a few MB), so
        that the next choices compare measured links instead of defaults. Empty for other
        policies, which read no estimates.
        """
        if self.policy != "bandwidth":
            return []
        return [p for p in self._sampled if links.needs_probe(p, now)][:limit]

    # -- choice --------------------------------------------------------------------------------
    def choose(
        self,
        candidates: Candidates | Sequence[str],
        links: LinkTable,
        payload_nbytes_for: PayloadSize,
        now: float,
    ) -> str | None:
        """The next partner among `candidates`, or None when there is none.

        Args:
            candidates: live peer ids (self may be among them and is skipped): a Candidates, or
                a sequence, which is sorted once and cached while the same tuple object comes
                back (Membership.live_peers() keeps one tuple until membership changes).
            links: this node's link estimates (read only).
            payload_nbytes_for: bytes an exchange with a peer would carry (per peer, or one int).
            now: the current time.
        """
        view = self._refresh(candidates)
        others = len(view) - (view.position(self.self_id) is not None)
        if others <= 0:
            return None
        self._choices += 1
        if self.policy == "ring":
            peer = view.ring_peer(self.self_id, 1 if self._choices % 2 else -1)
        elif self.policy == "exponential":
            hops = max(1, math.ceil(math.log2(others + 1)))
            peer = view.ring_peer(self.self_id, 2 ** ((self._choices - 1) % hops))
        elif self.policy == "uniform" or self._explore():
            peer = self._random_available(view, now)
        else:
            peer = self._fastest(view, links, payload_nbytes_for, now)
        if peer is not None:
            self._note(peer)
        return peer

    def _refresh(self, candidates: Candidates | Sequence[str]) -> Candidates:
        if isinstance(candidates, Candidates):
            view = candidates
        elif candidates is self._source and isinstance(candidates, tuple):
            return self._view
        else:
            view = Candidates(candidates)
            self._source = candidates
        if view is not self._view:
            self._view = view
            self._known = {p: t for p, t in self._known.items() if view.position(p) is not None}
        return view

    def _explore(self) -> bool:
        cfg = self.config
        if cfg.long_range_every and self._choices % cfg.long_range_every == 0:
            return True
        return self._rng.random() < cfg.exploration

    def _available(self, peer: str, now: float) -> bool:
        cool = self._cool.get(peer)
        if cool is not None and now < cool[0]:
            return False
        limit = self.config.max_share * self.config.share_window
        return self._recent_count.get(peer, 0) < limit

    def _random_other(self, view: Candidates) -> str:
        ids = view.ids
        while True:  # terminates: choose() checked that someone else is there
            peer = ids[self._rng.randrange(len(ids))]
            if peer != self.self_id:
                return peer

    def _random_available(self, view: Candidates, now: float) -> str | None:
        fallback = None
        for _ in range(8):
            peer = self._random_other(view)
            if self._available(peer, now):
                return peer
            if fallback is None and self._may_retry(peer, now):
                fallback = peer
        # everyone tried is pausing: a busy or much-chosen one will do at once, one that failed
        # only once its last failure is busy_cooldown_s old (taken at once, a node whose only
        # peer is gone would retry it at every step; held to its whole pause, up to 16 times
        # that, a node whose only peer came back would wait minutes)
        return fallback

    def _may_retry(self, peer: str, now: float) -> bool:
        """Whether `peer` may be taken when nobody else can (see _random_available)."""
        until, failures = self._cool.get(peer, (0.0, 0))
        if not failures:
            return True
        pause = self.config.busy_cooldown_s * 2 ** min(failures - 1, 4)
        return now - (until - pause) >= self.config.busy_cooldown_s

    def _fastest(
        self, view: Candidates, links: LinkTable, payload: PayloadSize, now: float
    ) -> str | None:
        cfg, rng, ids = self.config, self._rng, view.ids
        # a sample with replacement: a repeat is only scored once; O(sample_size) at any size
        sampled = [ids[int(rng.random() * len(ids))] for _ in range(cfg.sample_size)]
        self._sampled = sampled = [p for p in sampled if p != self.self_id]
        cool, counts = self._cool, self._recent_count
        limit = cfg.max_share * cfg.share_window
        expected = links.expected_transfer_time
        fixed = payload if isinstance(payload, int) else None
        scored: dict[str, float] = {}
        for peer in itertools.chain(self._known, sampled):  # inlined _available(): hot path
            if peer in scored or counts.get(peer, 0) >= limit:
                continue
            pause = cool.get(peer)
            if pause is None or now >= pause[0]:
                scored[peer] = expected(peer, payload(peer) if fixed is None else fixed, now)
        if not scored:
            return self._random_available(view, now)
        best = min(scored.values()) * (1 + cfg.slack)
        near = [p for p, t in scored.items() if t <= best]
        # remember the best found so far, including those skipped now (cooling down, overused)
        merged = {**self._known, **scored}
        self._known = dict(sorted(merged.items(), key=lambda kv: kv[1])[: cfg.memory])
        return near[int(rng.random() * len(near))]

    def _note(self, peer: str) -> None:
        self._recent.append(peer)
        self._recent_count[peer] = self._recent_count.get(peer, 0) + 1
        if len(self._recent) > self.config.share_window:
            old = self._recent.popleft()
            self._recent_count[old] -= 1
            if not self._recent_count[old]:
                del self._recent_count[old]
