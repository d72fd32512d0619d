# `geotrain node run` and `geotrain status`. Invariants: a bad config, key or certificate is
# reported in one line naming what is wrong and exits 2 before anything starts (status: 1);
# SIGINT/SIGTERM ask the node to stop cleanly, a second one cancels at once. `status --watch`
# lives in _status_watch (it alone imports rich), its sources in _status_client.
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from .._config import ConfigError, NodeConfig, load_config
from .._credentials import load_identity
from ..state import render_status
from ._node_init import register_node_init
from ._status_client import StatusFile
from ._status_client import fetch_status as fetch_status

if TYPE_CHECKING:  # the node (torch) loads only for `node run`: `status` and `keygen` stay quick
    from .._node import Node

log = structlog.get_logger()

WATCH_INTERVAL_S = 2.0  # often enough to follow training, rare enough to cost a node nothing


def load_node(config: NodeConfig) -> Node:
    from .._node import Node

    return Node(config, *load_identity(config))


async def _run(node: Node, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
               ttys: tuple[int, ...] = ()) -> None:  # fmt: skip
    """Run the node until it stops; `signals` stop it (see stop_on_signals)."""
    from .._signals import stop_on_signals

    async with trio.open_nursery() as nursery:
        run_scope = trio.CancelScope()
        nursery.start_soon(stop_on_signals, node, signals, ttys, run_scope)
        with run_scope:
            await node.run()
        nursery.cancel_scope.cancel()


def node_run(args: argparse.Namespace) -> int:
    from .._checkpointer import ResumeError
    from .._open_node import leaf_errors
    from .._signals import ignore_signals, restore_signals, stop_signals, terminals
    from ..training import Diverged

    try:
        config = load_config(args.config, args.set or ())
        node = load_node(config)
    except ConfigError as exc:
        print(f"geotrain node run: {exc}", file=sys.stderr)
        return 2
    refused: list[BaseException] = []
    failed: list[BaseException] = []
    diverged: list[BaseException] = []
    # ignored outside _run's own signal receiver (see ignore_signals); restored below for a
    # caller in-process; the console script ignores them again for the interpreter's exit
    signals, ttys = stop_signals(), terminals()
    previous = ignore_signals(signals)
    try:
        trio.run(_run, node, signals, ttys)
    except* Diverged as group:  # the model's fault, not ours: said without a traceback
        diverged = leaf_errors(group)
    except* (ResumeError, ValueError) as group:  # raised inside the nursery: grouped by trio
        refused = leaf_errors(group)  # (a task plugin's TaskError is one: it names task and part)
    except* Exception as group:  # a bug: one log event with the traceback, one line here
        failed = leaf_errors(group)
    finally:
        restore_signals(previous)
    for exc in refused:
        print(f"geotrain node run: {exc}", file=sys.stderr)
    for exc in diverged:
        log.error("node_diverged", error=str(exc))
        print(f"geotrain node run: stopped: {exc}", file=sys.stderr)
    for exc in failed:
        log.error("node_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        print(f"geotrain node run: failed: {type(exc).__name__}: {exc} (the log above has the "
              "traceback)", file=sys.stderr)  # fmt: skip
    if not (failed or diverged or refused) and node.final_checkpoint_failed:
        print("geotrain node run: stopped without its final checkpoint (checkpoint_failed "
              "above): a restart resumes from the newest one on disk", file=sys.stderr)
        return 1
    return 1 if failed or diverged else 2 if refused else 0


def status(args: argparse.Namespace) -> int:
    if args.watch and args.json:
        print("geotrain status: --watch shows a view, --json prints one document; choose one",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.interval is not None and not args.watch:
        print("geotrain status: --interval is the refresh of --watch", file=sys.stderr)
        return 2
    if getattr(args, "max_age", None) is not None and args.watch:
        print("geotrain status: --max-age is a one-shot probe; --watch keeps showing",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        config = None
        if args.node.startswith("tcp://"):
            if args.config is None:
                raise ValueError(
                    f"--node {args.node}: asking a node over the network needs --config "
                    "(an identity the node admits)"
                )
            config = load_config(args.config)
        if args.watch:
            from ._status_watch import run_watch  # rich is imported only by the watch

            return run_watch(args.node, args.interval or WATCH_INTERVAL_S, config, args.timeout)
        age_s = None  # (asked over the network: fresh)
        if config is not None:
            data = trio.run(fetch_status, args.node, config, args.timeout)
        else:
            data, age_s = StatusFile.of(Path(args.node)).read()
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"geotrain status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=1) if args.json else render_status(data, age_s))
    stale = _stale_for_probe(data, age_s, getattr(args, "max_age", None))
    if stale:
        print(f"geotrain status: {stale}", file=sys.stderr)
        return STALE_EXIT
    return 0


STALE_EXIT = 3  # `status --max-age`: the node is stale or stopped (a health probe's failure)


def _stale_for_probe(data: dict, age_s: float | None, max_age_s: float | None) -> str:
    """Why a health probe (`--max-age S`) fails: a status file older than S seconds (the node
    stopped writing it: hung, paused, dead), or a node that says it stopped; "" when healthy or
    not asked. A status asked over the network is fresh: the node answered."""
    if max_age_s is None:
        return ""
    if not data.get("running", True):
        return "--max-age: the node is not running (its status says it stopped)"
    if age_s is not None and age_s > max_age_s:
        return (f"--max-age {max_age_s:g}: the status was written {age_s:.0f} s ago: the "
                "node is stale (hung, paused or gone)")
    return ""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return value


def register_node(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run a node daemon")
    node_sub = node.add_subparsers(title="node commands", metavar="COMMAND", required=True)
    run = node_sub.add_parser("run", help="join a swarm and train")
    run.add_argument("--config", type=Path, required=True, help="the node's TOML config")
    run.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value"
    )
    run.set_defaults(handler=node_run)
    register_node_init(node_sub)


def register_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a node's training, traffic and peers")
    p.add_argument(
        "--node",
        default="state",
        help="the node's state directory (default: ./state), or its address tcp://HOST:PORT",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="with a tcp:// address: a node config whose identity the node admits",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        help="seconds to wait for an answer (with --watch: at each refresh)",
    )
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.add_argument(
        "--max-age",
        type=_seconds,
        metavar="S",
        help=f"a health probe: exit {STALE_EXIT} when the status file is older than S seconds "
        "or the node says it stopped (a container's liveness probe; pick S above a few of "
        "state.status_every_s)",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="keep showing the status, refreshed in place (one snapshot per interval when "
        "stdout is not a terminal); problems are shown and retried; Ctrl-C quits",
    )
    p.add_argument(
        "--interval",
        type=_seconds,
        metavar="S",
        help=f"with --watch: seconds between refreshes (default {WATCH_INTERVAL_S:g})",
    )
    # (its own transport's start and handshakes are no news to someone reading a status, and a
    # failed handshake is the error it prints)
    p.set_defaults(handler=status, log_level_default="warning",
                   log_quiet_default=frozenset({"handshake_failed"}))  # fmt: skip
