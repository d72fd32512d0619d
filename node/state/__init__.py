"""What a node keeps on disk: the state directory's layout, checkpoints, status and metrics.

Checkpoint names need torch and load on first use; the rest is plain files.
"""

from importlib import import_module

from ._files import write_atomically as write_atomically
from ._statedir import StateDir as StateDir
from ._statedir import StateDirInUse as StateDirInUse
from ._status import METRICS_MAX_BYTES as METRICS_MAX_BYTES
from ._status import NodeStatus as NodeStatus
from ._status import PeerStatus as PeerStatus
from ._status import append_metrics as append_metrics
from ._status import exchange_time_note as exchange_time_note
from ._status import format_bytes as format_bytes
from ._status import format_number as format_number
from ._status import parse_status as parse_status
from ._status import read_status as read_status
from ._status import render_status as render_status
from ._status import sync_note as sync_note
from ._status import write_status as write_status

_CHECKPOINT_NAMES = (
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "OptimizerStateError",
    "adopt_optimizer_state",
    "check_optimizer_state",
    "optimizer_from_checkpoint",
    "optimizer_layout",
    "optimizer_to_checkpoint",
)


def __getattr__(name: str):
    if name in _CHECKPOINT_NAMES:
        return getattr(import_module("._checkpoint", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
