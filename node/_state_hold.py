# A running node's hold on its state directory: created, locked (one node per directory), left
# temp files of a killed node removed, node.json written. Invariants: a node refused at start
# leaves no state directory it created; every OSError here reaches the operator as one
# ConfigError naming state.dir.
from __future__ import annotations

import json
import os
from typing import BinaryIO

import structlog

from ._config import ConfigError
from .state import StateDir, write_atomically

log = structlog.get_logger()


class StateDirHold:
    """Holds `state` for one node, from `take()` to `release()` (or `give_up()`)."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self._lock: BinaryIO | None = None  # held while the node runs on the directory
        self._made = False  # take() created the directory

    def take(self) -> None:
        """Create the directory and hold it.

        Raises:
            StateDirInUse: another node holds it. ConfigError: it cannot be created or written.
        """
        self._made = not self.state.root.exists()
        try:
            self.state.create()
            if self._lock is None:
                self._lock = self.state.lock()
                self.state.create()  # (a node refused at start that held it removed it)
                if self._lock is not None:  # (no flock: another node may be writing)
                    count, size = self.state.remove_left_temp_files()
                    if count:
                        log.info("left_temp_files_removed", count=count, mb=round(size / 1e6, 1),
                                 reason="an earlier node here was killed while it wrote them")
        except OSError as exc:  # read-only, a file in the way, no permission, no space
            raise self.error(exc) from None

    def give_up(self) -> None:
        """The node was refused at start: remove the directory if take() made it, and let go."""
        if self._made and self._lock is not None:
            self.state.remove_unused()
        self.release()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def write_node_info(self, peer_id: str, address: str | None) -> None:
        """node.json: who runs here (`geotrain status` reads it).

        Raises:
            ConfigError: it cannot be written (a full disk at start: one line, not a traceback).
        """
        info = {"peer_id": peer_id, "address": address, "pid": os.getpid()}
        try:
            write_atomically(self.state.node_info, json.dumps(info).encode())
        except OSError as exc:
            raise self.error(exc) from None

    def error(self, exc: OSError) -> ConfigError:
        """`exc` as the error the node stops with."""
        return ConfigError(f"state.dir = {str(self.state.root)!r}: cannot keep the node's "
                           f"state there: {exc.strerror or exc}")  # fmt: skip
