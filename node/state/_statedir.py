# The one owner of a node's state-directory layout. Invariant: every path a node reads or writes
# under its state directory is named here, nowhere else.
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StateDir:
    """Paths inside a node's state directory.

    Layout:
        checkpoints/ckpt-<step>.safetensors   model, optimizer, error feedback, link estimates
        metrics.jsonl                         one JSON object per line, appended while running
        status.json                           the latest status snapshot, replaced atomically
        node.json                             who is running here: peer ID, address, pid
    """

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def node_info(self) -> Path:
        return self.root / "node.json"

    def create(self) -> StateDir:
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        return self
