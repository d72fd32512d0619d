# Status and metrics of a running node. Invariants: status.json is replaced atomically (a reader
# never sees half a file); metrics.jsonl only grows, one JSON object per line; this module only
# formats and writes what the node hands it, it measures nothing itself.
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._files import write_atomically

STATUS_FORMAT = "geotrain-status/1"


@dataclass(frozen=True)
class PeerStatus:
    peer: str  # short peer ID
    address: str
    state: str  # alive / suspect / dead / left
    rtt_ms: float | None
    goodput_mbit: float | None
    codec: str | None
    exchanges_ok: int
    exchanges_failed: int


@dataclass(frozen=True)
class NodeStatus:
    """A snapshot of one node, as `geotrain status` shows it and the testbed reads it."""

    peer_id: str
    address: str
    algorithm: str
    task: str
    metric_name: str
    elapsed_s: float
    step: int
    steps_per_s: float
    loss: float | None
    metric: float | None
    metric_step: int | None
    bytes_in: int  # everything the transport moved (exchanges, state sync, membership, probes)
    bytes_out: int
    exchanges_ok: int
    exchanges_failed: int
    rejected_updates: int
    pid: int
    running: bool = True
    peers: tuple[PeerStatus, ...] = field(default_factory=tuple)
    peak_rss_mb: float | None = None  # the node process's peak resident memory
    # what the node estimated it needs: at start (a loop of the user's own: again at wrap())
    memory_estimate_mb: float | None = None
    algorithm_stats: dict[str, float | int] = field(default_factory=dict)  # per-algorithm counters
    algorithm_gauges: tuple[str, ...] = ()  # the names in algorithm_stats that are levels
    certificate_expires_at: float | None = None  # POSIX seconds; None: no certificate (or unknown)
    # [privacy]: epsilon spent and its budget (None: no privacy); exhausted: training on this
    # node's data has stopped (it only mixes)
    privacy_epsilon: float | None = None
    privacy_budget: float | None = None
    privacy_exhausted: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # rejected_updates, split
    # seconds in the node's own training steps, and their share of wall time since the first
    # step (compute utilization); None for a loop of the user's own (geotrain.join)
    train_s: float | None = None
    # training samples this process took (None for a loop of the user's own: not seen)
    samples: int | None = None
    utilization: float | None = None
    # seconds in held-out evaluations since the first step, and the share of the rest of the
    # wall time spent in training steps (None, as train_s, for a loop of the user's own)
    eval_s: float | None = None
    utilization_without_eval: float | None = None
    # peers accepted this node's connections but none dialled it back (behind NAT, configured
    # reachable): the node warned `not_dialled`
    not_dialled: bool = False
    # network.bootstrap addresses that never answered, while the node knows no live peer (it
    # trains alone): a typo'd address or port, a node not up, another swarm
    bootstrap_unanswered: list[str] = field(default_factory=list)
    status_every_s: float | None = None  # how often the node writes it (state.status_every_s)
    # network.reachable: False for a node in client mode (behind NAT: it dials, nobody dials
    # it; its address is its loopback listener for local status only)
    reachable: bool = True
    # the metric is a held-out evaluation's; False for a loop joined with no evaluate, whose
    # metric is its training loss (status shows it once, as the loss)
    held_out: bool = True
    steps_over_step_time: int = 0  # compute emulation: steps whose compute overran the pinned time
    # steps in a row whose loss was NaN or inf (the loss field is null then: JSON has no NaN)
    nonfinite_losses: int = 0
    # what the network sent that was refused, by reason (as the metrics count them): frames
    # that failed to open (garbage, replays, ...), handshakes that failed either way (strangers,
    # other swarms, timeouts, dead peers dialled), requests refused as malformed, by kind
    frames_rejected: dict[str, int] = field(default_factory=dict)
    handshakes_failed: dict[str, int] = field(default_factory=dict)
    messages_rejected: dict[str, int] = field(default_factory=dict)
    # file descriptors the node's process has open, and its limit (None: not known); idle
    # connections to the node's port hold one each until nng drops them
    open_files: int | None = None
    open_files_limit: int | None = None
    # the part of bytes_in / bytes_out that was state sync's values (a late joiner fetching the
    # model, a donor serving it): not the exchanges' bytes
    sync_bytes_in: int = 0
    sync_bytes_out: int = 0
    # seconds of the exchanges this node started that succeeded: the latest one's, the mean
    # (None: none yet, or an algorithm that does not time them: dpsgd, diloco)
    exchange_last_s: float | None = None
    exchange_mean_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = STATUS_FORMAT
        for key in ("loss", "metric"):
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = None
        return data


def write_status(path: Path, status: NodeStatus) -> None:
    write_atomically(path, json.dumps(status.to_json(), indent=1).encode())


METRICS_MAX_BYTES = 64 * 2**20  # then metrics.jsonl becomes metrics.jsonl.1 (one kept)


def append_metrics(path: Path, record: dict[str, Any], max_bytes: int = METRICS_MAX_BYTES) -> None:
    """Append `record` as one JSON line. A file past `max_bytes` is first moved to `<path>.1`
    (replacing an older one): it grew without end, ~80 MB a day at the default cadence."""
    try:
        if path.stat().st_size >= max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def read_status(path: Path) -> dict[str, Any]:
    """Read a status file written by a node.

    Raises:
        ValueError: not there, not JSON, or not a geotrain status file.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}; is a node running with this state dir?") from exc
    return parse_status(raw, str(path))


def parse_status(raw: bytes, where: str) -> dict[str, Any]:
    """Parse a status document (from a file or a node's StatusReply).

    Raises:
        ValueError: not JSON, or not a geotrain status document.
    """
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != STATUS_FORMAT:
        raise ValueError(f"{where}: not a geotrain status document")
    for key in ("peer_id", "address", "step", "task", "algorithm", "metric_name"):
        if key not in data:
            raise ValueError(f"{where}: status without {key!r}")
    return data


def _fmt(value: Any, spec: str = "") -> str:
    """`value` formatted by `spec`; "-" for None, and as it is (cut to 24 characters) where
    `spec` does not fit it: a status from another version, or a node's made-up one, renders."""
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)[:24]


def _certificate_line(expires_at: Any) -> list[str]:
    if not isinstance(expires_at, int | float) or not 0 <= expires_at < 2**40:
        return []
    left = expires_at - time.time()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at))
    if left <= 0:
        return [f"certificate EXPIRED at {when}: peers refuse this node; renew it "
                "(geotrain swarm admit) and replace the certificate file"]  # fmt: skip
    soon = "  RENEW SOON" if left < 86400 else ""
    return [f"certificate expires {when} (in {left / 3600:.1f} h){soon}"]


def _privacy_line(data: dict[str, Any]) -> list[str]:
    spent = data.get("privacy_epsilon")
    if not isinstance(spent, int | float):
        return []
    done = ("  BUDGET SPENT: no more training on this node's data, it keeps mixing"
            if data.get("privacy_exhausted") else "")  # fmt: skip
    return [f"privacy   epsilon {spent:.3f} of {_fmt(data.get('privacy_budget'))}{done}"]


def _not_dialled_line(data: dict[str, Any]) -> list[str]:
    unanswered = data.get("bootstrap_unanswered")
    if isinstance(unanswered, list) and unanswered:
        return [f"reach     network.bootstrap never answered ({', '.join(map(str, unanswered))}) "
                "and no peer is known: training alone; is a node of this swarm listening "
                "there?"]  # fmt: skip
    if not data.get("not_dialled"):
        return []
    return [f"reach     no peer could dial {data['address']}: behind NAT or a firewall? "
            "set network.reachable = false (client mode)"]


STALE_AFTER_S = 30.0  # a running node's status this old (or 3 of its intervals) is stale


def _stale_line(data: dict[str, Any], age_s: float | None) -> list[str]:
    """A status file a running node stopped rewriting (`age_s`: how old the file was when read;
    None for a status asked over the network, which is fresh)."""
    if age_s is None or not data.get("running", True):
        return []
    every = data.get("status_every_s")
    limit = max(STALE_AFTER_S, 3 * every if isinstance(every, int | float) else 0.0)
    if age_s <= limit:
        return []
    return [f"stale     written {age_s:.0f} s ago by a node that said it was running: paused (a "
            "machine asleep, SIGSTOP), hung, or too busy to write it; these figures are from "
            "then"]


def exchange_time_note(data: dict[str, Any]) -> str:
    """How long the exchanges this node started took, where it timed any."""
    last, mean = data.get("exchange_last_s"), data.get("exchange_mean_s")
    if not isinstance(last, int | float) or not isinstance(mean, int | float):
        return ""
    return f" (started here: last {_seconds(last)}, mean {_seconds(mean)})"


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def sync_note(data: dict[str, Any]) -> str:
    """How much of the traffic was state sync's (a joiner's fetch, a donor's serving), when any:
    bytes per exchange are the rest's."""
    synced = [(way, data.get(f"sync_bytes_{way}")) for way in ("in", "out")]
    cells = [f"{way} {format_bytes(n)}" for way, n in synced if isinstance(n, int) and n]
    return f" (state sync {', '.join(cells)})" if cells else ""


def _refused_line(data: dict[str, Any]) -> list[str]:
    """What the network sent that was refused, when anything was (older status files: nothing)."""
    cells = []
    for key, name in (("frames_rejected", "frames"), ("handshakes_failed", "handshakes failed"),
                      ("messages_rejected", "messages")):  # fmt: skip
        counts = data.get(key)
        if not isinstance(counts, dict) or not any(counts.values()):
            continue
        split = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()) if n)
        cells.append(f"{name} {sum(counts.values())} ({split})")
    return ["refused   " + "  ".join(cells)] if cells else []


FILES_WARN_SHARE = 0.8  # open files past this share of the limit are said loudly


def _process_line(data: dict[str, Any]) -> list[str]:
    """The node process's memory (peak, against its estimate) and open files (against the
    limit), where the status says them."""
    cells = []
    if isinstance(data.get("peak_rss_mb"), int | float):
        cells.append(f"memory peak {data['peak_rss_mb']:.0f} MB (estimated "
                     f"{_fmt(data.get('memory_estimate_mb'), '.0f')} MB)")  # fmt: skip
    count, limit = data.get("open_files"), data.get("open_files_limit")
    if isinstance(count, int):
        near = (isinstance(limit, int) and limit > 0 and count >= FILES_WARN_SHARE * limit)
        cells.append(f"open files {count} of {_fmt(limit)}" + (
            "  NEAR THE LIMIT: idle connections to the node's port? checkpoints fail at it"
            if near else ""))  # fmt: skip
    return ["process   " + "  ".join(cells)] if cells else []


def _loss_cell(data: dict[str, Any]) -> str:
    bad = data.get("nonfinite_losses") or 0
    return f"NaN/inf ({_fmt(bad)} steps in a row)" if bad else _fmt(data.get("loss"), ".4f")


def _metric_cell(data: dict[str, Any]) -> str:
    older = not (data["metric_name"] == "loss" and data["task"] == "own loop")  # (no held_out)
    if not data.get("held_out", older):
        return ""  # a loop joined with no evaluate: its metric is the loss, shown once
    at = _fmt(data.get("metric_step"))
    return f"  {data['metric_name']} {_fmt(data.get('metric'), '.4f')} (step {at})"


def format_bytes(n: int | None, digits: int = 1) -> str:
    """A byte count in the unit that shows it: "734.3 kB", "1.2 GB", "512 B" (`digits` after
    the point); "-" for None."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return _fmt(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} B"


def _algorithm_line(data: dict[str, Any]) -> list[str]:
    stats = data.get("algorithm_stats") or {}
    if not stats or not isinstance(stats, dict):
        return []
    return [f"{str(data['algorithm']) + ' ':<10}" + "  ".join(f"{k} {format_number(v)}"
                                                         for k, v in stats.items())]  # fmt: skip


def format_number(v: Any) -> str:
    """A counter or gauge as `g` formats a number; anything else (None, a name) as it is."""
    return f"{v:g}" if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


def _address_cell(peer: dict[str, Any]) -> str:
    """A peer's address; a client's (client://<its whole peer ID>, which pushed the row's other
    columns out of line) cut to 27 characters. Other addresses are shown whole (the port is
    their end)."""
    text = _fmt(peer.get("address"))
    return text[:24] + "..." if text.startswith("client://") and len(text) > 27 else text


def render_status(data: dict[str, Any], age_s: float | None = None) -> str:
    """A human-readable status: the node's numbers, then one row per known peer. `age_s`: how
    old the status file was when read (a stale one is said); None for one asked over the
    network."""
    get = data.get
    lines = [
        f"node      {data['peer_id']}  {data['address']}  pid {_fmt(get('pid'))}"
        + ("" if get("reachable", True) else "  client mode (dials out; nobody dials it)")
        + ("" if get("running", True) else "  (stopped)"),
        f"training  {data['task']} / {data['algorithm']}  step {_fmt(data['step'])}"
        f"  {_fmt(get('steps_per_s'), '.2f')} steps/s  loss {_loss_cell(data)}"
        + _metric_cell(data),
        f"traffic   in {format_bytes(get('bytes_in'))}  out {format_bytes(get('bytes_out'))}"
        + sync_note(data)
        + f"  exchanges ok {_fmt(get('exchanges_ok'))}{exchange_time_note(data)}"
        f" failed {_fmt(get('exchanges_failed'))}"
        f"  rejected updates {_fmt(get('rejected_updates'))}  up {_fmt(get('elapsed_s'), '.0f')}s",
        *_algorithm_line(data),
        *_certificate_line(data.get("certificate_expires_at")),
        *_privacy_line(data),
        *_not_dialled_line(data),
        *_refused_line(data),
        *_process_line(data),
        *_stale_line(data, age_s),
        "",
        f"{'peer':<14}{'state':<9}{'address':<28}{'rtt ms':>8}{'Mbit/s':>9}  {'codec':<16}"
        f"{'ok':>5}{'failed':>7}",
    ]
    peers = data.get("peers")
    for p in peers if isinstance(peers, list | tuple) else []:
        if not isinstance(p, dict):
            continue
        lines.append(
            f"{_fmt(p.get('peer')):<14}{_fmt(p.get('state')):<9}{_address_cell(p):<28}"
            f"{_fmt(p.get('rtt_ms'), '.1f'):>8}{_fmt(p.get('goodput_mbit'), '.1f'):>9}  "
            f"{_fmt(p.get('codec')):<16}{_fmt(p.get('exchanges_ok')):>5}"
            f"{_fmt(p.get('exchanges_failed')):>7}"
        )
    if not data.get("peers"):
        lines.append("(no peers known yet)")
    # (a node's own strings, read over the network too: no terminal control sequences)
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in "\n".join(lines))
