# The systems a testbed run compares geotrain with, and their settings. Invariants: a baseline
# name, a `--baseline-set` key or value that is not known is refused with a ValueError naming it,
# before anything starts; the settings a run used are the presets below with the user's changes
# applied, written whole into run.json and summary.json; nothing here imports torch or hivemind.
from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from typing import Any

BASELINES = ("ddp", "localsgd", "hivemind", "hivemind-local", "ideal")
# the ideal, DDP on links that cost nothing, exists only in virtual time (--clock virtual)
VIRTUAL_ONLY = ("ideal",)

# hivemind's two ways of training, with the values its quick start and Optimizer docs use
# (https://learning-at-home.readthedocs.io/en/latest/user/quickstart.html: matchmaking_time=3.0,
# averaging_timeout=10.0; target_batch_size=10000 with use_local_updates=True). The synchronous
# preset averages gradients once the swarm has accumulated one batch per peer (None: the testbed
# puts peers x batch there), which is what DDP does every step.
_HIVEMIND_COMMON: dict[str, Any] = {
    "matchmaking_time": 3.0,
    "averaging_timeout": 10.0,
    "average_state_every": 1,
    "grad_compression": "none",
    "state_averaging_compression": "none",
    "lr": None,  # None: the task's learning rate, as the other systems use
}
HIVEMIND_PRESETS: dict[str, dict[str, Any]] = {
    "hivemind": {"use_local_updates": False, "target_batch_size": None, **_HIVEMIND_COMMON},
    "hivemind-local": {"use_local_updates": True, "target_batch_size": 10000, **_HIVEMIND_COMMON},
}
# DDP + local SGD: torch's PeriodicModelAverager (post-local SGD without the warm-up): local
# steps, and every `period` steps an all-reduce of the parameters. 16 is between the examples of
# torch's docs (4) and DiLoCo's hundreds; `--baseline-set localsgd.period=N` changes it.
# lr (every baseline): None is the task's; a DDP step averages every rank's batch, so a task
# whose rate suits one peer's batch may train DDP better at a higher one (`ddp.lr=...`), as a
# node's own can be set by --node-set training.lr: each system at its own best rate.
PRESETS: dict[str, dict[str, Any]] = {
    **HIVEMIND_PRESETS, "ddp": {"lr": None}, "localsgd": {"period": 16, "lr": None},
    "ideal": {"lr": None},
}
COMPRESSIONS = ("none", "fp16", "uniform8bit", "quantile8bit")
_TYPES: dict[str, type] = {
    "use_local_updates": bool, "target_batch_size": int, "matchmaking_time": float,
    "averaging_timeout": float, "average_state_every": int, "grad_compression": str,
    "state_averaging_compression": str, "lr": float, "period": int,
}  # fmt: skip


def parse_baselines(text: str) -> tuple[str, ...]:
    """`--baseline ddp,hivemind` -> ("ddp", "hivemind"); "none" -> ().

    Raises:
        ValueError: an unknown or repeated name.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return ()
    for name in names:
        if name not in BASELINES:
            raise ValueError(
                f"--baseline {name!r}: expected a comma-separated list of "
                f"{', '.join(BASELINES)}, or none"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"--baseline {text!r}: a baseline is named twice")
    return tuple(names)


def missing_requirement(baseline: str) -> str | None:
    """Why `baseline` cannot run on this machine (hivemind not installed), or None."""
    if baseline in VIRTUAL_ONLY:
        return (f"--baseline {baseline}: DDP on links that cost nothing exists only in virtual "
                "time (--clock virtual)")  # fmt: skip
    if baseline.startswith("hivemind") and importlib.util.find_spec("hivemind") is None:
        return (
            f"--baseline {baseline}: hivemind is not installed; "
            "install the extra: pip install 'geotrain[baselines]' (hivemind 1.1.12)"
        )
    return None


def baseline_settings(baselines: Iterable[str], items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The settings of each configurable baseline: its preset, changed by `--baseline-set` items
    `NAME.KEY=VALUE` (e.g. `hivemind-local.target_batch_size=4096`).

    Raises:
        ValueError: an item that is malformed, names a baseline not in the run or a key the
            baseline does not have, or a value of the wrong type.
    """
    chosen = list(baselines)
    out = {b: dict(PRESETS[b]) for b in chosen if b in PRESETS}
    for item in items:
        key, eq, raw = item.partition("=")
        name, dot, field = key.partition(".")
        if not eq or not dot:
            raise ValueError(f"--baseline-set {item!r}: expected BASELINE.KEY=VALUE")
        if name not in out:
            known = ", ".join(out) or "none in this run"
            raise ValueError(
                f"--baseline-set {item!r}: {name!r} is not a configurable baseline of this run "
                f"(configurable: {known})"
            )
        if field not in out[name]:
            raise ValueError(
                f"--baseline-set {item!r}: {name} has no setting {field!r} "
                f"(settings: {', '.join(out[name])})"
            )
        out[name][field] = _value(item, field, raw.strip())
    return out


def _value(item: str, field: str, raw: str) -> Any:
    kind = _TYPES[field]
    if kind is bool:
        if raw.lower() not in ("true", "false"):
            raise ValueError(f"--baseline-set {item!r}: {field} expects true or false")
        return raw.lower() == "true"
    if kind is str:
        if raw not in COMPRESSIONS:
            raise ValueError(f"--baseline-set {item!r}: {field} expects one of {COMPRESSIONS}")
        return raw
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"--baseline-set {item!r}: {field} expects {what}") from None
    if not 0 < value < math.inf:
        raise ValueError(f"--baseline-set {item!r}: {field} must be > 0 and finite")
    return value


def describe(baseline: str, settings: dict[str, Any] | None) -> str:
    """The table's algorithm cell of a baseline."""
    s = settings or {}
    rate = f", lr {s['lr']:g}" if s.get("lr") is not None else ""
    if baseline == "ddp":
        return f"allreduce (gloo DDP){rate}"
    if baseline == "localsgd":
        return f"DDP + local SGD, params averaged every {s.get('period')} steps{rate}"
    mode = "local updates" if s.get("use_local_updates") else "sync grad averaging"
    return f"hivemind.Optimizer, {mode}, batch {s.get('target_batch_size')}{rate}"
