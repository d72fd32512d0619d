# What a finished testbed run directory must hold before `geotrain testbed report` reads it.
# Invariants: nothing here writes; a directory the report cannot be made from (no run.json, a
# run.json that is not JSON or lacks a field the summary needs, a peer without its metrics file)
# raises RunDirError listing every problem, one line each, so the CLI says them all and exits
# non-zero before anything is rendered; a missing optional part (scenario.json, summary.json, a
# bytes file, the recorded command line, fault wall times) is only listed in RunDir.missing, for
# the report to say which parts it lacks.
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geotrain.node.state import write_atomically

from ._summary import CUT_SHORT, metrics_paths


def write_json(path: Path, doc: Any) -> None:
    """A run folder's JSON file (scenario, run, summary), indented, replaced whole: a second
    Ctrl-C while it is written leaves the old file, never half of the new one."""
    write_atomically(path, (json.dumps(doc, indent=2) + "\n").encode())

# run.json fields that build_summary and the plots read; a run.json without one of them was
# written by an older geotrain (or by hand) and gives no report.
REQUIRED_FIELDS = (
    "scenario", "emulation", "emulation_reason", "peers", "task", "algorithm", "target_value",
    "metric", "rate_scale", "systems", "faults", "links", "consensus_distance_final",
)  # fmt: skip
SYSTEM_FIELDS = ("launch_t", "stopped")


class RunDirError(Exception):
    """The directory gives no report; `problems` says why, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class RunDir:
    """A run directory that a report can be made from.

    Attributes:
        path: the directory.
        run: run.json's content.
        scenario: scenario.json's content, or None when it is missing or unreadable.
        missing: optional parts that are absent, each a phrase saying what the report lacks.
    """

    path: Path
    run: dict[str, Any]
    scenario: dict[str, Any] | None
    missing: tuple[str, ...]

    def peer_labels(self) -> list[str]:
        """Each peer's label, `peer 3 (oregon)`; `peer 3` without scenario.json's regions."""
        regions: list[str] = []
        for region in (self.scenario or {}).get("regions", []):
            if isinstance(region, dict) and isinstance(region.get("peers"), int):
                regions += [str(region.get("name", "?"))] * region["peers"]
        n = self.run["peers"]
        if len(regions) != n:
            return [f"peer {i}" for i in range(n)]
        return [f"peer {i} ({r})" for i, r in enumerate(regions)]


def open_run_dir(path: Path) -> RunDir:
    """Check `path` and read its run.json and scenario.json.

    Raises:
        RunDirError: the directory is not a finished run's (every problem is listed).
    """
    if not path.is_dir():
        raise RunDirError([f"{path}: no such directory"])
    run = _read_run(path)
    problems = _field_problems(run) or _metrics_problems(path, run)
    if problems:
        raise RunDirError([f"{path}/{p}" for p in problems])
    scenario = _read_object(path / "scenario.json")
    return RunDir(path, run, scenario, tuple(_missing_parts(path, run, scenario)))


def _read_run(path: Path) -> dict[str, Any]:
    file = path / "run.json"
    if not file.exists():
        raise RunDirError([
            f"{file} not found: not a testbed run's folder, or one whose run crashed before "
            "writing it (a finished run writes it when it ends, an interrupted one when it "
            "stops, marked interrupted)"
        ])  # fmt: skip
    run = _read_object(file)
    if run is None:
        raise RunDirError([f"{file}: not a JSON object (torn or edited by hand?)"])
    return run


def _read_object(file: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _field_problems(run: dict[str, Any]) -> list[str]:
    absent = [f for f in REQUIRED_FIELDS if f not in run]
    if absent and run.get("interrupted"):  # (a run stopped early writes what it had)
        done = ", ".join(run.get("systems") or {}) or "none"
        return [f"run.json: the run was interrupted ({run['interrupted']}) before it could be "
                f"reported (systems finished: {done}); what its peers wrote until then is in "
                "each system's peer logs and metrics lines in this directory"]
    if absent:
        return [f"run.json lacks {', '.join(absent)} (written by an older geotrain?)"]
    peers, systems = run["peers"], run["systems"]
    checks = (
        ("peers", isinstance(peers, int) and not isinstance(peers, bool) and peers >= 1,
         "an integer >= 1"),
        ("systems", isinstance(systems, dict) and bool(systems), "one entry per system run"),
        ("faults", isinstance(run["faults"], list), "a list"),
        ("links", isinstance(run["links"], list), "a list"),
    )  # fmt: skip
    bad = [f"run.json: {name} = {run[name]!r}: expected {what}" for name, ok, what in checks
           if not ok]  # fmt: skip
    if bad:
        return bad
    return [
        f"run.json: systems.{name} = {info!r}: expected an object with {', '.join(SYSTEM_FIELDS)}"
        for name, info in systems.items()
        if not isinstance(info, dict) or any(f not in info for f in SYSTEM_FIELDS)
    ]


def _metrics_problems(path: Path, run: dict[str, Any]) -> list[str]:
    problems = []
    for system, info in run["systems"].items():
        if isinstance(info, dict) and info.get("stopped") in CUT_SHORT:
            continue  # (cut short, maybe before its peers wrote anything: what is there counts)
        files = metrics_paths(path, system, run["peers"])
        killed = _killed_peers(run, system)
        absent = [(i, f) for i, f in enumerate(files) if not f.is_file() and i not in killed]
        if absent:
            peers = ", ".join(str(i) for i, _ in absent)
            names = ", ".join(str(f.relative_to(path)) for _, f in absent)
            problems.append(f"{system}: no metrics file for peer(s) {peers} ({names})")
    return problems


def _killed_peers(run: dict[str, Any], system: str) -> set[int]:
    """The peers of `system` a kill fault took down: one killed before its first metrics line,
    and not back in time to write one, has no metrics file, and the run is still whole."""
    return {f["peer"] for f in run["faults"] if isinstance(f, dict) and f.get("system") == system
            and f.get("action") == "kill" and f.get("applied") and isinstance(f.get("peer"), int)}


def _missing_parts(path: Path, run: dict[str, Any], scenario: dict | None) -> list[str]:
    missing = []
    for system in run["systems"]:
        files = metrics_paths(path, system, run["peers"])
        missing += [f"{system} peer {i}'s metrics (killed before it wrote any, and not back in "
                    "time to write some)" for i in sorted(_killed_peers(run, system))
                    if i < len(files) and not files[i].is_file()]  # fmt: skip
    if scenario is None:
        missing.append("scenario.json (regions, link specs, stragglers and the fault plan)")
    if not (path / "summary.json").exists():
        missing.append("summary.json (rebuilt from the run's files for this report)")
    for system in run["systems"]:
        if not (path / f"bytes-{system}.jsonl").exists():
            missing.append(f"bytes-{system}.jsonl ({system}'s bytes from the emulator)")
    if not run.get("command"):
        missing.append("the command line (run.json from before it was recorded, or a run "
                       "started from Python)")  # fmt: skip
    if any(isinstance(f, dict) and "t" not in f and f.get("applied_at_s") is not None
           for f in run["faults"]):  # (a fault never reached has no time, in any run)
        missing.append("the faults' wall-clock times (older run): fault markers sit at "
                       "applied_at_s, counted from when the testbed saw a first step")  # fmt: skip
    return missing
