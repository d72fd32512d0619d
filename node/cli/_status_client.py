# Where `geotrain status` gets a node's status document: a state directory (or a status.json)
# on this machine, or a running node asked over the network as an identity it admits.
# Invariants: every failure to get a status is a ValueError whose message names the source and
# says what went wrong (ConfigError, a ValueError, for a bad client identity); a network ask never
# waits past its deadline; a status client serves nothing and stops its transport when it exits.
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._config import ConfigError, NodeConfig, load_config
from .._credentials import load_identity
from .._protocol import StatusReply, StatusRequest, node_header_codec
from ..state import StateDir, parse_status, read_status
from ..transport import ErrorReply, TransportConfig, TransportError, open_transport

AskStatus = Callable[[str, float], Awaitable[dict[str, Any]]]  # (address, deadline_s) -> status


@dataclass(frozen=True)
class StatusFile:
    """A status read from disk: `--node` names a state directory or a status.json file."""

    path: Path

    @classmethod
    def of(cls, path: Path) -> StatusFile:
        """`--node` as given: a state directory or status file, or a node's folder (what
        `geotrain node init` made) or its config file, whose state directory is read.

        Raises:
            ValueError: that config file is not a valid node config.
        """
        folder = path.is_dir() and not StateDir(path).status.exists()
        config = path / "node.toml" if folder else path
        if config.suffix != ".toml" or not config.is_file():
            return cls(path)
        try:
            return cls(Path(load_config(config).state.dir))
        except ConfigError as exc:
            raise ValueError(f"--node {str(path)!r}: read as a node config: {exc}") from None

    @property
    def state_dir(self) -> StateDir | None:
        """The state directory, when `path` is one (its metrics.jsonl holds the history)."""
        return StateDir(self.path) if self.path.is_dir() else None

    def read(self) -> tuple[dict[str, Any], float]:
        """The status and how many seconds ago the node wrote it.

        Raises:
            ValueError: no status file there (yet), or not a geotrain status.
        """
        state = self.state_dir
        file = state.status if state is not None else self.path
        data = read_status(file)
        try:
            age_s = max(0.0, time.time() - file.stat().st_mtime)
        except OSError:  # replaced between the read and the stat: it is fresh
            age_s = 0.0
        if (data.get("running") and state is not None and state.lock_path.exists()
                and not state.locked()):  # fmt: skip
            data = {**data, "running": False}  # its node ended without saying so (a crash)
        return data, age_s


@asynccontextmanager
async def open_status_client(config: NodeConfig) -> AsyncIterator[AskStatus]:
    """A client that asks nodes for their status, as the identity `config` names (the node asked
    must admit it). One transport serves every ask, so a watch handshakes once per connection,
    not once per refresh.

    Yields:
        `ask(address, deadline_s)`, returning the node's status document.

    Raises:
        ConfigError: the identity or admission files are wrong (raised on entry).
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

        async def ask(address: str, deadline_s: float) -> dict[str, Any]:
            try:
                reply, payload, _ = await transport.request(
                    address, StatusRequest(), deadline_s=deadline_s
                )
            except TransportError as exc:
                said = str(exc)  # (most name the address already)
                raise ValueError(said if address in said else f"{address}: {said}") from None
            if not isinstance(reply, StatusReply):
                raise ValueError(f"{address}: answered {type(reply).__name__}, not a status")
            return parse_status(bytes(payload), address)

        yield ask


async def fetch_status(address: str, config: NodeConfig, deadline_s: float) -> dict[str, Any]:
    """Ask the node at `address` for its status, as the node `config` describes (its identity and
    admission: the node asked must admit it).

    Raises:
        ConfigError: the identity or admission files are wrong.
        ValueError: no answer, or an answer that is not a status.
    """
    failure: ValueError | None = None
    async with open_status_client(config) as ask:
        try:
            return await ask(address, deadline_s)
        except ValueError as exc:
            failure = exc  # raised below, outside the transport's nursery (no exception group)
    assert failure is not None
    raise failure
