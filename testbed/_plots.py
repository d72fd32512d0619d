# Plots of a run, drawn from its files only (matplotlib, Agg backend: no display needed): the PNG
# files `testbed run` and `testbed report` write, and the figures the HTML report embeds.
# Invariants: a plot shows only what the files hold; where the files hold no time series (the
# consensus distance: the nodes' final checkpoints give its end point only) the plot says so;
# every time axis counts seconds from its system's first step (the summary's t0) and marks the
# faults of the systems it shows (solid line: applied, dotted: skipped, each labelled; the leaves
# and joins of availability windows dashed, one label per moment); text from
# the run is drawn literally (a `$` never starts mathtext).
from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._summary import bytes_out_series, bytes_samples, peer_metrics, train_start

COLORS = {"geotrain": "tab:blue", "ddp": "tab:red", "hivemind": "tab:green",
          "hivemind-local": "tab:olive"}
X_LABEL = "seconds since the system's first step"
LABEL_BOX = {"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1}  # fault labels


@dataclass(frozen=True)
class SystemRun:
    """One system's series from the run's files, with its own time origin.

    Attributes:
        name: "geotrain" or a baseline (ddp, hivemind, hivemind-local).
        peers: each peer's metrics lines, in order.
        t0: wall time of the system's first step (the summary's; launch time if none stepped).
        samples: the emulator's bytes samples ({"t", "bytes"}), empty without emulation.
        faults: run.json's fault records of this system, each with its number (1 + its index
            in run.json's list: the label of its marker and its row in the report's table).
    """

    name: str
    peers: list[list[dict[str, Any]]]
    t0: float
    samples: list[dict[str, Any]]
    faults: list[tuple[int, dict[str, Any]]]


@dataclass(frozen=True)
class Plot:
    """One rendered figure: `name` is its file stem, `caption` says what it shows."""

    name: str
    caption: str
    png: bytes


Draw = Callable[[Any], Any]  # pyplot -> a matplotlib Figure


def load_systems(out: Path, run: dict[str, Any]) -> list[SystemRun]:
    """Every system of the run, read from `out`."""
    systems = []
    for name, info in run["systems"].items():
        peers = peer_metrics(out, name, run["peers"])
        t0 = train_start(peers)
        faults = [(k, f) for k, f in enumerate(run["faults"], 1)
                  if isinstance(f, dict) and f.get("system") == name]  # fmt: skip
        systems.append(SystemRun(name, peers, info["launch_t"] if t0 is None else t0,
                                 bytes_samples(out, name), faults))  # fmt: skip
    return systems


def fault_x(fault: dict[str, Any], t0: float) -> float:
    """Where a fault goes on its system's time axis (older runs recorded no wall time)."""
    t = fault.get("t")
    if isinstance(t, int | float):
        return t - t0
    handled = fault.get("applied_at_s")  # (None: never reached, the run ended first)
    return float(handled if handled is not None else fault.get("at_s", 0.0))


def render_plots(out: Path) -> list[Path]:
    """Write metric.png, bytes.png and consensus.png into `out`; return their paths."""
    run = json.loads((out / "run.json").read_text())
    systems = load_systems(out, run)
    paths = []
    for name, draw in _comparison_figures(run, systems):
        path = out / f"{name}.png"
        path.write_bytes(_png(draw))
        paths.append(path)
    return paths


def report_plots(run: dict[str, Any], systems: list[SystemRun], peer_labels: list[str]
                 ) -> list[Plot]:  # fmt: skip
    """The figures of the HTML report, rendered: see `report_figures`."""
    return [Plot(name, caption, _png(draw)) for name, caption, draw in
            report_figures(run, systems, peer_labels)]  # fmt: skip


def report_figures(run: dict[str, Any], systems: list[SystemRun], peer_labels: list[str]
                   ) -> list[tuple[str, str, Draw]]:  # fmt: skip
    """(name, caption, draw) of each figure of the HTML report: the comparison plots (those of
    `render_plots`), then one per system showing each peer's metric and bytes."""
    captions = {
        "metric": f"{run['metric']} of every peer of every system, against the target",
        "bytes": "bytes on the wire, all peers together, over each system's run",
        "consensus": "geotrain's consensus distance (its end point: no time series is recorded)",
    }  # fmt: skip
    figures = [(name, captions[name], draw) for name, draw in _comparison_figures(run, systems)]
    for s in systems:
        figures.append((f"peers-{s.name}", f"{s.name}: {run['metric']} and bytes sent, per peer",
                        lambda plt, s=s: _system_figure(plt, run, s, peer_labels)))  # fmt: skip
    return figures


def _comparison_figures(run: dict[str, Any], systems: list[SystemRun]) -> list[tuple[str, Draw]]:
    return [
        ("metric", lambda plt: _metric_figure(plt, run, systems)),
        ("bytes", lambda plt: _bytes_figure(plt, run, systems)),
        ("consensus", lambda plt: _consensus_figure(plt, run, systems)),
    ]


def _png(draw: Draw) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    try:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _literal(text: object) -> str:
    """Text from the run, drawn as written (matplotlib reads `$...$` as mathtext)."""
    return str(text).replace("$", r"\$")


def fault_label(number: int, fault: dict[str, Any], limit: int = 28) -> str:
    """`#3 kill peer 1`: the fault's number and what it did, without its planned time (the
    marker's place shows when), cut to `limit` characters; `(skipped)` when it was skipped."""
    what = str(fault.get("fault", "fault"))
    if what.startswith("t=") and " " in what:
        what = what.split(" ", 1)[1]
    if len(what) > limit:
        what = what[: limit - 3] + "..."
    return f"#{number} {what}" + ("" if fault.get("applied", True) else " (skipped)")


def availability_groups(faults: list[tuple[int, dict[str, Any]]], t0: float
                        ) -> list[tuple[float, str]]:  # fmt: skip
    """Availability events (kind "availability") handled at the same moment (within half a
    second), as one marker each: (x, `#4-#7 leave 1,3 join 2,4`). Windows move several peers at
    once; one label per peer would be drawn over each other."""
    groups: list[list[tuple[int, dict[str, Any]]]] = []
    for number, fault in faults:
        if fault.get("kind") != "availability" or not fault.get("applied", True):
            continue
        if groups and abs(fault_x(fault, t0) - fault_x(groups[-1][0][1], t0)) <= 0.5:
            groups[-1].append((number, fault))
        else:
            groups.append([(number, fault)])
    out = []
    for group in groups:
        numbers = [n for n, _ in group]
        span = f"#{numbers[0]}" + (f"-#{numbers[-1]}" if len(numbers) > 1 else "")
        parts = [action + " " + ",".join(str(f.get("peer")) for _, f in group
                                         if f.get("action") == action)
                 for action in ("leave", "join") if any(f.get("action") == action
                                                        for _, f in group)]  # fmt: skip
        out.append((fault_x(group[0][1], t0), f"{span} {' '.join(parts)}"))
    return out


def _mark_faults(ax, systems: list[SystemRun], name_system: bool) -> None:
    for s in systems:
        color = COLORS.get(s.name, "black")
        for x, label in availability_groups(s.faults, s.t0):
            ax.axvline(x, color=color, linestyle="--", linewidth=0.8)
            ax.text(x, 0.02, _literal(f"{s.name} {label}" if name_system else label),
                    transform=ax.get_xaxis_transform(), rotation=90, va="bottom", ha="right",
                    fontsize=7, color=color, bbox=LABEL_BOX)  # fmt: skip
        for number, fault in s.faults:
            if fault.get("kind") == "availability" and fault.get("applied", True):
                continue  # drawn above, grouped
            if "applied_at_s" in fault and fault["applied_at_s"] is None:
                continue  # never reached: the run had ended (the report's table says so)
            x = fault_x(fault, s.t0)
            style = "-" if fault.get("applied", True) else ":"
            ax.axvline(x, color=color, linestyle=style, linewidth=1.2)
            label = fault_label(number, fault)
            ax.text(x, 0.98, _literal(f"{s.name} {label}" if name_system else label),
                    transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="right",
                    fontsize=7, color=color, bbox=LABEL_BOX)  # fmt: skip


def _metric_points(s: SystemRun, records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(r["t"] - s.t0, r["metric"]) for r in records if r.get("metric") is not None]


def _metric_figure(plt, run: dict[str, Any], systems: list[SystemRun]):
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in systems:
        for i, records in enumerate(s.peers):
            pts = _metric_points(s, records)
            if pts:
                ax.plot(*zip(*pts, strict=True), color=COLORS.get(s.name), alpha=0.7,
                        linestyle="-" if s.name == "geotrain" else "--",
                        label=_literal(s.name) if i == 0 else None)  # fmt: skip
    ax.axhline(run["target_value"], color="gray", linestyle=":", label="target")
    _mark_faults(ax, systems, name_system=True)
    title = f"{run['metric']} per peer ({run['scenario']}, {run['emulation']})"
    ax.set(xlabel=X_LABEL, ylabel=_literal(run["metric"]), title=_literal(title))
    ax.legend(loc="lower right")
    return fig


def _node_bytes_points(s: SystemRun) -> list[tuple[float, float]]:
    """MB sent by all peers together, from the nodes' own counters, at each metrics line."""
    events = sorted(
        (r["t"], i, total) for i, rs in enumerate(s.peers)
        for r, total in zip(rs, bytes_out_series(rs), strict=True)
    )  # fmt: skip
    latest: dict[int, int] = {}
    points = []
    for t, i, total in events:
        latest[i] = total
        points.append((t - s.t0, sum(latest.values()) / 1e6))
    return points


def _bytes_figure(plt, run: dict[str, Any], systems: list[SystemRun]):
    fig, ax = plt.subplots(figsize=(8, 5))
    for s in systems:
        if s.samples:
            pts = [(x["t"] - s.t0, x["bytes"] / 1e6) for x in s.samples]
            label = f"{s.name} ({run['emulation']} counters)"
        elif s.name == "geotrain":
            pts, label = _node_bytes_points(s), f"{s.name} (node counters)"
        else:
            continue
        if pts:
            ax.plot(*zip(*pts, strict=True), color=COLORS.get(s.name), label=_literal(label))
    _mark_faults(ax, systems, name_system=True)
    ax.set(xlabel=X_LABEL, ylabel="MB sent (all peers)", title="bytes on the wire")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    return fig


def _consensus_figure(plt, run: dict[str, Any], systems: list[SystemRun]):
    fig, ax = plt.subplots(figsize=(8, 5))
    final = run.get("consensus_distance_final")
    geotrain = [s for s in systems if s.name == "geotrain"]
    t_end = max((rs[-1]["t"] - s.t0 for s in geotrain for rs in s.peers if rs), default=0.0)
    if final is not None:
        ax.plot([t_end], [final], "o", color=COLORS["geotrain"],
                label="geotrain, final checkpoints")  # fmt: skip
        ax.set_yscale("log")
    _mark_faults(ax, geotrain, name_system=True)
    ax.set(xlabel=X_LABEL, ylabel="mean ||x_i - mean||^2 / ||mean||^2",
           title="consensus distance: end point only (no time series is recorded)")  # fmt: skip
    ax.text(0.02, 0.95, "DDP: 0 by construction (all ranks hold the same model)",
            transform=ax.transAxes, va="top")  # fmt: skip
    if final is not None:
        ax.legend(loc="lower right")
    return fig


def _system_figure(plt, run: dict[str, Any], s: SystemRun, peer_labels: list[str]):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for i, records in enumerate(s.peers):
        pts = _metric_points(s, records)
        if pts:
            top.plot(*zip(*pts, strict=True), color=f"C{i % 10}", marker=".",
                     label=_literal(peer_labels[i]))  # fmt: skip
        totals = bytes_out_series(records)
        sent = [(r["t"] - s.t0, total / 1e6) for r, total in zip(records, totals, strict=True)
                if "bytes_out" in r]  # fmt: skip
        if sent:
            bottom.plot(*zip(*sent, strict=True), color=f"C{i % 10}",
                        label=_literal(f"{peer_labels[i]}, its own counter"))  # fmt: skip
    if s.samples:
        label = _literal(f"all peers ({run['emulation']} counters)")
        bottom.plot([x["t"] - s.t0 for x in s.samples], [x["bytes"] / 1e6 for x in s.samples],
                    color="black", label=label)  # fmt: skip
    if not bottom.get_legend_handles_labels()[0]:
        bottom.text(0.5, 0.5, "no byte counts recorded for this system", ha="center",
                    transform=bottom.transAxes)  # fmt: skip
    top.axhline(run["target_value"], color="gray", linestyle=":", label="target")
    for ax in (top, bottom):
        _mark_faults(ax, [s], name_system=False)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    top.set(ylabel=_literal(run["metric"]), title=_literal(f"{s.name}: every peer"))
    bottom.set(xlabel=X_LABEL, ylabel="MB sent")
    return fig
