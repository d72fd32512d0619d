# `geotrain status --watch`: a node's status, read again every interval and shown in place (rich
# Live) on a terminal, or printed once per interval as plain text (no escape codes) when stdout
# is not one. Invariants: the watch only reads, it never writes to the node or its state
# directory; a failed read is shown in the view and retried at the next interval, never raised;
# each trend keeps at most TREND_SAMPLES samples, one per new step (loss) or new evaluation
# (metric); SIGINT/SIGTERM end the watch: exit status 0 when its last read succeeded, 1 (the
# last problem on stderr) when it failed. This is the one module that imports rich.
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import structlog
import trio
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .._config import NodeConfig
from ..state import exchange_time_note, format_bytes, format_number, sync_note
from ._status_client import StatusFile, open_status_client

TREND_SAMPLES = 40  # about a screen line's worth of history per series
SPARK_BARS = "▁▂▃▄▅▆▇█"
ASCII_BARS = "_.-=+*#@"  # for an output that cannot encode the block characters
HISTORY_TAIL_BYTES = 256 * 1024  # how much of metrics.jsonl's end seeds the trends (~400 lines)
PEER_STATE_STYLES = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}

# A status read: (status document, seconds since the node wrote it, when known). ValueError when
# there is none to be had (the message says why).
StatusRead = Callable[[], Awaitable[tuple[dict[str, Any], float | None]]]
StatusSource = Callable[[], AbstractAsyncContextManager[StatusRead]]  # opens the reads


def sparkline(values: Iterable[float | None], bars: str = SPARK_BARS) -> str:
    """One character per finite value, scaled between the series' minimum and maximum."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    if high == low:
        return bars[len(bars) // 2] * len(finite)
    top = len(bars) - 1
    return "".join(bars[round((v - low) / (high - low) * top)] for v in finite)


@dataclass
class Trend:
    """The last `samples` losses (one per new step) and metrics (one per new evaluation)."""

    samples: int = TREND_SAMPLES
    loss: deque[float] = field(init=False)
    metric: deque[float] = field(init=False)
    seeded: bool = False  # history from metrics.jsonl was tried (done at most once)
    _step: int | None = None
    _metric_step: int | None = None

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"Trend samples = {self.samples}: expected >= 1")
        self.loss = deque(maxlen=self.samples)
        self.metric = deque(maxlen=self.samples)

    def add(self, data: dict[str, Any]) -> None:
        """Take the loss and metric of one status, unless that step or evaluation was seen."""
        step, loss = data.get("step"), data.get("loss")
        if step != self._step and _finite(loss):
            self.loss.append(float(loss))
        self._step = step
        metric_step, metric = data.get("metric_step"), data.get("metric")
        if metric_step is not None and metric_step != self._metric_step and _finite(metric):
            self.metric.append(float(metric))
        self._metric_step = metric_step

    def seed(self, metrics_jsonl: Path) -> None:
        """Start from the end of a node's metrics.jsonl (missing or unreadable: start empty)."""
        self.seeded = True
        for record in _tail_records(metrics_jsonl, HISTORY_TAIL_BYTES):
            self.add(record)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _tail_records(path: Path, max_bytes: int) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().splitlines()
    except OSError:
        return []
    if size > max_bytes:
        lines = lines[1:]  # the first line was cut by the seek
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line being appended right now, or junk: history is best effort
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass
class WatchView:
    """What the watch knows: the last status read, the trends, and the last read's problem."""

    source: str  # what --node named
    interval_s: float
    trend: Trend = field(default_factory=Trend)
    bars: str = SPARK_BARS
    data: dict[str, Any] | None = None
    read_at: float | None = None  # wall-clock time of the last good read
    age_s: float | None = None  # how old that status was when read (state directory only)
    problem: str | None = None  # why the last read failed; None when it succeeded

    def update(self, data: dict[str, Any], age_s: float | None) -> None:
        self.data, self.age_s, self.read_at, self.problem = data, age_s, time.time(), None
        self.trend.add(data)

    def failed(self, problem: str) -> None:
        self.problem = problem


def render_view(view: WatchView) -> RenderableType:
    """The whole view: a header line, the problem (if any), the node's numbers and its peers."""
    header = Text.assemble(("geotrain status ", "bold"), view.source)
    if view.read_at is not None:
        header.append(f"  read {time.strftime('%H:%M:%S', time.localtime(view.read_at))}")
    if view.age_s is not None:
        header.append(f", written {_duration(view.age_s)} before")
    header.append(f"  (every {view.interval_s:g}s, Ctrl-C quits)", style="dim")
    parts: list[RenderableType] = [header]
    if view.problem is not None:
        shown = "waiting for a first status" if view.data is None else "showing the last one read"
        parts.append(Text(f"no status: {view.problem}", style="bold red"))
        parts.append(Text(f"retrying every {view.interval_s:g}s, {shown}", style="red"))
    if view.data is None:
        return Group(*parts)
    parts += [_numbers(view.data, view.trend, view.bars), _peers(view.data.get("peers", []))]
    return Group(*parts)


def _numbers(d: dict[str, Any], trend: Trend, bars: str) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    running = d.get("running", True)
    state = Text("running", "green") if running else Text("stopped", "yellow")
    table.add_row("node", Text.assemble(str(d["peer_id"]), "  ", state))
    table.add_row("address", f"{d['address']}  pid {d.get('pid', '-')}")
    if d.get("not_dialled"):
        table.add_row("reach", Text("no peer could dial this address: behind NAT or a firewall? "
                                    "set network.reachable = false", "yellow"))  # fmt: skip
    table.add_row("training", f"{d['task']} / {d['algorithm']}")
    busy = d.get("utilization")
    in_steps = f", {busy:.0%} of the time in steps" if isinstance(busy, int | float) else ""
    table.add_row("step", f"{d['step']}  ({_fmt(d.get('steps_per_s'), '.2f')} steps/s{in_steps})")
    bad = d.get("nonfinite_losses") or 0
    loss = f"NaN/inf ({bad} steps in a row)" if bad else _number(d.get("loss"))
    table.add_row("loss", _with_trend(loss, trend.loss, bars))
    metric = f"{_number(d.get('metric'))} (step {_fmt(d.get('metric_step'))})"
    table.add_row(str(d["metric_name"]), _with_trend(metric, trend.metric, bars))
    traffic = f"in {format_bytes(d.get('bytes_in'))}  out {format_bytes(d.get('bytes_out'))}"
    table.add_row("traffic", traffic + sync_note(d))
    table.add_row(
        "exchanges",
        f"ok {d.get('exchanges_ok', 0)}{exchange_time_note(d)}"
        f"  failed {d.get('exchanges_failed', 0)}"
        f"  rejected updates {d.get('rejected_updates', 0)}",
    )
    table.add_row(
        "memory",
        f"peak {_fmt(d.get('peak_rss_mb'), '.0f')} MB"
        f"  (estimated {_fmt(d.get('memory_estimate_mb'), '.0f')} MB)",
    )
    if isinstance(d.get("open_files"), int):
        table.add_row("open files", f"{d['open_files']} of {_fmt(d.get('open_files_limit'))}")
    table.add_row("uptime", _duration(d.get("elapsed_s")))
    if d.get("algorithm_stats"):
        table.add_row("algorithm", "  ".join(f"{k} {format_number(v)}"
                                             for k, v in d["algorithm_stats"].items()))  # fmt: skip
    return table


def _with_trend(value: str, series: deque[float], bars: str) -> Text:
    text = Text(value)
    if series:
        text.append("  ")
        text.append(sparkline(series, bars), style="cyan")
        text.append(f"  last {len(series)}: {min(series):.4g}..{max(series):.4g}", style="dim")
    return text


def _peers(peers: list[dict[str, Any]]) -> RenderableType:
    if not peers:
        return Text("(no peers known yet)", style="dim")
    table = Table(title=None, expand=False, header_style="bold")
    for name, justify in (("peer", "left"), ("state", "left"), ("address", "left"),
                          ("RTT ms", "right"), ("Mbit/s", "right"), ("codec", "left"),
                          ("ok", "right"), ("failed", "right")):  # fmt: skip
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for p in peers:
        table.add_row(
            str(p["peer"]),
            Text(str(p["state"]), style=PEER_STATE_STYLES.get(str(p["state"]), "")),
            str(p["address"]),
            _fmt(p.get("rtt_ms"), ".1f"),
            _fmt(p.get("goodput_mbit"), ".1f"),
            _fmt(p.get("codec")),
            str(p.get("exchanges_ok", 0)),
            str(p.get("exchanges_failed", 0)),
        )
    return table


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _number(value: float | None) -> str:
    """Four decimals, as `geotrain status` prints them, unless that would hide the value."""
    if value is None:
        return "-"
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.4e}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# -- the loop --------------------------------------------------------------------------------------


async def watch(read: StatusRead, view: WatchView, show: Callable[[RenderableType], None]) -> None:
    """Read, render and show once per `view.interval_s` (counted from each read's start) until
    cancelled. A read's ValueError is shown in the view, and the next interval reads again."""
    while True:
        started = trio.current_time()
        try:
            data, age_s = await read()
        except ValueError as exc:  # ConfigError included; the message says what and where
            view.failed(str(exc))
        else:
            view.update(data, age_s)
        show(render_view(view))
        await trio.sleep_until(started + view.interval_s)


def file_reader(status_file: StatusFile, trend: Trend) -> StatusRead:
    """Reads of a state directory; its metrics.jsonl seeds the trends at the first good read."""

    async def read() -> tuple[dict[str, Any], float | None]:
        data, age_s = status_file.read()
        state = status_file.state_dir
        if not trend.seeded and state is not None:
            trend.seed(state.metrics)
        return data, age_s

    return read


@asynccontextmanager
async def open_network_reader(
    address: str, config: NodeConfig, deadline_s: float
) -> AsyncIterator[StatusRead]:
    """Reads of a node over the network, through one status client for the whole watch.

    Raises:
        ConfigError: the client identity in `config` is wrong (on entry).
    """
    async with open_status_client(config) as ask:

        async def read() -> tuple[dict[str, Any], float | None]:
            return await ask(address, deadline_s), None

        yield read


@asynccontextmanager
async def _file_source(status_file: StatusFile, trend: Trend) -> AsyncIterator[StatusRead]:
    yield file_reader(status_file, trend)


@contextmanager
def _logs_through(stream: TextIO) -> Iterator[None]:
    """Send log lines to `stream` (Live's stderr proxy prints them above the view)."""
    before = structlog.get_config()["logger_factory"]
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=stream))
    try:
        yield
    finally:
        structlog.configure(logger_factory=before)


async def _run(source: StatusSource, view: WatchView, console: Console) -> bool:
    """The watch in trio until a signal (or a closed stdout). Returns whether stdout broke."""
    broken = False
    # The receiver opens first, so a Ctrl-C while the source opens waits for the loop below; the
    # source opens outside the nursery, so its ConfigError is not wrapped in an exception group.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with source() as read, trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            if console.is_terminal and not console.is_dumb_terminal:
                with Live(console=console, auto_refresh=False) as live:
                    with _logs_through(sys.stderr):  # Live's proxy while it runs
                        await watch(read, view, lambda r: live.update(r, refresh=True))
            else:

                def show(renderable: RenderableType) -> None:
                    nonlocal broken
                    try:
                        console.print(renderable)
                        console.print()
                        console.file.flush()
                    except (BrokenPipeError, SystemExit):  # `... | head`: the reader has gone
                        # (rich turns a broken pipe into SystemExit(1) after pointing stdout at
                        # os.devnull; flush() raises BrokenPipeError itself)
                        broken = True
                        nursery.cancel_scope.cancel()

                await watch(read, view, show)
    return broken


def run_watch(node: str, interval_s: float, config: NodeConfig | None, deadline_s: float) -> int:
    """`geotrain status --watch --node NODE`: watch a state directory (`config` None) or the node
    at a tcp:// address (asked as the identity `config` names, each read waiting at most
    `deadline_s`). The watch ends only when asked to (a signal, a closed stdout). Returns the
    exit status: 0 when its last read succeeded, 1 when it failed (said on stderr), so that
    `timeout 60 geotrain status --watch ...` in a script tells whether the node was there.

    Raises:
        ConfigError: the client identity in `config` is wrong, the one failure that retrying
            cannot mend (raised before the watch starts).
    """
    console = Console()
    bars = SPARK_BARS if console.encoding.startswith("utf") else ASCII_BARS
    view = WatchView(source=node, interval_s=interval_s, bars=bars)
    source: StatusSource
    if config is not None:
        source = partial(open_network_reader, node, config, deadline_s)
    else:
        source = partial(_file_source, StatusFile.of(Path(node)), view.trend)
    try:
        broken = trio.run(_run, source, view, console)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was open
        return 0
    if broken:  # keep Python's final flush of stdout from complaining about the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return _exit_status(view)


def _exit_status(view: WatchView) -> int:
    if view.problem is None:
        return 0
    seen = "never read a status" if view.data is None else "its last read failed"
    print(f"geotrain status: the watch of {view.source} {seen}: {view.problem}", file=sys.stderr)
    return 1
