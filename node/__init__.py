"""The geotrain node: config, identity, secure transport, algorithms, training, state, CLI.

    async with open_node(load_config(Path("node.toml"))) as node:
        await node.wait_stopped()            # or do other work; leaving the block stops it

Names that need torch (the node, tasks, algorithms) load on first use, so that importing the
transport or the config stays cheap (the testbed imports this package and never torch).
"""

from importlib import import_module

from ._cadence import EvalCadence as EvalCadence
from ._config import GOSSIP_PRESETS as GOSSIP_PRESETS
from ._config import ConfigError as ConfigError
from ._config import GossipConfig as GossipConfig
from ._config import IdentityConfig as IdentityConfig
from ._config import LimitsConfig as LimitsConfig
from ._config import MetricsConfig as MetricsConfig
from ._config import NetworkConfig as NetworkConfig
from ._config import NodeConfig as NodeConfig
from ._config import PrivacyConfig as PrivacyConfig
from ._config import StateConfig as StateConfig
from ._config import TrainingConfig as TrainingConfig
from ._config import config_from_toml as config_from_toml
from ._config import config_to_toml as config_to_toml
from ._config import load_config as load_config
from ._config import override_value as override_value
from ._credentials import load_identity as load_identity
from ._forkserver import ForkServer as ForkServer
from ._launch import ManagedProcess as ManagedProcess
from ._launch import NodeProcess as NodeProcess
from ._launch import node_argv as node_argv
from .identity import Admission as Admission
from .identity import AdmissionRefused as AdmissionRefused
from .identity import Identity as Identity
from .identity import KeyFileError as KeyFileError
from .identity import MembershipCertificate as MembershipCertificate
from .identity import SwarmAuthority as SwarmAuthority
from .identity import SwarmInfo as SwarmInfo
from .state import StateDirInUse as StateDirInUse
from .transport import HandshakeError as HandshakeError
from .transport import LocalTransportError as LocalTransportError
from .transport import PeerUnreachable as PeerUnreachable
from .transport import RemoteTransportError as RemoteTransportError
from .transport import RequestTimeout as RequestTimeout
from .transport import TransportError as TransportError

# name -> module (relative to this package) for the names that import torch
_LAZY = {
    "Node": "._node",
    "join": "._library",
    "Swarm": "._library",
    "SwarmOptimizer": "._library",
    "Diverged": ".training",
    "LoopClosed": ".training",
    "MisuseWarning": "._library",
    "ModelMismatch": "._state_sync",
    "open_node": "._open_node",
    "ResumeError": "._checkpointer",
    "MemoryBudgetError": "._memory",
    "Task": ".training",
    "TaskContext": ".training",
    "TaskError": ".training",
    "Trainer": ".training",
    "endless_batches": ".training",
    "shard_indices": ".training",
    "resolve_task": ".training",
    "Algorithm": ".algorithms",
    "AlgorithmContext": ".algorithms",
    "AlgorithmSpec": ".algorithms",
    "register_algorithm": ".algorithms",
    "algorithm_specs": ".algorithms",
    "CheckpointError": ".state",
    "NodeStatus": ".state",
}
_LAZY_NAMES = tuple(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
