# PNG plots of a run, drawn from its files only (matplotlib, Agg backend: no display needed).
# Invariants: a plot shows only what the files hold; where the files hold no time series (the
# consensus distance: the nodes' final checkpoints give its end point only) the plot says so.
from __future__ import annotations

import json
from pathlib import Path


def render_plots(out: Path) -> list[Path]:
    """Write metric.png, bytes.png and consensus.png into `out`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._summary import bytes_samples, node_bytes_out, peer_metrics, train_start

    run = json.loads((out / "run.json").read_text())
    systems, n = list(run["systems"]), run["peers"]
    paths = []
    colors = {"geotrain": "tab:blue", "ddp": "tab:red"}

    fig, ax = plt.subplots(figsize=(8, 5))
    for system in systems:
        peers = peer_metrics(out, system, n)
        t0 = train_start(peers) or 0.0
        for i, records in enumerate(peers):
            pts = [(r["t"] - t0, r["metric"]) for r in records if r.get("metric") is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=colors.get(system), alpha=0.7,
                        linestyle="-" if system == "geotrain" else "--",
                        label=system if i == 0 else None)  # fmt: skip
    ax.axhline(run["target_value"], color="gray", linestyle=":", label="target")
    ax.set(xlabel="seconds since the system's first step", ylabel=run["metric"],
           title=f"{run['metric']} per peer ({run['scenario']}, {run['emulation']})")  # fmt: skip
    ax.legend()
    paths.append(_save(fig, out / "metric.png", plt))

    fig, ax = plt.subplots(figsize=(8, 5))
    for system in systems:
        peers = peer_metrics(out, system, n)
        t0 = train_start(peers) or 0.0
        samples = bytes_samples(out, system)
        if samples:
            pts = [(s["t"] - t0, s["bytes"] / 1e6) for s in samples]
            label = f"{system} ({run['emulation']} counters)"
        elif system == "geotrain":
            merged = sorted((r["t"], i) for i, rs in enumerate(peers) for r in rs)
            pts = [(t - t0, sum(node_bytes_out([r for r in peers[j] if r["t"] <= t])
                                for j in range(n)) / 1e6) for t, _ in merged]  # fmt: skip
            label = f"{system} (node counters)"
        else:
            continue
        ax.plot(*zip(*pts, strict=True), color=colors.get(system), label=label)
    ax.set(xlabel="seconds since the system's first step", ylabel="MB sent (all peers)",
           title="bytes on the wire")  # fmt: skip
    ax.legend()
    paths.append(_save(fig, out / "bytes.png", plt))

    fig, ax = plt.subplots(figsize=(8, 5))
    final = run.get("consensus_distance_final")
    peers = peer_metrics(out, "geotrain", n)
    t0 = train_start(peers) or 0.0
    t_end = max((rs[-1]["t"] - t0 for rs in peers if rs), default=0.0)
    if final is not None:
        ax.plot([t_end], [final], "o", color=colors["geotrain"],
                label="geotrain, final checkpoints")
        ax.set_yscale("log")
    ax.set(xlabel="seconds since the system's first step",
           ylabel="mean ||x_i - mean||^2 / ||mean||^2",
           title="consensus distance: end point only (no time series is recorded)")  # fmt: skip
    ax.text(0.02, 0.95, "DDP: 0 by construction (all ranks hold the same model)",
            transform=ax.transAxes, va="top")  # fmt: skip
    if final is not None:
        ax.legend(loc="lower right")
    paths.append(_save(fig, out / "consensus.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
