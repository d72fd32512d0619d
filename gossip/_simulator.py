# Pure-averaging simulator: the real LinkTable and PartnerSelector of every peer, a simulated clock
# and a region link matrix. Invariants: the mean of all vectors never changes (pairwise averaging
# is atomic at an exchange's end); the tracked sum of squared distances equals the recomputed one
# up to float error (it is recomputed every `n` exchanges); everything random is seeded.
from __future__ import annotations

import functools
import heapq
import math
import random
from dataclasses import dataclass, field

import numpy as np

from ._consensus import consensus_distance
from ._errors import require_config
from ._links import LinkConfig, LinkTable
from ._partners import POLICIES, Candidates, PartnerConfig, PartnerSelector
from ._scenarios import Scenario

DECLINE_NBYTES = 64
"""Bytes of a "busy" reply (a header), counted in bytes_total."""

_require = functools.partial(require_config, "SimConfig")


@dataclass(frozen=True)
class SimConfig:
    """One simulated averaging run.

    Attributes:
        peers: number of peers.
        dim: length of each peer's vector (averaging is per coordinate; a few suffice).
        payload_nbytes: bytes one exchange carries each way: 100 MB is a 25M-parameter fp32 model.
        eps_relative: eps = eps_relative * initial consensus distance.
        max_rounds: stop a policy after this many rounds if it has not reached eps.
        max_inbound: exchanges a peer serves at once for others; more are declined as busy.
        warmup_rounds: rounds of exchanges run before measuring "bandwidth" (the one policy whose
            choices depend on what was measured), after which the vectors are
            reset to their initial values and time, rounds and bytes count from zero: link
            tables start warm, as in a training run that averages for hours. 0: cold start.
        probes_per_choice: active link probes a peer starts per choice, for the peers its
            selector asks for (PartnerSelector.probe_targets); only "bandwidth" asks.
        probe_nbytes: bytes of one active probe (after a ping for the RTT), at most the payload;
            counted in bytes_total.
        seed: seeds initial vectors, start times and every selector.
        partner: the selectors' config.
    """

    peers: int = 64
    dim: int = 4
    payload_nbytes: int = 100_000_000
    eps_relative: float = 1e-4
    max_rounds: float = 100.0
    max_inbound: int = 2
    warmup_rounds: float = 5.0
    probes_per_choice: int = 4
    probe_nbytes: int = 4_000_000
    seed: int = 0
    partner: PartnerConfig = field(default_factory=PartnerConfig)

    def __post_init__(self) -> None:
        _require(self.peers >= 2, "peers", self.peers, ">= 2")
        _require(self.dim >= 1, "dim", self.dim, ">= 1")
        _require(self.payload_nbytes >= 1, "payload_nbytes", self.payload_nbytes, ">= 1")
        _require(0 < self.eps_relative < 1, "eps_relative", self.eps_relative, "in (0, 1)")
        _require(self.max_rounds > 0, "max_rounds", self.max_rounds, "> 0")
        _require(self.max_inbound >= 1, "max_inbound", self.max_inbound, ">= 1")
        _require(self.warmup_rounds >= 0, "warmup_rounds", self.warmup_rounds, ">= 0")
        _require(self.probes_per_choice >= 0, "probes_per_choice", self.probes_per_choice, ">= 0")
        _require(self.probe_nbytes >= 1, "probe_nbytes", self.probe_nbytes, ">= 1")


@dataclass(frozen=True)
class PolicyResult:
    """How one policy did. Times are simulated seconds; a round is n/2 exchanges.

    rounds_to_eps, time_to_eps_s are None when eps was not reached within max_rounds; bytes_total
    counts both directions of every exchange and every decline until eps (or the end).
    """

    policy: str
    rounds_to_eps: float | None
    time_to_eps_s: float | None
    bytes_total: int
    exchanges: int
    declined: int
    cross_region_share: float
    final_distance: float
    curve: tuple[tuple[float, float, float], ...]  # (sim time s, rounds, consensus distance)


class _Links:
    """Per peer pair: RTT and bandwidth from the scenario's region matrix."""

    def __init__(self, scenario: Scenario, n: int) -> None:
        self.region = [i % len(scenario.regions) for i in range(n)]
        names = scenario.regions
        self.rtt = [[2 * scenario.link(a, b).one_way_delay_s for b in names] for a in names]
        self.bytes_per_s = [[scenario.link(a, b).bandwidth_bps / 8 for b in names] for a in names]


def simulate(scenario: Scenario, policy: str, config: SimConfig) -> PolicyResult:
    """Run asynchronous pairwise averaging (AD-PSGD's exchange pattern) under one policy.

    Every peer exchanges with one partner at a time, back to back: it asks its selector, the
    exchange lasts RTT + payload / bandwidth (bandwidth split among the exchanges either end has
    in flight when it starts), then both peers take the average of their two vectors and record
    the transfer in their link tables. A partner already serving max_inbound exchanges declines
    after one RTT, and the selector is told it was busy.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return _Run(scenario, policy, config).run()


class _Run:
    def __init__(self, scenario: Scenario, policy: str, cfg: SimConfig) -> None:
        n = cfg.peers
        self.cfg, self.policy, self.n = cfg, policy, n
        x = np.random.default_rng(cfg.seed).standard_normal((n, cfg.dim))  # (n_peers, dim)
        self.x0 = x - x.mean(axis=0)
        # Rows as Python lists: at dim 4 plain floats beat numpy's per-call overhead 5 to 1.
        # A row is replaced, never changed in place, so two peers may share one after averaging.
        self.rows: list[list[float]] = self.x0.tolist()
        self.sq = float((self.x0**2).sum())  # sum over peers of squared distance to the mean (0)
        self.eps = cfg.eps_relative * self.sq / n
        self.ids = tuple(f"p{i:05d}" for i in range(n))
        self.index = {p: i for i, p in enumerate(self.ids)}
        self.candidates = Candidates(self.ids)  # one sorted view shared by every selector
        self.probe_nbytes = min(cfg.probe_nbytes, cfg.payload_nbytes)
        self.pending: list[list[tuple[float, int, float]]] = [[] for _ in range(n)]  # probes
        self.net = _Links(scenario, n)
        shared = LinkConfig()
        self.links = [LinkTable(shared) for _ in range(n)]
        self.selectors = [
            PartnerSelector(policy, self.ids[i], cfg.partner, random.Random(cfg.seed * 7919 + i))
            for i in range(n)
        ]
        start = random.Random(cfg.seed)
        # (time, tiebreak, partner or -1 for "free to start", peer, exchange start time)
        self.queue = [(start.random() * 1e-3, i, -1, i, 0.0) for i in range(n)]
        heapq.heapify(self.queue)
        self.seq = n
        self.inflight = [0] * n  # exchanges each peer takes part in
        self.inbound = [0] * n  # of those, the ones it serves for others
        self.exchanges = self.declined = self.cross = self.bytes_total = 0
        self.curve = [(0.0, 0.0, self.sq / n)]

    def _push(self, t: float, j: int, i: int, started: float) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, j, i, started))

    def _reset(self, t: float) -> None:
        """End of warm-up: vectors back to their initial values, counters to zero."""
        self.rows = self.x0.tolist()
        self.sq = float((self.x0**2).sum())
        self.t0 = t
        self.exchanges = self.declined = self.cross = self.bytes_total = 0
        self.curve = [(0.0, 0.0, self.sq / self.n)]

    def run(self) -> PolicyResult:
        n, reached = self.n, None
        # Only "bandwidth" reads link estimates; the others gain nothing from a warm-up.
        self.t0, warm = 0.0, self.cfg.warmup_rounds == 0 or self.policy != "bandwidth"
        next_curve, max_exchanges = n // 2, self.cfg.max_rounds * n / 2
        while self.queue and self.exchanges < max_exchanges:
            t, _, j, i, started = heapq.heappop(self.queue)
            if j < 0:
                self._start(i, t)
                continue
            self._finish(i, j, t, started)
            if not warm:
                if self.exchanges >= self.cfg.warmup_rounds * n / 2:
                    warm = True
                    self._reset(t)
                continue
            if self.exchanges >= next_curve:
                next_curve += n // 2
                self.sq = float((np.asarray(self.rows) ** 2).sum())  # drop accumulated rounding
                self.curve.append((t - self.t0, 2 * self.exchanges / n, self.sq / n))
            if self.sq / n <= self.eps:
                reached = (t - self.t0, 2 * self.exchanges / n)
                self.curve.append((*reached, self.sq / n))
                break
        return PolicyResult(
            policy=self.policy,
            rounds_to_eps=None if reached is None else round(reached[1], 3),
            time_to_eps_s=None if reached is None else round(reached[0], 4),
            bytes_total=self.bytes_total,
            exchanges=self.exchanges,
            declined=self.declined,
            cross_region_share=round(self.cross / max(1, self.exchanges), 4),
            final_distance=consensus_distance(np.asarray(self.rows)),
            curve=tuple(self.curve),
        )

    def _apply_probes(self, i: int, t: float) -> None:
        """Fold in i's probes that ended by t. Only i's own choices and exchanges read its link
        table, so applying results at those moments, in order, equals applying them on arrival
        (and saves a queue event per probe)."""
        pending = self.pending[i]
        done = [p for p in pending if p[0] <= t]
        if not done:
            return
        self.pending[i] = [p for p in pending if p[0] > t]
        for t_done, j, started in sorted(done):
            rtt = self.net.rtt[self.net.region[i]][self.net.region[j]]
            # a ping's RTT, then probe_nbytes timed
            self.links[i].record_rtt(self.ids[j], rtt, started + rtt)
            self.links[i].record_transfer(
                self.ids[j], self.probe_nbytes, t_done - started - rtt, t_done
            )

    def _start(self, i: int, t: float) -> None:
        cfg, net = self.cfg, self.net
        selector = self.selectors[i]
        if self.pending[i]:
            self._apply_probes(i, t)
        peer = selector.choose(self.candidates, self.links[i], cfg.payload_nbytes, t)
        for target in selector.probe_targets(self.links[i], t, cfg.probes_per_choice):
            k = self.index[target]
            rtt = net.rtt[net.region[i]][net.region[k]]
            # the probe starts now and, after a ping, moves probe_nbytes at the link's bandwidth
            duration = 2 * rtt + self.probe_nbytes / net.bytes_per_s[net.region[i]][net.region[k]]
            self.bytes_total += self.probe_nbytes + 2 * DECLINE_NBYTES
            self.pending[i].append((t + duration, k, t))
        j = self.index[peer]
        ri, rj = net.region[i], net.region[j]
        rtt = net.rtt[ri][rj]
        if self.inbound[j] >= cfg.max_inbound:
            self.selectors[i].record_busy(peer, t + rtt)
            self.links[i].record_rtt(peer, rtt, t + rtt)
            self.declined += 1
            self.bytes_total += 2 * DECLINE_NBYTES
            self._push(t + rtt, -1, i, t)
            return
        self.inflight[i] += 1
        self.inflight[j] += 1
        self.inbound[j] += 1
        share = max(self.inflight[i], self.inflight[j])
        self._push(t + rtt + cfg.payload_nbytes * share / net.bytes_per_s[ri][rj], j, i, t)

    def _finish(self, i: int, j: int, t: float, started: float) -> None:
        pending = self.pending
        if pending[i]:
            self._apply_probes(i, t)
        if pending[j]:
            self._apply_probes(j, t)
        rows, nbytes = self.rows, self.cfg.payload_nbytes
        a, b = rows[i], rows[j]
        self.sq -= 0.5 * math.dist(a, b) ** 2
        rows[i] = rows[j] = [0.5 * (u + v) for u, v in zip(a, b, strict=True)]
        self.inflight[i] -= 1
        self.inflight[j] -= 1
        self.inbound[j] -= 1
        self.exchanges += 1
        self.cross += self.net.region[i] != self.net.region[j]
        self.bytes_total += 2 * nbytes
        rtt = self.net.rtt[self.net.region[i]][self.net.region[j]]
        for a, b in ((i, j), (j, i)):
            self.links[a].record_rtt(self.ids[b], rtt, t)
            self.links[a].record_transfer(self.ids[b], nbytes, t - started, t)
        self.selectors[i].record_outcome(self.ids[j], True, t)
        self._push(t, -1, i, t)


def compare_policies(scenario: Scenario, config: SimConfig, policies: tuple[str, ...]) -> dict:
    """Run every policy on the same scenario, vectors and seed; a JSON-able report.

    The report: {"scenario", "peers", "eps", "eps_relative", "initial_distance",
    "payload_nbytes", "seed", "max_rounds", "warmup_rounds", "policies": [{"policy",
    "rounds_to_eps", "time_to_eps_s", "bytes_total", "exchanges", "declined",
    "cross_region_share", "final_distance", "time_vs_uniform"}]}. time_vs_uniform is this
    policy's time to eps over uniform's (None unless both reached eps).
    """
    x = np.random.default_rng(config.seed).standard_normal((config.peers, config.dim))
    initial = consensus_distance(x)
    results = [simulate(scenario, policy, config) for policy in policies]
    uniform = next((r.time_to_eps_s for r in results if r.policy == "uniform"), None)
    rows = []
    for r in results:
        ratio = None
        if uniform and r.time_to_eps_s is not None:
            ratio = round(r.time_to_eps_s / uniform, 4)
        rows.append(
            {
                "policy": r.policy,
                "rounds_to_eps": r.rounds_to_eps,
                "time_to_eps_s": r.time_to_eps_s,
                "bytes_total": r.bytes_total,
                "exchanges": r.exchanges,
                "declined": r.declined,
                "cross_region_share": r.cross_region_share,
                "final_distance": r.final_distance,
                "time_vs_uniform": ratio,
            }
        )
    return {
        "scenario": scenario.name,
        "peers": config.peers,
        "eps": config.eps_relative * initial,
        "eps_relative": config.eps_relative,
        "initial_distance": initial,
        "payload_nbytes": config.payload_nbytes,
        "seed": config.seed,
        "max_rounds": config.max_rounds,
        "warmup_rounds": config.warmup_rounds,
        "policies": rows,
    }
