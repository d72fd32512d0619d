# Logging setup for the whole process. Invariant: configured once, by the CLI before any command
# runs, or by geotrain.join in a program that has not configured structlog itself; library code
# otherwise only calls structlog.get_logger() and never configures anything.
from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Literal, TextIO

import structlog

LogFormat = Literal["auto", "console", "json"]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS: tuple[LogFormat, ...] = ("auto", "console", "json")


class _LineLogger(structlog.PrintLogger):
    """structlog's PrintLogger, but a line that cannot be written is dropped: after a hangup a
    terminal fails every write (EIO), and a node's log line then failed the node itself on its
    way out (no checkpoint, no leave); a full disk under a redirected log did the same."""

    def msg(self, message: str) -> None:
        with contextlib.suppress(OSError):
            super().msg(message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def configure_logging(
    level: str | None,
    fmt: LogFormat,
    stream: TextIO | None = None,
    quiet: frozenset[str] = frozenset(),
) -> str:
    """Configure structlog for this process.

    Args:
        level: one of LOG_LEVELS; None: info (`--log-level` not given to a command that has no
            default of its own).
        fmt: "console" (human readable), "json" (one JSON object per line) or "auto" (console when
            `stream` is a terminal, JSON lines otherwise).
        stream: where log lines go; standard error by default, so that standard output stays free
            for a command's own result.

        quiet: events not logged at any level (a command whose result already says them).

    Returns:
        The format actually chosen ("console" or "json").

    Raises:
        ValueError: unknown level or format.
    """
    level = "info" if level is None else level
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    out = stream if stream is not None else sys.stderr
    chosen = fmt
    if fmt == "auto":
        chosen = "console" if out.isatty() else "json"
    renderer: structlog.types.Processor
    if chosen == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    def drop_quiet(_logger: object, _method: str, event: structlog.types.EventDict):
        if event.get("event") in quiet:
            raise structlog.DropEvent
        return event

    structlog.configure(
        processors=[
            drop_quiet,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=lambda *_: _LineLogger(out),
        cache_logger_on_first_use=False,
    )
    return chosen


def warnings_as_log_lines() -> None:
    """Python warnings (a library's: Opacus' multi-line UserWarnings) become `python_warning`
    log lines, so that a JSON log stays one JSON object per line. For the CLI's own process
    only: a program of the user's keeps its own warnings."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        structlog.get_logger().warning("python_warning", category=category.__name__,
                                       message=str(message).strip(),
                                       where=f"{filename}:{lineno}")  # fmt: skip

    warnings.showwarning = show
