# The fault timeline of a running system. Invariants: each fault is applied at most once, in time
# order, when the system's clock (seconds since its first step) passes its `at_s`; kill/restart act
# on geotrain nodes only (a DDP job cannot lose a rank and go on: that is the baseline's nature, and
# the run says so); link faults change the emulator's matrix, and every run of a system starts and
# ends on the scenario's own matrix; every fault, applied or skipped, is recorded with the reason
# (and with the wall-clock time it was handled at, when the caller gives it).
from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any, Protocol

from ._linkspec import LinkMatrix
from ._peers import Peers
from ._scenario import Fault, TestbedScenario


class Links(Protocol):
    matrix: LinkMatrix

    def set_matrix(self, matrix: LinkMatrix) -> None: ...


class FaultRunner:
    """Applies a scenario's faults to one system's run.

    Args:
        scenario: holds the timeline and the base link matrix.
        links: the emulator (None without emulation: link faults are then skipped and recorded).
        echo: where to say what happened.
        system: "geotrain" or a baseline (ddp and localsgd cannot lose a rank; hivemind's workers
            rejoin when restarted).
        applied: records of an earlier system's run, kept in `applied_all`.
    """

    def __init__(self, scenario: TestbedScenario, links: Links | None,
                 echo: Callable[[str], None], system: str = "geotrain",
                 applied: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
        self._pending = list(scenario.faults)
        self._base = scenario.matrix()
        self._links = links
        self._echo = echo
        self.system = system
        self.applied_all: list[dict[str, Any]] = list(applied or [])
        if links is not None and links.matrix != self._base:
            links.set_matrix(self._base)

    def restart_pending(self, peer: int) -> bool:
        """Whether a restart of `peer` is still to come."""
        return any(f.action == "restart" and f.peer == peer for f in self._pending)

    def apply_due(self, elapsed_s: float, peers: Peers, wall_t: float | None = None) -> None:
        """Apply every pending fault whose time has come.

        Args:
            elapsed_s: seconds since the system's first step, as the caller saw it.
            peers: the system's processes.
            wall_t: time.time() now; recorded as the fault's "t", so a report can place it on
                the same clock as the peers' metrics lines.
        """
        while self._pending and self._pending[0].at_s <= elapsed_s:
            fault = self._pending.pop(0)
            note = self._apply(fault, peers)
            self.applied_all.append({
                "system": self.system, "at_s": fault.at_s, "applied_at_s": round(elapsed_s, 2),
                "fault": fault.describe(), "applied": note is None, "note": note,
                "action": fault.action, "peer": fault.peer,
                **({} if wall_t is None else {"t": wall_t}),
            })  # fmt: skip
            self._echo(
                f"{self.system}: fault {fault.describe()}"
                + ("" if note is None else f" SKIPPED ({note})")
            )

    def not_reached(self, ended_s: float, why: str) -> None:
        """The system's run ended (`why`: target, duration, ...) before these faults were due:
        recorded and said (they were printed at the start and then silently never happened)."""
        for fault in self._pending:
            note = f"not reached: the run ended ({why}) at {ended_s:.1f} s"
            self.applied_all.append({
                "system": self.system, "at_s": fault.at_s, "applied_at_s": None,
                "fault": fault.describe(), "applied": False, "note": note,
                "action": fault.action, "peer": fault.peer,
            })  # fmt: skip
            self._echo(f"{self.system}: fault {fault.describe()} {note}")
        self._pending = []

    def _apply(self, fault: Fault, peers: Peers) -> str | None:
        """Do it; return None, or why it was skipped."""
        if fault.action in ("kill", "restart"):
            if self.system in ("ddp", "localsgd", "ideal"):
                return "a DDP job cannot lose or regain a rank"
            proc = peers.procs[fault.peer]  # type: ignore[index]
            if fault.action == "kill":
                if not proc.running:
                    return "the peer was not running"
                proc.signal(signal.SIGKILL)
                proc.proc.wait()  # type: ignore[union-attr]
                proc.note("testbed_killed", fault=fault.describe(), signal="SIGKILL")
            else:
                if proc.running:
                    return "the peer was still running"
                proc.note("testbed_restarted", fault=fault.describe())
                proc.start()  # resumes from its latest checkpoint
            return None
        if self._links is None:
            return "no link emulation"
        current = self._links.matrix
        a, b = fault.regions or ("", "")
        if fault.action == "partition":
            self._links.set_matrix(current.partitioned(a, b))
        elif fault.action == "degrade":
            self._links.set_matrix(current.with_link(a, b, fault.link))  # type: ignore[arg-type]
        else:  # heal
            self._links.set_matrix(self._base)
        return None

    def reset(self) -> None:
        """Put the scenario's own links back (after a system's run)."""
        if self._links is not None and self._links.matrix != self._base:
            self._links.set_matrix(self._base)
