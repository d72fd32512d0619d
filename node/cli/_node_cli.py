# `geotrain node run` and `geotrain status`. Invariants: a bad config, key or certificate is
# reported in one line naming what is wrong and exits 2 before anything starts; SIGINT/SIGTERM ask
# the node to stop cleanly, a second one cancels at once.
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import structlog
import trio

from .._checkpointer import ResumeError
from .._config import ConfigError, NodeConfig, load_config
from .._credentials import load_identity
from .._node import Node
from .._protocol import StatusReply, StatusRequest, node_header_codec
from ..state import StateDir, parse_status, read_status, render_status
from ..transport import ErrorReply, TransportConfig, TransportError, open_transport

log = structlog.get_logger()


def load_node(config: NodeConfig) -> Node:
    return Node(config, *load_identity(config))


async def _run(node: Node) -> None:
    async with trio.open_nursery() as nursery:

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    if node_stopping.is_set():
                        log.warning("stop_forced", signal=signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return
                    log.info("stop_requested", signal=signal.Signals(signum).name)
                    node_stopping.set()
                    node.request_stop()

        node_stopping = trio.Event()
        nursery.start_soon(watch_signals)
        await node.run()
        nursery.cancel_scope.cancel()


def node_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.set or ())
        node = load_node(config)
    except ConfigError as exc:
        print(f"geotrain node run: {exc}", file=sys.stderr)
        return 2
    refused: list[BaseException] = []
    try:
        trio.run(_run, node)
    except* (ResumeError, ValueError) as group:  # raised inside the nursery: grouped by trio
        refused = _leaves(group)
    for exc in refused:
        print(f"geotrain node run: {exc}", file=sys.stderr)
    return 2 if refused else 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


async def fetch_status(address: str, config: NodeConfig, deadline_s: float) -> dict:
    """Ask the node at `address` for its status, as the node `config` describes (its identity and
    admission: the node asked must admit it).

    Raises:
        ConfigError: the identity or admission files are wrong.
        ValueError: no answer, or an answer that is not a status.
    """
    identity, admission = load_identity(config)

    async def refuse(peer, header, payload):
        return ErrorReply(code="bad_request", reason="a status client serves nothing"), b""

    async with open_transport(
        TransportConfig(listen="tcp://127.0.0.1:0"),
        identity,
        admission,
        refuse,
        codec=node_header_codec(),
    ) as transport:
        try:
            reply, payload, _ = await transport.request(
                address, StatusRequest(), deadline_s=deadline_s
            )
        except TransportError as exc:
            failure = exc  # raised below, outside the transport's nursery (no exception group)
        else:
            failure = None
    if failure is not None:
        raise ValueError(f"{address}: {failure}")
    if not isinstance(reply, StatusReply):
        raise ValueError(f"{address}: answered {type(reply).__name__}, not a status")
    return parse_status(bytes(payload), address)


def status(args: argparse.Namespace) -> int:
    try:
        if args.node.startswith("tcp://"):
            if args.config is None:
                raise ValueError(
                    f"--node {args.node}: asking a node over the network needs --config "
                    "(an identity the node admits)"
                )
            config = load_config(args.config)
            data = trio.run(fetch_status, args.node, config, args.timeout)
        else:
            path = Path(args.node)
            data = read_status(StateDir(path).status if path.is_dir() else path)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"geotrain status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=1) if args.json else render_status(data))
    return 0


def register_node(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run a node daemon")
    node_sub = node.add_subparsers(title="node commands", metavar="COMMAND", required=True)
    run = node_sub.add_parser("run", help="join a swarm and train (see README: Node daemon)")
    run.add_argument("--config", type=Path, required=True, help="the node's TOML config")
    run.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value"
    )
    run.set_defaults(handler=node_run)


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
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    p.set_defaults(handler=status)
