"""geotrain: decentralized, geo-distributed training of PyTorch models over slow links.

The public API; everything else (geotrain.node.*, geotrain.gossip._*, ...) is implementation.

    import geotrain

    def my_task(ctx: geotrain.TaskContext) -> geotrain.Task: ...      # what a node trains
    config = geotrain.load_config(Path("node.toml"))                 # NodeConfig, ConfigError
    async with geotrain.open_node(config) as node: ...               # a node in your program
    swarm = geotrain.join("node.toml", model)                        # or your own loop:
    opt = swarm.wrap(torch.optim.AdamW(model.parameters()))          # opt.step() joins in

Names load on first use, so `import geotrain.gossip` (say) pulls in neither torch nor the node.
"""

from importlib import import_module

# public name -> the package that defines it
_EXPORTS = {
    # what a node trains
    "Task": "geotrain.node",
    "TaskContext": "geotrain.node",
    "endless_batches": "geotrain.node",
    "shard_indices": "geotrain.node",
    # your own training loop in a swarm
    "join": "geotrain.node",
    "Swarm": "geotrain.node",
    "SwarmOptimizer": "geotrain.node",
    "Diverged": "geotrain.node",
    "LoopClosed": "geotrain.node",
    "MisuseWarning": "geotrain.node",
    # configuring and running a node
    "NodeConfig": "geotrain.node",
    "IdentityConfig": "geotrain.node",
    "NetworkConfig": "geotrain.node",
    "TrainingConfig": "geotrain.node",
    "GossipConfig": "geotrain.node",
    "StateConfig": "geotrain.node",
    "LimitsConfig": "geotrain.node",
    "load_config": "geotrain.node",
    "config_from_toml": "geotrain.node",
    "config_to_toml": "geotrain.node",
    "open_node": "geotrain.node",
    "Node": "geotrain.node",
    "NodeStatus": "geotrain.node",
    "Identity": "geotrain.node",
    "SwarmAuthority": "geotrain.node",
    # algorithms
    "Algorithm": "geotrain.node",
    "AlgorithmContext": "geotrain.node",
    "AlgorithmSpec": "geotrain.node",
    "register_algorithm": "geotrain.node",
    "algorithm_specs": "geotrain.node",
    # codecs
    "get_codec": "geotrain.compress",
    "codec_names": "geotrain.compress",
    "Codec": "geotrain.compress",
    "ErrorFeedback": "geotrain.compress",
    # errors a caller catches
    "ConfigError": "geotrain.node",
    "ResumeError": "geotrain.node",
    "ModelMismatch": "geotrain.node",
    "MemoryBudgetError": "geotrain.node",
    "CheckpointError": "geotrain.node",
    "StateDirInUse": "geotrain.node",
    "KeyFileError": "geotrain.node",
    "AdmissionRefused": "geotrain.node",
    "TransportError": "geotrain.node",
    "PeerUnreachable": "geotrain.node",
    "RequestTimeout": "geotrain.node",
    "HandshakeError": "geotrain.node",
    "RemoteTransportError": "geotrain.node",
    "LocalTransportError": "geotrain.node",
    "DecodeError": "geotrain.compress",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'geotrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _console() -> int:
    """The `geotrain` console script: the command line's own entry, imported from here so that
    a Ctrl-C while its modules import (about a second on a busy machine) exits 130 quietly (a
    KeyboardInterrupt traceback of import machinery, before)."""
    try:
        from geotrain.node.cli import console
    except KeyboardInterrupt:
        return 130
    return console()
