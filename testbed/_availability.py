# Availability windows ([[availability]]) of one system's run: peers that leave and rejoin on a
# schedule, as clients of a federated-style deployment do. Invariants: the schedule is computed
# from the windows alone, on the system's clock (seconds since its first step, as faults); a
# leave is graceful (SIGTERM: the node checkpoints and tells the swarm it leaves) and never waits
# for the process to end; a join restarts the peer from its checkpoint once its previous process
# has exited (deferred, not dropped, while it is still shutting down); every event, applied or
# skipped, is recorded in the same list as the faults (kind "availability"), so run.json, the
# report and the plots mark it. The windows drive the geotrain swarm only: a DDP job cannot lose
# a rank and go on, and the hivemind baselines run with every peer online (the run says so).
from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._peers import Peers
from ._scenario import TestbedScenario

APPLIES_TO = ("geotrain",)
BASELINE_NOTE = (
    "availability windows drive the geotrain swarm only: DDP and local SGD cannot lose a rank and "
    "go on (gloo's all-reduce needs every rank), and the hivemind baselines, which could, run "
    "with every peer online (windows for them are not built)"
)


@dataclass(frozen=True)
class AvailabilityEvent:
    """One change of a peer's availability: `action` is "leave" or "join"."""

    at_s: float
    peer: int
    action: str

    def describe(self) -> str:
        return f"t={self.at_s:g}s {self.action} peer {self.peer} (availability window)"


def availability_schedule(scenario: TestbedScenario, until_s: float | None = None
                          ) -> list[AvailabilityEvent]:  # fmt: skip
    """Every leave and join of the scenario's windows before `until_s` (default: its duration),
    in time order (peer order for events at the same time)."""
    until = scenario.duration_s if until_s is None else until_s
    events = [AvailabilityEvent(at, w.peer, action)
              for w in scenario.availability for at, action in w.events(until)]  # fmt: skip
    return sorted(events, key=lambda e: (e.at_s, e.peer))


def availability_json(scenario: TestbedScenario) -> dict[str, Any]:
    """What run.json and summary.json say about the windows: each one, and whom they drive."""
    return {
        "windows": [w.to_json() for w in scenario.availability],
        "systems": list(APPLIES_TO) if scenario.availability else [],
        "note": BASELINE_NOTE if scenario.availability else None,
    }


class AvailabilityRunner:
    """Drives a scenario's availability windows on one system's processes.

    Args:
        scenario: holds the windows.
        echo: where to say what happened.
        records: the list faults are recorded in (the FaultRunner's `applied_all`); events are
            appended to it.
        join: starts peer i again (default: its process's `start()`); the geotrain run passes
            one that lets a rejoining node wait for a single peer instead of the whole swarm.
        system: the system's name in the records.
    """

    def __init__(self, scenario: TestbedScenario, echo: Callable[[str], None],
                 records: list[dict[str, Any]], join: Callable[[int], None] | None = None,
                 system: str = "geotrain") -> None:  # fmt: skip
        self._pending = availability_schedule(scenario)
        self._echo = echo
        self._records = records
        self._join = join
        self.system = system
        self._away: set[int] = set()

    def away(self) -> frozenset[int]:
        """Peers that left by their window and have not rejoined yet."""
        return frozenset(self._away)

    def apply_due(self, elapsed_s: float, peers: Peers, wall_t: float | None = None) -> None:
        """Apply every event whose time has come (a join whose peer is still shutting down waits
        for the next call).

        Args:
            elapsed_s: seconds since the system's first step, as the caller saw it.
            peers: the system's processes.
            wall_t: time.time() now, recorded as the event's "t" (the plots' clock).
        """
        kept = []
        for event in self._pending:
            if event.at_s > elapsed_s:
                kept.append(event)
                continue
            note = self._apply(event, peers, kept)
            if note == "deferred":
                kept.append(event)
                continue
            self._record(event, elapsed_s, note, wall_t)
        self._pending = kept

    def _apply(self, event: AvailabilityEvent, peers: Peers,
               kept: list[AvailabilityEvent]) -> str | None:  # fmt: skip
        """Do it; return None, "deferred", or why it was skipped."""
        proc = peers.procs[event.peer]
        if event.action == "leave":
            stale = [e for e in kept if e.peer == event.peer and e.action == "join"]
            if stale:  # its shutdown outlasted a whole online window: that window is skipped
                kept[:] = [e for e in kept if e not in stale]
                for join in stale:
                    self._record(join, event.at_s, "the peer was still shutting down from its "
                                 "previous leave when this window ended", None)  # fmt: skip
                return "the peer had not rejoined (its join was skipped)"
            if not proc.running:
                return "the peer was not running"
            proc.note("testbed_left", window=event.describe(), signal="SIGTERM")
            proc.signal(signal.SIGTERM)  # graceful: checkpoint, leave the swarm, exit
            self._away.add(event.peer)
            return None
        if proc.running:
            return "deferred"  # still checkpointing and leaving after its SIGTERM
        proc.note("testbed_joined", window=event.describe())
        if self._join is not None:
            self._join(event.peer)
        else:
            proc.start()
        self._away.discard(event.peer)
        return None

    def _record(self, event: AvailabilityEvent, elapsed_s: float, note: str | None,
                wall_t: float | None) -> None:  # fmt: skip
        self._records.append({
            "system": self.system, "kind": "availability", "at_s": event.at_s,
            "applied_at_s": round(elapsed_s, 2), "fault": event.describe(),
            "peer": event.peer, "action": event.action, "applied": note is None, "note": note,
            **({} if wall_t is None else {"t": wall_t}),
        })  # fmt: skip
        self._echo(f"{self.system}: {event.describe()}"
                   + ("" if note is None else f" SKIPPED ({note})"))  # fmt: skip
