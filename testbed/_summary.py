# summary.json and the comparison table, computed from a run's files only (run.json, the peers'
# metrics lines, the bytes samples), so `geotrain testbed report DIR` gives the same answer later.
# Invariants: nothing here measures or invents a number: a figure the files do not hold is null;
# a system's t = 0 is the earliest first step of any of its peers (estimated from each peer's first
# metrics line as t - step / steps_per_s); time to target is when every peer's latest evaluated
# metric has reached the target; fairness is the mean final metric of the worst WORST_FRACTION
# of the peers (at least one), worst by the task's direction. The testbed's attackers
# (run.json "attackers", geotrain only) are no part of any quality figure (time to target, final
# metric, fairness, equal quality): their bytes count, their models do not.
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from geotrain.node.state import StateDir, format_bytes

from ._linkcheck import SPEC_TOLERANCE, off_spec


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON objects of a file, one a line (a torn last line, from a killed writer,
    is skipped, and so is any line that is not an object); non-finite numbers read as None."""
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
            # a NaN or infinite figure (an evaluation that gave NaN) is no figure: it made
            # ladder rows of "accuracy nan" and NaN tokens in summary.json, which is not JSON
            out.append({k: None if isinstance(v, float) and not math.isfinite(v) else v
                        for k, v in record.items()})  # fmt: skip
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
    hit = time_bytes_to(swarm_quality(peers, higher_is_better), [], target, higher_is_better, t0)
    return None if hit is None else hit[0]


def processes(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A peer's lines split by the process that wrote them (a restart starts a new one): by
    `pid`, or where the step count fell for lines that carry none."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        prev = out[-1][-1] if out else None
        if prev is None or r.get("pid") != prev.get("pid") or (
                r.get("pid") is None and r.get("step", 0) < prev.get("step", 0)):  # fmt: skip
            out.append([r])
        else:
            out[-1].append(r)
    return out


def stepped_spans(records: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(first, last) step line of each of a peer's processes that stepped over some time."""
    spans = []
    for proc in processes(records):
        stepped = [r for r in proc if r.get("step", 0) > 0]
        if len(stepped) >= 2 and stepped[-1]["t"] > stepped[0]["t"]:
            spans.append((stepped[0], stepped[-1]))
    return spans


def steps_per_s(records: list[dict[str, Any]]) -> float | None:
    """A peer's mean step rate while its processes ran: the steps from each process's first to
    its last step line over the time between them, summed over its processes (a killed peer's
    downtime is not counted; a restarted one counts its steps afresh)."""
    spans = stepped_spans(records)
    seconds = sum(last["t"] - first["t"] for first, last in spans)
    return sum(last["step"] - first["step"] for first, last in spans) / seconds if spans else None


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


def geotrain_cell(run: dict[str, Any]) -> str:
    """The table's algorithm cell of geotrain: the run's algorithm, and the learning rate its
    nodes were given by --node-set training.lr (as a baseline's cell says its --baseline-set
    rate)."""
    rate = None
    for item in run.get("node_overrides") or ():
        key, _, value = item.partition("=")
        if key.strip() == "training.lr":
            rate = value.strip()  # (the last one wins, as in the nodes' config)
    if rate is None:
        return run["algorithm"]
    try:
        rate = f"{float(rate):g}"
    except ValueError:
        pass
    return f"{run['algorithm']}, lr {rate}"


def bytes_at(samples: list[dict[str, Any]], t: float) -> int | None:
    """Bytes a system had put on the links by wall time t: the first sample at or after t (the
    samples are a quarter second apart); past the last sample (a node's evaluation at its exit,
    after the meter's last reading), the last: all the run put on the links as metered. None
    without samples."""
    if not samples:
        return None
    return next((s["bytes"] for s in samples if s["t"] >= t), samples[-1]["bytes"])


def swarm_quality(peers, higher_is_better: bool,
                  outages: list[list[tuple[float, float | None]]] | None = None,
                  ) -> list[tuple[float, float]]:  # fmt: skip
    """(t, the worst peer's latest metric) at each evaluation once every peer has one: the level
    the whole swarm is at or past.

    `outages` (aligned with `peers`): each peer's kills by the testbed, as (killed at, restarted
    at or None). The run's stop rule is followed: a killed peer's last metric no longer counts;
    the swarm is at no level until a restarted peer has reported from its new process, and a
    peer killed for good leaves the swarm (the others' level is the swarm's from then on)."""
    events = sorted(
        [(r["t"], 1, i, r["metric"]) for i, rs in enumerate(peers) for r in rs
         if r.get("metric") is not None]
        + [(killed, 0, i, back) for i, downs in enumerate(outages or []) for killed, back in downs]
    )  # fmt: skip
    latest: dict[int, float] = {}
    gone: set[int] = set()
    back_at: dict[int, float] = {}  # killed peers to come back, and when they were restarted
    out = []
    for t, is_metric, i, value in events:
        if not is_metric:  # a kill: value is when the peer was restarted (None: never)
            latest.pop(i, None)
            if value is None:
                gone.add(i)
                back_at.pop(i, None)  # (an earlier restart it never reported from)
            else:
                back_at[i] = value
        elif i in gone or (i in back_at and t <= back_at[i]):
            continue  # a line the killed process wrote before the kill was seen
        else:
            back_at.pop(i, None)
            latest[i] = value
        if latest and not back_at and len(latest) == len(peers) - len(gone):
            worst = min(latest.values()) if higher_is_better else max(latest.values())
            out.append((t, worst))
    return out


def peer_outages(run: dict[str, Any], system: str) -> list[list[tuple[float, float | None]]]:
    """Per peer of `system`, the testbed's kills that were applied: (wall time of the kill, of
    the next restart of that peer or None). Runs from before the faults named their peer are
    read from the fault's description ("t=15s kill peer 2")."""
    done: list[tuple[float, str, int]] = []
    for f in run.get("faults") or []:
        if f.get("system") != system:
            continue
        action, peer = f.get("action"), f.get("peer")
        if action is None:
            m = re.search(r"\b(kill|restart) peer (\d+)\b", f.get("fault", ""))
            action, peer = (m.group(1), int(m.group(2))) if m else (None, None)
        if action not in ("kill", "restart") or not isinstance(peer, int):
            continue
        if f.get("applied") and "t" in f:
            done.append((f["t"], action, peer))
        elif action == "restart" and f.get("applied_at_s") is None:
            # due after the run ended: the run waited for it, so the swarm was at no level
            done.append((math.inf, action, peer))
    done.sort()
    downs: list[list[tuple[float, float | None]]] = [[] for _ in range(run["peers"])]
    for t, action, peer in done:
        if action == "kill" and 0 <= peer < len(downs):
            back = next((u for u, a, q in done if a == "restart" and q == peer and u > t), None)
            downs[peer].append((t, back))
    return downs


def quality_curve(run: dict[str, Any], system: str, peers) -> list[tuple[float, float]]:
    """The swarm quality of `system` as every figure counts it: honest peers only, kills and
    restarts as the run's stop rule treats them."""
    attackers = attacker_peers(run, system)
    outages = [d for i, d in enumerate(peer_outages(run, system)) if i not in attackers]
    return swarm_quality(honest(peers, attackers), run.get("higher_is_better", True), outages)


def time_bytes_to(curve, samples, level: float, higher_is_better: bool,
                  t0: float) -> tuple[float, int | None] | None:  # fmt: skip
    """(seconds from t0, bytes by then) when the swarm first was at or past `level`, or None."""
    for t, worst in curve:
        if at_or_past(worst, level, higher_is_better):
            return round(t - t0, 2), bytes_at(samples, t)
    return None


def at_or_past(value: float, level: float, higher_is_better: bool) -> bool:
    """Whether a metric `value` is at or past `level`, in the metric's direction."""
    return value >= level if higher_is_better else value <= level


def time_bytes_held(curve, samples, level: float, higher_is_better: bool,
                    t0: float) -> tuple[float, int | None] | None:  # fmt: skip
    """(seconds from t0, bytes by then) from when the swarm was at or past `level` and stayed
    there to its last evaluation, or None when it ended short of it. A noisy metric can touch a
    level once and leave it (DDP on the 10M gpt model: 6.41 bits per byte at its step 1, 7.79 at
    step 3): the first touch alone said it was there."""
    since = None
    for t, worst in curve:
        reached = at_or_past(worst, level, higher_is_better)
        since = (since if since is not None else t) if reached else None
    return None if since is None else (round(since - t0, 2), bytes_at(samples, since))


WORST_FRACTION = 0.1  # fairness: the worst 10% of the peers (federated learning's usual cut)


def worst_peers(finals: list[float | None], higher_is_better: bool,
                fraction: float = WORST_FRACTION) -> list[int]:  # fmt: skip
    """Indices of the worst ceil(fraction x n) peers by final metric, worst first, among the n
    peers that have one (a peer never evaluated has no figure to rank)."""
    known = [(m, i) for i, m in enumerate(finals) if m is not None]
    if not known:
        return []
    ranked = sorted(known, reverse=higher_is_better)  # worst first: lowest when higher is better
    return [i for _, i in ranked[-math.ceil(fraction * len(known)) :]][::-1]


def _fairness(finals: list[float | None], higher_is_better: bool) -> dict[str, Any]:
    worst = worst_peers(finals, higher_is_better)
    return {
        "final_metric_worst_10pct": (round(statistics.fmean(finals[i] for i in worst), 4)
                                     if worst else None),  # type: ignore[misc]
        "worst_10pct_peers": worst,
        "final_metric_spread": (round(abs(max(known) - min(known)), 4)
                                if (known := [m for m in finals if m is not None]) else None),
    }  # fmt: skip


def utilization(records: list[dict[str, Any]], pinned_s: float, *,
                without_eval: bool = False) -> float | None:  # fmt: skip
    """The share of a peer's wall time (first to last step line of each of its processes: a
    killed peer's downtime is not counted, the faults say it) spent in its training steps;
    `without_eval`: of the wall time not spent in held-out evaluations (the testbed's own
    measurement, every 10 s in every system; None from lines written before it was counted).

    A geotrain node measures it (`utilization` and `train_s` in its lines): its processes'
    shares, weighted by the time each ran. A baseline's worker does not tell compute from
    waiting inside its step (DDP's all-reduce runs inside backward); with compute emulation its
    compute is the pinned time per step, so steps x pinned / wall time; without, None (not
    measured)."""
    key = "utilization_without_eval" if without_eval else "utilization"
    if any(r.get("utilization") is not None for r in records):  # a geotrain node's own
        owns = [own for proc in processes(records)
                if (own := next((r for r in reversed(proc) if r.get(key) is not None), None))]
        if not owns:
            return None  # (a node's lines from before it counted its evaluations)
        if any(own.get("train_s") is None for own in owns):  # lines from before train_s
            return round(owns[-1][key], 3)
        # (a process that ended within its first step has nothing to weigh: left out)
        timed = [own for own in owns if own["train_s"] > 0 and own[key] > 0]
        busy = sum(own["train_s"] for own in timed)
        wall = sum(own["train_s"] / own[key] for own in timed)
        return round(min(1.0, busy / wall), 3) if wall > 0 else None
    if pinned_s <= 0:
        return None
    steps = wall = 0.0
    for first, last in stepped_spans(records):
        seconds = last["t"] - first["t"]
        if without_eval:
            if last.get("eval_s") is None or first.get("eval_s") is None:
                return None
            seconds -= last["eval_s"] - first["eval_s"]
            if seconds <= 0:
                continue
        steps += last["step"] - first["step"]
        wall += seconds
    return round(min(1.0, steps * pinned_s / wall), 3) if wall > 0 else None


def attacker_peers(run: dict[str, Any], system: str) -> set[int]:
    """The peers of `system` that ran the testbed's attacker (geotrain only)."""
    return {int(p) for p in run.get("attackers", {})} if system == "geotrain" else set()


def honest(peers: list, attackers: set[int]) -> list:
    """The peers' records without the attackers' (the ones every quality figure is made of)."""
    return [rs for i, rs in enumerate(peers) if i not in attackers]


def _system(run: dict[str, Any], system: str, peers, samples) -> dict[str, Any]:
    t0 = train_start(peers)
    attackers = attacker_peers(run, system)
    if samples:
        sent, source = samples[-1]["bytes"], run["bytes_source"]
    elif system == "geotrain":
        sent, source = sum(node_bytes_out(r) for r in peers), "the nodes' bytes_out counters"
    else:
        sent, source = None, "not measured (no emulation: no shared counter)"
    finals = [None if i in attackers else
              next((r["metric"] for r in reversed(rs) if r.get("metric") is not None), None)
              for i, rs in enumerate(peers)]  # fmt: skip
    higher = run.get("higher_is_better", True)
    curve = quality_curve(run, system, peers)
    best = (max if higher else min)((w for _, w in curve), default=None)
    to_target = None if t0 is None else time_bytes_to(
        curve, samples, run["target_value"], higher, t0)  # fmt: skip
    entry = run["systems"][system]
    known = [m for m in finals if m is not None]
    rates = [steps_per_s(rs) for rs in peers]
    rates_known = [r for r in rates if r is not None]
    slowdowns = run.get("slowdowns") or [1.0] * len(peers)
    busy, busy_ex = ([utilization(rs, run.get("step_ms", 0.0) / 1000 * slowdowns[i],
                                  without_eval=ex) for i, rs in enumerate(peers)]
                     for ex in (False, True))  # fmt: skip
    busy_known = [u for u in busy if u is not None]
    busy_ex_known = [u for u in busy_ex if u is not None]
    return {
        "system": system,
        "algorithm": entry.get("algorithm") or (
            geotrain_cell(run) if system == "geotrain" else "allreduce (gloo DDP)"),
        "settings": entry.get("settings"),
        "time_to_target_s": None if to_target is None else to_target[0],
        "attackers": sorted(attackers),
        "final_metric": round(statistics.fmean(known), 4) if known else None,
        "final_metric_by_peer": finals,
        **_fairness(finals, higher),
        "best_swarm_metric": best,
        "bytes_to_target": None if to_target is None else to_target[1],
        "bytes_sent_total": sent,
        "bytes_source": source,
        "steps_per_s_median": round(statistics.median(rates_known), 3) if rates_known else None,
        "steps_per_s_by_peer": [None if r is None else round(r, 3) for r in rates],
        # compute utilization: share of wall time in training steps (see utilization())
        "utilization_by_peer": busy,
        "utilization_min": min(busy_known) if busy_known else None,
        # the same of the wall time not spent in held-out evaluations (see utilization())
        "utilization_without_eval_by_peer": busy_ex,
        "utilization_without_eval_min": min(busy_ex_known) if busy_ex_known else None,
        "startup_s": None if t0 is None else round(t0 - run["systems"][system]["launch_t"], 2),
        "trained_s": None if t0 is None else round(
            max((rs[-1]["t"] for rs in peers if rs), default=t0) - t0, 2),
        "stopped": run["systems"][system]["stopped"],
        # peers whose process failed by itself (a baseline's rank that crashed): its figures
        # end there (absent from runs written before it)
        "failed_peers": run["systems"][system].get("failed_peers") or [],
        # peers restarted by a fault that never reported a metric again: their final figure is
        # from before their kill (a node slow to start on a loaded machine, one that failed at
        # once, one restarted too late to evaluate); the system sets no equal-quality level
        "silent_after_restart": _silent_after_restart(run, system, peers),
        # seconds trained past the run's duration (a baseline's stop checks come every few
        # steps, and a fault that slows its steps between two lets it run on); counted in its
        # figures, so said (None: within a tenth of the duration)
        "overran_s": _overran_s(run, system, t0, peers),
    }  # fmt: skip


def _silent_after_restart(run: dict[str, Any], system: str, peers) -> list[int]:
    """Peers of `system` a restart fault brought back that reported no metric after it (no
    line at all, or steps but no evaluation before the run ended): their last metric is from
    before their kill, and the swarm's level is unknown from that kill on."""
    silent = set()
    for fault in run.get("faults", []):
        if (fault.get("system") == system and fault.get("action") == "restart"
                and fault.get("applied") and fault.get("t") is not None):  # fmt: skip
            p = fault.get("peer")
            if isinstance(p, int) and 0 <= p < len(peers) and not any(
                    r["t"] > fault["t"] and r.get("metric") is not None
                    for r in peers[p]):  # fmt: skip
                silent.add(p)
    return sorted(silent)


def _overran_s(run: dict[str, Any], system: str, t0: float | None, peers) -> float | None:
    """How long past run["duration_s"] a baseline's last step came, when beyond a tenth of the
    duration plus one of its units (a step; local SGD's period), the most its stop rule lets it
    run on in the normal way. geotrain's nodes are stopped by the testbed's own clock (their
    lines after it are their stop: the step they were in, an evaluation, the checkpoint)."""
    duration = run.get("duration_s")
    if system == "geotrain" or t0 is None or not duration:
        return None
    last, rates = t0, []
    for rs in peers:
        stepped = [r for r in rs if r.get("step")]
        if stepped:
            last = max(last, stepped[-1]["t"])
            if stepped[-1].get("steps_per_s"):
                rates.append(stepped[-1]["steps_per_s"])
    settings = run["systems"][system].get("settings") or {}
    unit_s = (settings.get("period") or 1) / min(rates) if rates else 0.0
    past = last - t0 - duration
    return round(past, 1) if past > 0.1 * duration + unit_s else None


def build_summary(out: Path) -> dict[str, Any]:
    """summary.json of the run in `out` (issue 8's shape, plus a few fields it explains)."""
    run = json.loads((out / "run.json").read_text())
    # every file is read once: the table's figures and the equal-quality ladder share them
    loaded = {s: (peer_metrics(out, s, run["peers"]), bytes_samples(out, s))
              for s in run["systems"]}  # fmt: skip
    systems = [_system(run, s, *loaded[s]) for s in run["systems"]]
    return {
        "scenario": run["scenario"],
        "emulation": run["emulation"],
        "emulation_reason": run["emulation_reason"],
        "peers": run["peers"],
        "task": run["task"],
        "target": {"metric": run["metric"], "value": run["target_value"]},
        "systems": systems,
        "equal_quality": equal_quality(run, systems, loaded),
        # time to target over the ideal's (DDP on links that cost nothing; virtual runs only)
        "wan_penalty": wan_penalty(systems),
        "links": run["links"],
        # each measured link that missed its spec by more than 10%: the run's figures are of
        # the link the emulator gave (a busy machine), not of the scenario's
        "links_off_spec": links_off_spec(run["links"]),
        "faults": run["faults"],
        "rate_scale": run["rate_scale"],
        "duration_s": run.get("duration_s"),
        # every system evaluated at least this often (a time to a level is known to within it;
        # null: a run from before --eval-every-s, at 10 s)
        "eval_every_s": run.get("eval_every_s"),
        "consensus_distance_final": run["consensus_distance_final"],
        "time_origin": "each system's first step; time_to_target_s counts from there",
        "partition": _partition(run),
        "availability": run.get("availability", {"windows": [], "systems": [], "note": None}),
        "fairness": "final_metric_worst_10pct: mean final metric of the worst ceil(10%) of the "
                    "peers with one, worst by the task's direction (worst_10pct_peers, worst "
                    "first); final_metric is the mean over all of them",
    }


def _partition(run: dict[str, Any]) -> dict[str, Any]:
    """How the data was split: "iid" (alpha null: it plays no part) or "dirichlet" with alpha."""
    kind = run.get("partition", "iid")  # runs before --partition were IID
    return {"kind": kind, "alpha": run.get("alpha") if kind == "dirichlet" else None}


LADDER_STEPS = (0.25, 0.5, 0.75)  # rungs below the equal-quality level, as fractions of the way


def equal_quality(run: dict[str, Any], systems: list[dict[str, Any]],
                  loaded: dict[str, tuple[list, list]]) -> dict | None:  # fmt: skip
    """Every system's time and bytes to the best level all of them reached (every peer at or past
    it): the comparison at equal quality, whether or not anyone reached the target. A system
    whose peers were never all evaluated has no level and shows no time.

    `ladder` holds the same for rungs from the worst starting level (the swarms' first
    evaluations) up to that level, so a run says who was ahead all the way, not at one point.
    `loaded`: per system, its peers' metrics lines and its bytes samples."""
    return _equal_quality(
        [(s["system"], run, s, *loaded[s["system"]]) for s in systems],
        run["metric"], run.get("higher_is_better", True),
    )  # fmt: skip


def _equal_quality(entries: list[tuple[str, dict[str, Any], dict[str, Any], list, list]],
                   metric: str, higher: bool) -> dict | None:  # fmt: skip
    """equal_quality over `entries`: (name, its run.json, its system summary, its peers'
    metrics lines, its bytes samples), from one run or several."""
    bests = [s["best_swarm_metric"] for _, _, s, _, _ in entries
             if s["best_swarm_metric"] is not None]  # fmt: skip
    # a system with a peer that never reported after its restart has no level from that kill
    # on: its best is where the kill froze it (a stranger's hivemind run set every system's
    # level at 0.358, barely trained, that way), so the others set the level where they can
    known = [s["best_swarm_metric"] for _, _, s, _, _ in entries
             if s["best_swarm_metric"] is not None and not s.get("silent_after_restart")
             and s.get("stopped") not in CUT_SHORT]  # (nor one stopped with the run)
    if len(entries) < 2 or not bests:
        return None
    bests = known or bests
    level = min(bests) if higher else max(bests)
    curves, starts = {}, []
    for name, run, _, peers, samples in entries:
        # (the system of "geotrain", or of "RUN/geotrain" in a comparison of runs)
        curve = quality_curve(run, name.rpartition("/")[2], peers)
        curves[name] = (curve, samples, train_start(peers))
        if curve:
            starts.append(curve[0][1])
    start = min(starts) if higher else max(starts)
    rungs = [start + (level - start) * f for f in LADDER_STEPS] + [level]

    def hits(rung: float) -> dict[str, dict[str, Any]]:
        by_system = {}
        for name, (curve, samples, t0) in curves.items():
            hit = None if t0 is None else time_bytes_to(curve, samples, rung, higher, t0)
            held = None if t0 is None else time_bytes_held(curve, samples, rung, higher, t0)
            by_system[name] = {"time_s": hit[0] if hit else None,
                               "bytes": hit[1] if hit else None,
                               "held_time_s": held[0] if held else None,
                               "held_bytes": held[1] if held else None}  # fmt: skip
        return by_system

    ladder = [{"level": round(r, 6), "systems": hits(r)} for r in rungs if r != start]
    return {"metric": metric, "level": level, "systems": hits(level), "ladder": ladder,
            "meaning": "every peer at or past the best level all systems reached (time_s: the "
                       "first time; held_time_s: from when it stayed there to the end, None "
                       "when it ended short of it)"}  # fmt: skip


# what must agree for runs to be compared at equal quality (bytes_source: the same counters)
COMPARABLE = ("task", "metric", "higher_is_better", "peers", "bytes_source")


def compare_runs(outs: list[Path], only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Several runs' systems at equal quality, as one run's are (`equal_quality`): e.g. the
    same scenario with two geotrain settings, each run made with --baseline none. Each system is
    named RUN/SYSTEM (RUN: its folder's name); `only` keeps those systems.

    Raises:
        ValueError: fewer than two systems, or runs of another task, metric or peer count (the
            message names the first field that differs), or a folder without a run.
    """
    entries, runs = [], []
    for out in outs:
        try:
            run = json.loads((out / "run.json").read_text())
            systems, n = dict(run["systems"]), int(run["peers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{out}: no testbed run there ({type(exc).__name__}: {exc})") from None
        if not systems:
            raise ValueError(f"{out}: no system finished in that run (interrupted)")
        runs.append((out, run))
        for system in systems:
            if only and system not in only:
                continue
            try:
                peers = peer_metrics(out, system, n)
                samples = bytes_samples(out, system)
                entries.append((f"{out.resolve().name}/{system}", run,
                                _system(run, system, peers, samples), peers, samples))  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{out}: {system}'s files cannot be read ({type(exc).__name__}: "
                                 f"{exc})") from None  # fmt: skip
    names = [e[0] for e in entries]
    if len(set(names)) < len(names):
        raise ValueError("two runs share a folder name: copy one under another name")
    for key in COMPARABLE:
        values = {json.dumps(run.get(key)) for _, run in runs}
        if len(values) > 1:
            raise ValueError(f"the runs differ in {key} ({', '.join(sorted(values))}): a level "
                             "of one is not a level of the other")  # fmt: skip
    if len(entries) < 2:
        raise ValueError(f"{len(entries)} system(s) to compare: give two runs or more"
                         + (f" with {', '.join(only)}" if only else ""))  # fmt: skip
    first = runs[0][1]
    eq = _equal_quality(entries, first["metric"], first.get("higher_is_better", True))
    return {
        "runs": [{"dir": str(out), "scenario": run["scenario"],
                  "command": " ".join(run.get("command") or []) or None}
                 for out, run in runs],  # fmt: skip
        "task": first["task"],
        # a run stopped early compares what it finished (said: its figures end there)
        "interrupted": [str(out) for out, run in runs if run.get("interrupted")],
        "systems": [e[2] | {"system": e[0]} for e in entries],
        "equal_quality": eq,
    }


def render_comparison(doc: dict[str, Any]) -> str:
    """The printed form of compare_runs: each system's figures, then the ladder."""
    rows = [f"{s['system']}: final {_fmt_metric(s.get('final_metric'))}, "
            f"{format_bytes(s.get('bytes_sent_total'), 2)} on the wire, "
            f"{_fmt_metric(s.get('steps_per_s_median'))} steps/s (median peer)"
            for s in doc["systems"]]  # fmt: skip
    rows += [f"note: {d} was interrupted: its systems that finished are compared, and the "
             "one that was running up to the stop (it sets no level)"
             for d in doc.get("interrupted") or []]  # fmt: skip
    scenarios = sorted({str(r["scenario"]) for r in doc["runs"]})
    if len(scenarios) > 1:  # (meant, at times: with and without NAT, say)
        rows.append(f"note: the runs' scenarios differ ({', '.join(scenarios)})")
    eq = doc["equal_quality"]
    if eq is None:
        return "\n".join([*rows, "no level that every system's peers all reached"])
    return "\n".join([*rows, *_equal_lines({"equal_quality": eq}), *_against_first(eq)])


def _against_first(eq: dict[str, Any]) -> list[str]:
    """Each system's time and bytes at equal quality as multiples of the first one's."""
    (first, base), *rest = eq["systems"].items()
    out = []
    for name, hit in rest:
        if None in (hit["time_s"], base["time_s"]) or not base["time_s"]:
            continue
        line = f"{name} / {first}: {hit['time_s'] / base['time_s']:.2f}x the time"
        if hit["bytes"] and base["bytes"]:
            line += f", {hit['bytes'] / base['bytes']:.3g}x the bytes"
        out.append(line + " to the level")
    return out


def _fmt_metric(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.4g}"


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
    rows = [("system", "algorithm", "time to target", f"final {metric}: mean (worst 10%)",
             "bytes sent", "median steps/s")]  # fmt: skip
    for s in summary["systems"]:
        ttt = s["time_to_target_s"]
        rows.append((
            s["system"], s["algorithm"],
            f"{ttt:.1f} s" if ttt is not None else f"not reached ({s['trained_s']} s)",
            _final_cell(s),
            format_bytes(s["bytes_sent_total"], digits=2),
            "-" if s["steps_per_s_median"] is None else f"{s['steps_per_s_median']:.2f}",
        ))  # fmt: skip
    return rows


def _final_cell(s: dict[str, Any]) -> str:
    """`0.9412 (0.9220)`: the mean final metric and, beside it, the worst 10%'s (fairness)."""
    if s["final_metric"] is None:
        return "-"
    worst = s.get("final_metric_worst_10pct")  # absent from summaries written before it
    return f"{s['final_metric']:.4f}" + ("" if worst is None else f" ({worst:.4f})")


def comparison_notes(summary: dict[str, Any]) -> list[str]:
    """The lines under the table: ratios geotrain vs the baseline when both are known, bytes."""
    return [*_off_spec_lines(summary), *_failure_lines(summary), *_ratios(summary["systems"]),
            *_equal_lines(summary),
            *_fairness_lines(summary), *_utilization_lines(summary),
            f"bytes: {summary['systems'][0]['bytes_source']}"]  # fmt: skip


def links_off_spec(links: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The links of run.json that missed their spec (see _linkcheck.off_spec): src, dst, misses."""
    out = []
    for link in links:
        misses = off_spec(link) if isinstance(link, dict) else []
        if misses:
            out.append({"src": link.get("src"), "dst": link.get("dst"), "misses": misses})
    return out


def _off_spec_lines(summary: dict[str, Any]) -> list[str]:
    return [f"LINK OFF SPEC: {x['src']} -> {x['dst']}: {'; '.join(x['misses'])} (more than "
            f"{SPEC_TOLERANCE:.0%} off: the figures are of this link, not the scenario's)"
            for x in summary.get("links_off_spec") or []]  # fmt: skip


def _failure_lines(summary: dict[str, Any]) -> list[str]:
    """A system some of whose peers failed by themselves, or never came back from a restart, or
    that trained well past the duration: said first, its figures are partial or longer."""
    lines = [f"FAILED: {s['system']} peers {s['failed_peers']} exited with an error (see their "
             "logs): its figures end where they failed" for s in summary["systems"]
             if s.get("failed_peers")]  # fmt: skip
    lines += [f"{s['stopped'].upper()}: {s['system']} was running when the run "
              f"{'was stopped' if s['stopped'] == 'interrupted' else 'failed'}: its figures end "
              "there, and it sets no level at equal quality" for s in summary["systems"]
              if s.get("stopped") in CUT_SHORT]  # fmt: skip
    for s in summary["systems"]:
        if s.get("silent_after_restart"):
            lines.append(f"NOT BACK: {s['system']} peers {s['silent_after_restart']} were "
                         "restarted by a fault and never reported a metric again (see their "
                         "logs): their final figures are from before their kill, the system's "
                         "level is unknown from it, and the other systems set the level of "
                         "the comparison at equal quality")  # fmt: skip
        if s.get("overran_s"):
            lines.append(f"OVERRAN: {s['system']} stepped {s['overran_s']:g} s past the run's "
                         f"{summary.get('duration_s', 0):g} s, more than a tenth of it and a "
                         "step (or local SGD period) beyond (its stop checks come every few "
                         "steps; steps that slowed between two let it run on): those seconds "
                         "are in its figures")  # fmt: skip
    return lines


def _utilization_lines(summary: dict[str, Any]) -> list[str]:
    """The lowest peer's compute utilization per system, where it was measured."""
    known = [(s["system"], s["utilization_min"], s.get("utilization_without_eval_min"))
             for s in summary["systems"] if s.get("utilization_min") is not None]  # fmt: skip
    if not known:
        return []
    cells = ", ".join(f"{name} {u:.0%}" + ("" if ex is None else f" ({ex:.0%})")
                      for name, u, ex in known)  # fmt: skip
    said = ", and in brackets of the time not spent in held-out evaluations" if any(
        ex is not None for _, _, ex in known) else ""
    return [f"compute utilization, lowest peer: {cells} (share of wall time in training steps"
            f"{said}; baselines: pinned step time x steps, under compute emulation only)"]


def _fairness_lines(summary: dict[str, Any]) -> list[str]:
    """Who the worst peers were (the table's worst 10%), the data split, and the windows."""
    lines = []
    for s in summary["systems"]:
        if s.get("worst_10pct_peers"):
            peers = ", ".join(f"peer {i}" for i in s["worst_10pct_peers"])
            lines.append(f"worst 10%: {s['system']} {peers} (final {s['final_metric_worst_10pct']}"
                         f" vs mean {s['final_metric']})")  # fmt: skip
    part = summary.get("partition") or {}
    if part.get("kind") not in (None, "iid"):
        lines.append(f"data: {part['kind']} label skew, alpha {part['alpha']:g}, the same split "
                     "in every system")  # fmt: skip
    availability = summary.get("availability") or {}
    if availability.get("windows"):
        lines.append(f"availability: {len(availability['windows'])} peers come and go; "
                     f"{availability['note']}")  # fmt: skip
    return lines


def render_table(summary: dict[str, Any]) -> str:
    """The comparison table, with the ratios geotrain vs the baseline when both are known."""
    rows = comparison_rows(summary)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [comparison_title(summary)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines + comparison_notes(summary))


CUT_SHORT = ("interrupted", "failed")  # a system the run stopped while it ran: partial figures


def wan_penalty(systems: list[dict[str, Any]]) -> dict[str, float] | None:
    """Each system's time to target as a multiple of the ideal's (DDP on links that cost
    nothing, a virtual run's baseline): what the WAN costs it. None without the ideal."""
    by = {s["system"]: s for s in systems}
    ideal = by.get("ideal", {}).get("time_to_target_s")
    if not ideal:
        return None
    return {name: round(s["time_to_target_s"] / ideal, 3) for name, s in by.items()
            if s.get("time_to_target_s")}  # fmt: skip


def _ratios(systems: list[dict[str, Any]]) -> list[str]:
    """geotrain against each baseline: time to target and bytes of the whole runs."""
    by = {s["system"]: s for s in systems}
    if "geotrain" not in by:
        return []
    g, out = by["geotrain"], []
    if g.get("stopped") in CUT_SHORT:
        return []
    for name, d in by.items():
        if name == "geotrain" or d.get("stopped") in CUT_SHORT:
            continue  # (a system cut short has no whole run to set beside the other's)
        label = "DDP" if name == "ddp" else name
        if g["time_to_target_s"] and d["time_to_target_s"]:
            ratio = d["time_to_target_s"] / g["time_to_target_s"]
            out.append(f"time to target: {label}/geotrain = {ratio:.2f} (above 1: geotrain sooner)")
        elif g["time_to_target_s"] and not d["time_to_target_s"]:
            out.append(f"time to target: geotrain reached it, {label} did not")
        elif d["time_to_target_s"] and not g["time_to_target_s"]:
            out.append(f"time to target: {label} reached it, geotrain did not")
        if g["bytes_sent_total"] and d["bytes_sent_total"]:
            ratio = g["bytes_sent_total"] / d["bytes_sent_total"]
            out.append(f"bytes sent: geotrain/{label} = {ratio:.3g} (whole runs)")
    penalty = wan_penalty(systems)
    if penalty:
        out.append("WAN penalty (time to target over the ideal's, DDP on free links): "
                   + ", ".join(f"{name} {x:.2f}x" for name, x in penalty.items()))
    return out


def _equal_lines(summary: dict[str, Any]) -> list[str]:
    """Time and bytes of every system to each rung of the ladder, the best level all of them
    reached last."""
    eq = summary.get("equal_quality")
    if not eq:
        return []

    def cells(systems: dict[str, dict[str, Any]]) -> str:
        parts = []
        for name, hit in systems.items():
            if hit["time_s"] is None:
                parts.append(f"{name} -")
                continue
            cell = f"{name} {hit['time_s']:.1f} s, {format_bytes(hit['bytes'], 2)}"
            held = hit.get("held_time_s", hit["time_s"])  # (a summary from before it: as then)
            if held is None:
                cell += " (then left it: not there at the end)"
            elif held != hit["time_s"]:
                cell += f" (there for good from {held:.1f} s)"
            parts.append(cell)
        return "; ".join(parts)

    lines = [f"  {eq['metric']} {rung['level']:.4g}: " + cells(rung["systems"])
             for rung in eq.get("ladder", [])[:-1]]  # fmt: skip
    if lines:
        lines.insert(0, "on the way (every peer at or past each level):")
    return [*lines, f"at equal quality ({eq['metric']} {eq['level']:.4g}, every peer): "
            + cells(eq["systems"])]  # fmt: skip
