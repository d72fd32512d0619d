# Per-peer link estimates: smoothed RTT with variance (RFC 6298), goodput from real transfers,
# and the deadlines derived from them. Invariants: estimates only change through record_*();
# an unknown link falls back to the config's conservative defaults; every deadline lies within
# [deadline_floor_s, deadline_cap_s]; state_dict() holds only JSON types and ages, never clocks.
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ._errors import LocalProtocolError, require_config

STATE_VERSION = 1


_require = functools.partial(require_config, "LinkConfig")


@dataclass(frozen=True)
class LinkConfig:
    """How link estimates are smoothed, defaulted and turned into deadlines.

    Attributes:
        rtt_alpha: weight of a new RTT sample in the smoothed RTT (RFC 6298: 1/8).
        rtt_beta: weight of a new deviation in the RTT variance (RFC 6298: 1/4).
        goodput_alpha: weight of a new goodput sample.
        default_rtt_s: RTT assumed for a link never measured: a long WAN path (0.3 s).
        default_goodput_bytes_per_s: goodput assumed for a link never measured: 10 Mbit/s, a
            slow home uplink, so an unknown link gets a generous deadline, then learns.
        min_goodput_sample_bytes: transfers smaller than this are latency-bound and do not move
            the goodput estimate (they still refresh the age).
        stale_after_s: an estimate older than this asks for an active probe.
        deadline_factor: an exchange deadline is this multiple of the expected time ...
        deadline_rttvar_mult: ... plus this many RTT deviations,
        deadline_floor_s: ... but never below this (scheduling noise, small payloads),
        deadline_cap_s: ... and never above this (a stuck transfer must end).
        failure_backoff: each consecutive failure stretches the deadline by this factor, so a
            link that is slower than believed is still given a chance to prove it.
    """

    rtt_alpha: float = 0.125
    rtt_beta: float = 0.25
    goodput_alpha: float = 0.25
    default_rtt_s: float = 0.3
    default_goodput_bytes_per_s: float = 10e6 / 8
    min_goodput_sample_bytes: int = 64 * 1024
    stale_after_s: float = 300.0
    deadline_factor: float = 2.0
    deadline_rttvar_mult: float = 4.0
    deadline_floor_s: float = 1.0
    deadline_cap_s: float = 900.0
    failure_backoff: float = 1.5

    def __post_init__(self) -> None:
        for name in ("rtt_alpha", "rtt_beta", "goodput_alpha"):
            value = getattr(self, name)
            _require(0 < value <= 1, name, value, "in (0, 1]")
        for name in ("default_rtt_s", "default_goodput_bytes_per_s", "stale_after_s"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        _require(
            self.min_goodput_sample_bytes >= 0,
            "min_goodput_sample_bytes",
            self.min_goodput_sample_bytes,
            ">= 0",
        )
        _require(self.deadline_factor >= 1, "deadline_factor", self.deadline_factor, ">= 1")
        _require(
            self.deadline_rttvar_mult >= 0,
            "deadline_rttvar_mult",
            self.deadline_rttvar_mult,
            ">= 0",
        )
        _require(self.deadline_floor_s > 0, "deadline_floor_s", self.deadline_floor_s, "> 0")
        _require(
            self.deadline_cap_s >= self.deadline_floor_s,
            "deadline_cap_s",
            self.deadline_cap_s,
            f">= deadline_floor_s ({self.deadline_floor_s})",
        )
        _require(self.failure_backoff >= 1, "failure_backoff", self.failure_backoff, ">= 1")


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What is known about the link to one peer, at one moment.

    Attributes:
        rtt_s: smoothed round-trip time (the default when never measured).
        rttvar_s: smoothed RTT deviation (half the default RTT when never measured).
        goodput_bytes_per_s: smoothed goodput of real transfers (the default when none).
        age_s: seconds since the last measurement of any kind (inf: never measured).
        failures: consecutive failed exchanges (reset by a success).
        rtt_known: an RTT was measured.
        goodput_known: a transfer large enough to measure goodput completed.
    """

    rtt_s: float
    rttvar_s: float
    goodput_bytes_per_s: float
    age_s: float
    failures: int
    rtt_known: bool
    goodput_known: bool

    def transfer_time(self, nbytes: int) -> float:
        """Expected seconds to move `nbytes` over this link: one RTT plus bytes over goodput."""
        return self.rtt_s + nbytes / self.goodput_bytes_per_s


class _Link:
    __slots__ = ("srtt", "rttvar", "goodput", "last", "failures")

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.goodput: float | None = None
        self.last = -math.inf
        self.failures = 0


class LinkTable:
    """Link estimates for every peer this node has talked to.

    Args:
        config: smoothing, defaults and deadline shape.
    """

    def __init__(self, config: LinkConfig | None = None) -> None:
        self.config = config or LinkConfig()
        self._links: dict[str, _Link] = {}

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, peer: object) -> bool:
        return peer in self._links

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link()
        return link

    def record_rtt(self, peer: str, rtt_s: float, now: float) -> None:
        """Fold one RTT sample in (Jacobson/Karels, as in RFC 6298)."""
        if not rtt_s >= 0 or not math.isfinite(rtt_s):
            raise LocalProtocolError(f"rtt_s must be finite and >= 0, got {rtt_s!r}")
        link, cfg = self._link(peer), self.config
        if link.srtt is None:
            link.srtt, link.rttvar = rtt_s, rtt_s / 2
        else:
            link.rttvar += cfg.rtt_beta * (abs(link.srtt - rtt_s) - link.rttvar)
            link.srtt += cfg.rtt_alpha * (rtt_s - link.srtt)
        link.last = max(link.last, now)

    def record_transfer(self, peer: str, nbytes: int, seconds: float, now: float) -> None:
        """Fold in a completed transfer of `nbytes` that took `seconds` end to end.

        The RTT part of the time (when known) is taken out before dividing, so that goodput and
        transfer_time() describe the same model: time = rtt + nbytes / goodput. A success also
        clears the failure count.
        """
        if nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
            raise LocalProtocolError(f"bad transfer: nbytes={nbytes!r} seconds={seconds!r}")
        link, cfg = self._link(peer), self.config
        link.failures = 0
        link.last = max(link.last, now)
        if nbytes < cfg.min_goodput_sample_bytes:
            return
        latency = link.srtt if link.srtt is not None else 0.0
        sample = nbytes / max(seconds - latency, seconds / 2)
        if link.goodput is None:
            link.goodput = sample
        else:
            link.goodput += cfg.goodput_alpha * (sample - link.goodput)

    def record_failure(self, peer: str, now: float) -> None:
        """An exchange with `peer` failed or missed its deadline."""
        link = self._link(peer)
        link.failures += 1

    def forget(self, peer: str) -> None:
        """Drop everything known about `peer` (it left or was declared dead)."""
        self._links.pop(peer, None)

    def estimate(self, peer: str, now: float) -> LinkEstimate:
        """The current estimate for `peer`, defaults filled in where nothing was measured."""
        cfg = self.config
        link = self._links.get(peer)
        if link is None:
            return LinkEstimate(
                cfg.default_rtt_s, cfg.default_rtt_s / 2, cfg.default_goodput_bytes_per_s,
                math.inf, 0, False, False,
            )  # fmt: skip
        known_rtt = link.srtt is not None
        return LinkEstimate(
            rtt_s=link.srtt if known_rtt else cfg.default_rtt_s,
            rttvar_s=link.rttvar if known_rtt else cfg.default_rtt_s / 2,
            goodput_bytes_per_s=link.goodput or cfg.default_goodput_bytes_per_s,
            age_s=now - link.last,
            failures=link.failures,
            rtt_known=known_rtt,
            goodput_known=link.goodput is not None,
        )

    def expected_transfer_time(self, peer: str, nbytes: int, now: float) -> float:
        """Expected seconds to move `nbytes` to `peer` (defaults for what is unknown)."""
        link = self._links.get(peer)
        cfg = self.config
        if link is None:  # the fast path: the simulator calls this for every candidate
            return cfg.default_rtt_s + nbytes / cfg.default_goodput_bytes_per_s
        rtt = link.srtt if link.srtt is not None else cfg.default_rtt_s
        return rtt + nbytes / (link.goodput or cfg.default_goodput_bytes_per_s)

    def exchange_deadline(self, peer: str, nbytes: int, now: float) -> float:
        """Seconds to allow for an exchange of `nbytes` each way (both directions at once).

        factor * expected time + rttvar_mult * RTT deviation, stretched by failure_backoff per
        consecutive failure, clamped to [deadline_floor_s, deadline_cap_s].
        """
        cfg = self.config
        est = self.estimate(peer, now)
        deadline = cfg.deadline_factor * est.transfer_time(nbytes)
        deadline += cfg.deadline_rttvar_mult * est.rttvar_s
        deadline *= cfg.failure_backoff ** min(est.failures, 20)
        return min(cfg.deadline_cap_s, max(cfg.deadline_floor_s, deadline))

    def needs_probe(self, peer: str, now: float) -> bool:
        """True when the link was never measured (RTT or goodput) or its estimate is stale."""
        link = self._links.get(peer)
        if link is None or link.srtt is None or link.goodput is None:
            return True
        return now - link.last > self.config.stale_after_s

    def state_dict(self, now: float) -> dict:
        """Plain JSON-able state for checkpoints; times are stored as ages relative to `now`."""
        peers = {}
        for peer, link in self._links.items():
            peers[peer] = {
                "srtt": link.srtt,
                "rttvar": link.rttvar,
                "goodput": link.goodput,
                "age": None if link.last == -math.inf else now - link.last,
                "failures": link.failures,
            }
        return {"version": STATE_VERSION, "peers": peers}

    def load_state_dict(self, state: dict, now: float) -> None:
        """Replace the table with a state from state_dict(), ages counted back from `now`.

        Raises:
            ValueError: the state is not one state_dict() could have written; nothing changed.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"link state: expected version {STATE_VERSION}, got {state!r:.80}")
        links = {}
        for peer, entry in dict(state.get("peers", {})).items():
            try:
                links[peer] = _link_from_state(entry, now)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"link state for {peer!r}: {exc}") from None
        self._links = links


def _link_from_state(entry: dict, now: float) -> _Link:
    link = _Link()
    for name in ("srtt", "goodput"):
        value = entry[name]
        if value is not None and not (isinstance(value, int | float) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0 or null, got {value!r}")
        setattr(link, name, None if value is None else float(value))
    if link.goodput == 0:
        raise ValueError("goodput must be > 0")
    link.rttvar = float(entry["rttvar"])
    link.failures = int(entry["failures"])
    link.last = -math.inf if entry["age"] is None else now - float(entry["age"])
    if link.rttvar < 0 or link.failures < 0:
        raise ValueError(f"rttvar and failures must be >= 0, got {entry!r}")
    return link
