# summary.json and the comparison table, computed from a run's files only (run.json, the peers'
# metrics lines, the bytes samples), so `geotrain testbed report DIR` gives the same answer later.
# Invariants: nothing here measures or invents a number: a figure the files do not hold is null;
# a system's t = 0 is the earliest first step of any of its peers (estimated from each peer's first
# metrics line as t - step / steps_per_s); time to target is when every peer's latest evaluated
# metric has reached the target.
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from geotrain.node.state import StateDir


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON objects of a file, one a line (a torn last line, from a killed writer,
    is skipped, and so is any line that is not an object)."""
    out = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def metrics_paths(out: Path, system: str, n: int) -> list[Path]:
    """Where each peer of a system wrote its metrics lines."""
    if system == "geotrain":
        return [StateDir(out / "geotrain" / f"peer-{i:02d}").metrics for i in range(n)]
    return [out / system / f"peer-{i:02d}.jsonl" for i in range(n)]


def peer_metrics(out: Path, system: str, n: int) -> list[list[dict[str, Any]]]:
    """Per peer, its metrics lines in order."""
    return [load_jsonl(p) for p in metrics_paths(out, system, n)]


def train_start(peers: list[list[dict[str, Any]]]) -> float | None:
    """Wall time of the first step of any peer (estimated from its first line with a step)."""
    starts = []
    for records in peers:
        first = next((r for r in records if r.get("step", 0) > 0), None)
        if first is not None:
            rate = first.get("steps_per_s") or 0.0
            starts.append(first["t"] - (first["step"] / rate if rate > 0 else 0.0))
    return min(starts) if starts else None


def time_to_target(peers, target: float, higher_is_better: bool, t0: float) -> float | None:
    """Seconds from t0 until every peer's latest metric has reached the target, or None."""
    events = sorted(
        (r["t"], i, r["metric"]) for i, rs in enumerate(peers) for r in rs
        if r.get("metric") is not None
    )  # fmt: skip
    latest: dict[int, float] = {}
    for t, i, metric in events:
        latest[i] = metric
        if len(latest) == len(peers) and all(
            (m >= target if higher_is_better else m <= target) for m in latest.values()
        ):
            return round(t - t0, 2)
    return None


def steps_per_s(records: list[dict[str, Any]]) -> float | None:
    """A peer's mean step rate from its first to its last step line (downtime included)."""
    stepped = [r for r in records if r.get("step", 0) > 0]
    if len(stepped) < 2 or stepped[-1]["t"] <= stepped[0]["t"]:
        return None
    return (stepped[-1]["step"] - stepped[0]["step"]) / (stepped[-1]["t"] - stepped[0]["t"])


def bytes_out_series(records: list[dict[str, Any]]) -> list[int]:
    """Bytes a node had sent by each of its lines, over restarts (a new process counts from 0)."""
    totals, total, previous = [], 0, 0
    for r in records:
        value = int(r.get("bytes_out") or 0)
        total += value if value < previous else value - previous
        previous = value
        totals.append(total)
    return totals


def node_bytes_out(records: list[dict[str, Any]]) -> int:
    """Bytes a node sent, over restarts (its counter starts at 0 again in a new process)."""
    return (bytes_out_series(records) or [0])[-1]


def bytes_samples(out: Path, system: str) -> list[dict[str, Any]]:
    return load_jsonl(out / f"bytes-{system}.jsonl")


def _system(out: Path, run: dict[str, Any], system: str) -> dict[str, Any]:
    n = run["peers"]
    peers = peer_metrics(out, system, n)
    t0 = train_start(peers)
    samples = bytes_samples(out, system)
    if samples:
        sent, source = samples[-1]["bytes"], run["bytes_source"]
    elif system == "geotrain":
        sent, source = sum(node_bytes_out(r) for r in peers), "the nodes' bytes_out counters"
    else:
        sent, source = None, "not measured (no emulation: no shared counter)"
    finals = [next((r["metric"] for r in reversed(rs) if r.get("metric") is not None), None)
              for rs in peers]  # fmt: skip
    known = [m for m in finals if m is not None]
    rates = [steps_per_s(rs) for rs in peers]
    rates_known = [r for r in rates if r is not None]
    return {
        "system": system,
        "algorithm": run["algorithm"] if system == "geotrain" else "allreduce (gloo DDP)",
        "time_to_target_s": None if t0 is None else time_to_target(
            peers, run["target_value"], run.get("higher_is_better", True), t0),
        "final_metric": round(statistics.fmean(known), 4) if known else None,
        "final_metric_by_peer": finals,
        "bytes_sent_total": sent,
        "bytes_source": source,
        "steps_per_s_median": round(statistics.median(rates_known), 3) if rates_known else None,
        "steps_per_s_by_peer": [None if r is None else round(r, 3) for r in rates],
        "startup_s": None if t0 is None else round(t0 - run["systems"][system]["launch_t"], 2),
        "trained_s": None if t0 is None else round(
            max((rs[-1]["t"] for rs in peers if rs), default=t0) - t0, 2),
        "stopped": run["systems"][system]["stopped"],
    }  # fmt: skip


def build_summary(out: Path) -> dict[str, Any]:
    """summary.json of the run in `out` (issue 8's shape, plus a few fields it explains)."""
    run = json.loads((out / "run.json").read_text())
    return {
        "scenario": run["scenario"],
        "emulation": run["emulation"],
        "emulation_reason": run["emulation_reason"],
        "peers": run["peers"],
        "task": run["task"],
        "target": {"metric": run["metric"], "value": run["target_value"]},
        "systems": [_system(out, run, s) for s in run["systems"]],
        "links": run["links"],
        "faults": run["faults"],
        "rate_scale": run["rate_scale"],
        "consensus_distance_final": run["consensus_distance_final"],
        "time_origin": "each system's first step; time_to_target_s counts from there",
    }


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def comparison_title(summary: dict[str, Any]) -> str:
    """The comparison table's one-line heading: scenario, peers, task, emulation, target."""
    target = summary["target"]
    return (f"scenario {summary['scenario']}, {summary['peers']} peers, {summary['task']}, "
            f"emulation {summary['emulation']}, target {target['metric']} "
            f"{target['value']:g}")  # fmt: skip


def comparison_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    """The comparison table as text cells: the column names, then one row per system.

    The text table and the HTML report both show these cells, so they cannot disagree.
    """
    metric = summary["target"]["metric"]
    rows = [("system", "algorithm", "time to target", f"final {metric}",
             "bytes sent", "median steps/s")]  # fmt: skip
    for s in summary["systems"]:
        ttt = s["time_to_target_s"]
        rows.append((
            s["system"], s["algorithm"],
            f"{ttt:.1f} s" if ttt is not None else f"not reached ({s['trained_s']} s)",
            "-" if s["final_metric"] is None else f"{s['final_metric']:.4f}",
            _fmt_bytes(s["bytes_sent_total"]),
            "-" if s["steps_per_s_median"] is None else f"{s['steps_per_s_median']:.2f}",
        ))  # fmt: skip
    return rows


def comparison_notes(summary: dict[str, Any]) -> list[str]:
    """The lines under the table: ratios geotrain vs the baseline when both are known, bytes."""
    return [*_ratios(summary["systems"]), f"bytes: {summary['systems'][0]['bytes_source']}"]


def render_table(summary: dict[str, Any]) -> str:
    """The comparison table, with the ratios geotrain vs the baseline when both are known."""
    rows = comparison_rows(summary)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [comparison_title(summary)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines + comparison_notes(summary))


def _ratios(systems: list[dict[str, Any]]) -> list[str]:
    by = {s["system"]: s for s in systems}
    if "geotrain" not in by or "ddp" not in by:
        return []
    g, d = by["geotrain"], by["ddp"]
    out = []
    if g["time_to_target_s"] and d["time_to_target_s"]:
        ratio = d["time_to_target_s"] / g["time_to_target_s"]
        out.append(f"time to target: DDP/geotrain = {ratio:.2f} (above 1: geotrain sooner)")
    elif g["time_to_target_s"] and not d["time_to_target_s"]:
        out.append("time to target: geotrain reached it, DDP did not")
    if g["bytes_sent_total"] and d["bytes_sent_total"]:
        out.append(f"bytes sent: geotrain/DDP = {g['bytes_sent_total'] / d['bytes_sent_total']:.3g}"
                   " (whole runs, not to the target)")  # fmt: skip
    return out
