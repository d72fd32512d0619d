# The checks a node makes before it starts, as functions of what they read: the config, the
# certificate, the state directory's paths, `now`. Each returns the warnings it finds (the node
# logs them) or raises ConfigError where the node must not start; none of them logs or touches
# a running node, so each is tested on its own.
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geotrain import compress

from ._certificate_watch import renew_hint, utc
from ._config import (
    ConfigError,
    GossipConfig,
    NetworkConfig,
    NodeConfig,
    TrainingConfig,
    preset_overrides,
)
from .algorithms import MODEL_CODECS
from .identity import MembershipCertificate
from .training import TaskContext, UnknownTaskParam

# [training] settings a loop of the user's own reads; every other one is the daemon trainer's
LOOP_READS_TRAINING = ("wait_for_peers", "wait_for_peers_s", "eval_every", "eval_every_s",
                       "seed", "max_nonfinite_steps")  # fmt: skip
# ... and those left alone though unread: documented as unused (task, params), or written by
# `node init --shard` into the node.toml a library node shares (shard_index, num_shards)
LOOP_IGNORES_TRAINING = ("task", "params", "shard_index", "num_shards")


@dataclass(frozen=True)
class StartupWarning:
    """One thing a check found: a log event, its fields, and its level ("warning" or "info")."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    level: str = "warning"

    def log(self, logger: Any) -> None:
        getattr(logger, self.level)(self.event, **self.fields)


def config_warnings(
    config: NodeConfig, *, averages_models: bool, own_loop: bool
) -> list[StartupWarning]:
    """What the config asks for that will not happen as written (each check below, in order).

    Args:
        config: the node's configuration.
        averages_models: the configured algorithm mixes whole models (AlgorithmSpec).
        own_loop: the node trains a loop of the user's own (geotrain.join), not a task.
    """
    return [
        *unused_gossip_settings(config.gossip),
        *(loop_unused_training(config.training) if own_loop else []),
        *preset_overridden(config.gossip),
        *codec_drops_model_values(config.gossip, averages_models),
    ]


def unused_gossip_settings(gossip: GossipConfig) -> list[StartupWarning]:
    """A [gossip.<algorithm>] table of another algorithm than the one configured is kept (one
    may switch back) but said: a typo'd algorithm name or a forgotten line leaves it unused."""
    unused = sorted(set(gossip.algorithm_settings) - {gossip.algorithm})
    if not unused:
        return []
    return [StartupWarning("gossip_settings_unused", {
        "tables": [f"gossip.{n}" for n in unused], "algorithm": gossip.algorithm,
        "hint": f"gossip.algorithm is {gossip.algorithm!r}: these tables do nothing"})]  # fmt: skip


def loop_unused_training(training: TrainingConfig) -> list[StartupWarning]:
    """[training] settings that only the daemon's trainer reads, set (not at their defaults)
    for a loop of the user's own: precision = "bf16", accumulate or lr there would do nothing
    under geotrain.join (the task and its params are documented as unused: a node.toml shared
    with daemons has them)."""
    defaults = TrainingConfig()
    unused = [f.name for f in dataclasses.fields(training)
              if f.name not in LOOP_READS_TRAINING + LOOP_IGNORES_TRAINING
              and getattr(training, f.name) != getattr(defaults, f.name)]  # fmt: skip
    if not unused:
        return []
    return [StartupWarning("training_settings_unused", {
        "settings": [f"training.{f}" for f in unused],
        "hint": "your own loop does these itself (optimizer, schedule, autocast, clipping, "
        "accumulation, device); geotrain.join reads only "
        f"{', '.join(LOOP_READS_TRAINING)} from [training]"})]  # fmt: skip


def preset_overridden(gossip: GossipConfig) -> list[StartupWarning]:
    """A gossip preset whose settings the [gossip] table sets otherwise: `geotrain node init`
    writes `algorithm = "adpsgd"`, so adding `preset = "frugal"` to that file runs adpsgd with
    the preset's codec. Another algorithm is a warning (hardly the preset at all); another
    setting is information (a choice)."""
    overridden = preset_overrides(gossip)
    if not overridden:
        return []
    return [StartupWarning("gossip_preset_overridden", {
        "preset": gossip.preset,
        "overridden": {k: f"{mine!r} (preset: {theirs!r})"
                       for k, (mine, theirs) in overridden.items()},
        "hint": "the [gossip] table or --set gives these, and those win; remove them to take "
        "the preset's"}, "warning" if "algorithm" in overridden else "info")]  # fmt: skip


def codec_drops_model_values(gossip: GossipConfig, averages_models: bool) -> list[StartupWarning]:
    """A fixed codec that does not carry every value (top-k, random-k, sign, PowerSGD), for an
    algorithm that averages whole models, is taken but said: sparse codecs average only the
    values they carry and sign flattens them, and both cost accuracy where int8 and int4 (what
    `auto` chooses among for these algorithms) did not (docs/benchmarks.md)."""
    if gossip.codec == "auto" or not averages_models:
        return []
    codec = compress.get_codec(gossip.codec)
    if codec.name in MODEL_CODECS:
        return []
    what = ("averages only the values it sends, which leaves models further apart"
            if codec.sparse else "flattens every value")  # fmt: skip
    return [StartupWarning("codec_drops_model_values", {
        "codec": gossip.codec, "algorithm": gossip.algorithm,
        "hint": f"{gossip.algorithm} averages whole models and this codec {what}: it cost "
        "accuracy where int8 did not; prefer 'auto', int8 or int4 (or choco or diloco, which "
        "send differences)"})]  # fmt: skip


def state_dir_moved(root: Path, checkpoints: Path, cwd: Path) -> list[StartupWarning]:
    """The default state.dir is the config file's folder's `state`, not the working
    directory's. A node that would start afresh in `root` while `cwd`/state holds checkpoints
    says so: it was likely started from that folder, with state.dir relative to it.

    Args:
        root, checkpoints: the node's state.dir and its checkpoints folder.
        cwd: the working directory.
    """
    other = cwd / "state"
    # (a state.dir of another name was chosen: it never followed the working directory)
    if root.name != "state" or root.resolve() == other.resolve() or any(
            checkpoints.glob("ckpt-*")):  # fmt: skip
        return []
    if not ((other / "checkpoints").is_dir() and any((other / "checkpoints").glob("ckpt-*"))):
        return []
    return [StartupWarning("state_dir_moved", {
        "state_dir": str(root), "found": str(other),
        "hint": "checkpoints lie in ./state of the working directory, not in state.dir (the "
        "default is relative to the config file): set "
        f"state.dir = {str(other)!r} to resume from them"})]  # fmt: skip


def bootstrap_peers(
    network: NetworkConfig, address: str | None
) -> tuple[list[str], list[StartupWarning]]:
    """network.bootstrap without this node's own address (listen, advertise or `address`): a
    config copied to every machine, the first one's included, names it, and a node that
    dialled itself would wait for a state sync nobody can answer.

    Returns:
        The addresses to dial, and a warning where some were this node's own.
    """
    own = {a for a in (network.listen, network.advertise, address) if a}
    port = network.listen.rpartition(":")[2]
    host = network.listen.removeprefix("tcp://").rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", "*"):  # listening everywhere: loopback reaches it too
        own |= {f"tcp://127.0.0.1:{port}", f"tcp://localhost:{port}", f"tcp://[::1]:{port}"}
    mine = [a for a in network.bootstrap if a in own]
    others = [a for a in network.bootstrap if a not in own]
    if not mine:
        return others, []
    return others, [StartupWarning("bootstrap_is_self", {
        "addresses": mine,
        "detail": "network.bootstrap names this node's own address: skipped" + (
            "; with no other bootstrap this node starts a swarm of its own"
            if not others else "")})]  # fmt: skip


def check_certificate(
    certificate: MembershipCertificate | None, peer_id: str, path: Path | None, now: float
) -> None:
    """Refuse to start on an expired membership certificate (peers would refuse the node).

    Raises:
        ConfigError: it expired at or before `now` (wall-clock seconds); the message says how
            to renew it.
    """
    if certificate is not None and certificate.expires_at <= now:
        raise ConfigError(
            f"identity.certificate = {str(path)!r}: expired at {utc(certificate.expires_at)}; "
            + renew_hint(peer_id, path, running=False)
        )


def unasked_task_params(task: str, ctx: TaskContext) -> list[StartupWarning]:
    """[training.params] keys the task never asked for (after it was built with `ctx`).

    Raises:
        ConfigError: an unasked key for a built-in task (a typo); a plugin's is a warning.
    """
    try:
        unasked = ctx.check_unasked(task)
    except UnknownTaskParam as exc:
        raise ConfigError(f"training.params.{exc.key}: {exc}") from None
    if not unasked:
        return []
    return [StartupWarning("task_params_unused",
                           {"task": task, "unused": unasked, "asked": sorted(ctx.asked)})]
