# Node configuration. Invariants: one frozen dataclass per component, each validated in
# __post_init__; a bad value raises ConfigError naming the field (section.key), the value and what
# was expected, before anything starts; relative paths are resolved against the config's folder;
# each algorithm's own table ([gossip.<name>]) is the dataclass its module registers.
from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLICIES = ("uniform", "ring", "exponential", "bandwidth")
ROBUST_RULES = ("none", "clip", "trim")  # gossip.robust (gossip/_robust.py has the same tuple)
PARTITIONS = ("iid", "dirichlet")
# [gossip] preset = NAME: named settings under the [gossip] table (what the table itself sets
# wins, key by key, [gossip.<algorithm>] tables included)
GOSSIP_PRESETS: dict[str, dict[str, Any]] = {
    # the fewest bytes measured to a given quality on WAN links (docs/benchmarks.md):
    # local SGD with long rounds; each round's update sparsified to its largest 1% (int8 values,
    # error feedback keeps the rest for later rounds) and sent to one partner; failure detection
    # every 5 s instead of 2 (its pings are a visible share of the bytes at these volumes)
    "frugal": {
        "algorithm": "diloco",
        "codec": "topk:0.01+int8",
        "probe_interval_s": 5.0,
        "diloco": {"inner_steps": 50, "fanout": 1},
    },
}


class ConfigError(ValueError):
    """A config value is wrong; the message names the field, the value and what was expected."""


def _fail(name: str, value: Any, expected: str) -> typing.NoReturn:
    raise ConfigError(f"{name} = {value!r}: expected {expected}")


def check_field(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise ConfigError naming `name`, `value` and what was `expected` unless `ok`."""
    if not ok:
        _fail(name, value, expected)


_check = check_field


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(obj: Any, section: str) -> None:
    """Check each field of a config dataclass against its type, as a TOML file's are: a config
    built in Python (a constructor, dataclasses.replace) reached the checks below with a str
    for a path (AttributeError far away), a str for a number (TypeError) or a str for a list
    (taken letter by letter). A str path becomes a Path and a list a tuple, in place."""
    hints = _field_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        fixed = _python_value(f"{section}.{f.name}" if section else f.name, value,
                              hints[f.name])  # fmt: skip
        if fixed is not value:
            object.__setattr__(obj, f.name, fixed)


def _python_value(name: str, value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        if value == "" and type(None) in args:  # (as a TOML file's "" is: unset)
            return None
        if isinstance(value, str) and str in args:  # (seconds or "auto": checked by its class)
            return value
        inner = next((a for a in args if a not in (type(None), str)), str)
        return _python_value(name, value, inner)
    if hint is Path:
        _check(isinstance(value, os.PathLike | str) and str(value) != "", name, value, "a path")
        return value if type(value) is type(Path()) else Path(value).expanduser()
    if origin is tuple:
        _check(isinstance(value, tuple | list) and all(isinstance(v, str) for v in value), name,
               value, "a list of strings")  # fmt: skip
        return value if isinstance(value, tuple) else tuple(value)
    if origin is dict:
        _check(isinstance(value, dict), name, value, "a table")
        return value
    if hint is float:  # (numpy's numbers too: made Python's)
        _check(isinstance(value, numbers.Real) and not isinstance(value, bool), name, value,
               "a number")  # fmt: skip
        # inf and nan are TOML numbers, but no setting means them: lr = inf ran to a NaN loss,
        # and a timer of inf failed far from the setting that made it
        _check(math.isfinite(value), name, value, "a finite number")
        return value if type(value) in (int, float) else float(value)
    if hint is int:
        _check(isinstance(value, numbers.Integral) and not isinstance(value, bool), name, value,
               "an integer")  # fmt: skip
        return value if type(value) is int else int(value)
    if hint is bool:
        _check(isinstance(value, bool), name, value, "true or false")
        return value
    if hint is str:
        _check(isinstance(value, str), name, value, "a string")
        return value
    if isinstance(hint, type):  # a section of NodeConfig
        _check(isinstance(value, hint), name, type(value).__name__, f"a {hint.__name__}")
    return value


@dataclass(frozen=True)
class IdentityConfig:
    """Who this node is and who it lets in.

    key: this node's Ed25519 identity key file (`geotrain keygen`).
    certificate: this node's membership certificate (`geotrain swarm admit`), shown to peers.
    swarm: the swarm's public file (swarm ID + authority key) that peers' certificates must match.
    allow: instead of a swarm authority, an explicit list of admitted peer IDs.
    open_swarm: admit anyone. Only for experiments on a closed network; never the default.
    swarm_id: the swarm's name with `allow` or `open_swarm` (a swarm file carries its own); nodes
        of different swarm IDs cannot complete a handshake.
    """

    key: Path = Path("identity.key")
    certificate: Path | None = None
    swarm: Path | None = None
    allow: tuple[str, ...] = ()
    open_swarm: bool = False
    swarm_id: str = "geotrain"

    def __post_init__(self) -> None:
        check_types(self, "identity")
        modes = sum([self.swarm is not None, bool(self.allow), self.open_swarm])
        _check(
            modes == 1,
            "identity.swarm / identity.allow / identity.open_swarm",
            f"{modes} set",
            "exactly one way to admit peers: a swarm file, an allow-list, or open_swarm = true",
        )
        from .identity import public_key_from_peer_id  # noqa: PLC0415 (identity imports config)

        for peer in self.allow:  # (a typo'd ID taken would refuse that peer, unexplained)
            try:
                public_key_from_peer_id(peer)
            except ValueError:
                _fail("identity.allow", peer, "peer IDs as `geotrain keygen` prints them "
                      "('gt' and 52 base32 characters)")  # fmt: skip
        if self.swarm is not None:
            _check(
                self.certificate is not None,
                "identity.certificate",
                None,
                "a certificate file when identity.swarm is set (peers refuse a node without one)",
            )


_UNSPECIFIED_HOSTS = {"0.0.0.0", "::", "*", ""}


def _check_address(name: str, addr: Any, *, dialled: bool) -> None:
    """tcp://HOST:PORT with a port in 0..65535 (1..65535 and a host one can dial for an address
    peers dial: advertise, bootstrap)."""
    expected = ("an address peers can dial, like tcp://HOST:PORT" if dialled
                else "an address like tcp://HOST:PORT")  # fmt: skip
    from geotrain.gossip import tcp_host_port

    _check(isinstance(addr, str) and addr.startswith("tcp://"), name, addr, expected)
    parsed = tcp_host_port(addr)
    if parsed and dialled and parsed[0].strip("[]") in _UNSPECIFIED_HOSTS - {""}:
        _fail(name, addr, f"{expected}: {parsed[0]} is where a node listens (every interface), "
              "not an address anyone can dial; give this machine's address or name")  # fmt: skip
    ok = parsed is not None and (parsed[1] > 0 or not dialled)
    _check(ok, name, addr, expected + (" (port 1..65535)" if dialled else " (port 0..65535)"))


@dataclass(frozen=True)
class NetworkConfig:
    """Where this node listens and whom it first contacts.

    listen: the address to bind, e.g. "tcp://0.0.0.0:7000" (port 0 picks a free one).
    advertise: the address peers should dial; defaults to `listen` (fine on loopback).
    bootstrap: addresses of peers already in the swarm; empty for the first node.
    max_message_mb: the largest message accepted from a peer; bigger ones are refused unread. It
        bounds one message, not the model: models travel in chunks.
    chunk_mb: a model travels as chunks of this many MiB of float32 (8: big enough that a round
        trip carries plenty, small enough to pipeline encode, send, decode and mix); below
        max_message_mb.
    peer_chunk_mb: the largest chunk a peer's stream may use with us (None: our own chunk_mb).
        What we hold for a peer's stream grows with its chunks, and the memory estimate counts
        this size, so a peer cannot make us hold more than we planned for; a peer whose chunks
        are larger is refused with the reason. Raise it (up to max_message_mb - 1) only where
        the swarm's nodes use different chunk_mb.
    handshake_timeout_s: a peer that has not finished the handshake by then is dropped.
    max_pending_handshakes: inbound connections that may be mid-handshake at once; one more
        drops the oldest (counted as `too_many_pending`). Each may hold one frame of ~4.3 MB
        before its handshake ends, so 64 bound that to ~270 MB. A node dialled by hundreds of
        peers at once (a large swarm's restart) may need more; a small box, fewer.
    connections_per_peer: the most TCP connections (each with its own session) this node dials
        to one peer; a further one opens only while every open one is busy, so a model stream
        on a long fat link spreads over several (one TCP connection may not fill it) and a ping
        uses one. 1..64.
    reachable: false for a machine that nobody can dial (behind NAT or a firewall that drops
        inbound connections): the node runs in client mode. It dials the bootstrap peers and keeps
        those connections, starts every exchange and state sync itself, announces an address that
        nobody dials, and is never chosen as a partner by others. `listen` must then stay on
        loopback (only the local `geotrain status` talks to it), `advertise` unset and
        `bootstrap` non-empty (a swarm needs reachable peers to start from).
    """

    listen: str = "tcp://127.0.0.1:0"
    advertise: str | None = None
    bootstrap: tuple[str, ...] = ()
    max_message_mb: int = 256
    chunk_mb: float = 8.0
    peer_chunk_mb: float | None = None
    handshake_timeout_s: float = 10.0
    max_pending_handshakes: int = 64
    connections_per_peer: int = 4
    reachable: bool = True

    @property
    def chunk_numel(self) -> int:
        """Elements (float32) in one chunk of the streams this node starts."""
        return max(1, int(self.chunk_mb * 2**20) // 4)

    @property
    def max_chunk_numel(self) -> int:
        """The most elements a peer may put in one chunk: peer_chunk_mb (by default our own
        chunk_mb), which fits in one message (1 MiB is left for the chunk's slice headers)."""
        mb = self.chunk_mb if self.peer_chunk_mb is None else self.peer_chunk_mb
        return max(1, int(mb * 2**20) // 4)

    def __post_init__(self) -> None:
        check_types(self, "network")
        if self.advertise is not None:  # first: `node init` makes listen's port from it
            _check_address("network.advertise", self.advertise, dialled=True)
        for addr in self.bootstrap:
            _check_address("network.bootstrap", addr, dialled=True)
        _check_address("network.listen", self.listen, dialled=False)
        _check(
            0 < self.max_message_mb <= 4096,
            "network.max_message_mb",
            self.max_message_mb,
            "1..4096",
        )
        _check(
            0 < self.chunk_mb <= self.max_message_mb - 1,
            "network.chunk_mb",
            self.chunk_mb,
            f"> 0 and at most network.max_message_mb - 1 ({self.max_message_mb - 1})",
        )
        if self.peer_chunk_mb is not None:
            _check(
                self.chunk_mb <= self.peer_chunk_mb <= self.max_message_mb - 1,
                "network.peer_chunk_mb",
                self.peer_chunk_mb,
                f"at least network.chunk_mb ({self.chunk_mb:g}) and at most "
                f"network.max_message_mb - 1 ({self.max_message_mb - 1})",
            )
        _check(
            0 < self.handshake_timeout_s <= 600,
            "network.handshake_timeout_s",
            self.handshake_timeout_s,
            "> 0 and <= 600 seconds (it bounds what a stranger's unfinished handshake holds)",
        )
        _check(
            0 < self.max_pending_handshakes <= 4096,
            "network.max_pending_handshakes",
            self.max_pending_handshakes,
            "1..4096 (each may hold a ~4.3 MB frame before its handshake ends)",
        )
        _check(1 <= self.connections_per_peer <= 64, "network.connections_per_peer",
               self.connections_per_peer, "1..64")  # fmt: skip
        _check(isinstance(self.reachable, bool), "network.reachable", self.reachable,
               "true or false")  # fmt: skip
        if not self.reachable:
            self._check_client()

    def _check_client(self) -> None:
        """A client (reachable = false) listens on loopback only and advertises nothing."""
        why = "with network.reachable = false"
        host = self.listen[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        _check(host in ("127.0.0.1", "localhost", "::1"), "network.listen", self.listen,
               f"a loopback address like tcp://127.0.0.1:0 {why} (nobody can dial this node)")
        _check(self.advertise is None, "network.advertise", self.advertise,
               f"unset {why}: a client announces no address")
        _check(bool(self.bootstrap), "network.bootstrap", list(self.bootstrap),
               f"at least one reachable peer {why}: a client can only dial out")  # fmt: skip


@dataclass(frozen=True)
class TrainingConfig:
    """What and how this node trains.

    task: a built-in task ("digits-mlp", "charlm", "gpt", "synthetic-linreg", "wide-linear") or
        "module:function".
    params: task-specific settings (the [training.params] table).
    device: "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N".
    optimizer / lr: "sgd", "adam" or "adamw" and its rate; unset takes the task's (its recipe).
    seed: the swarm-wide seed (same model initialisation and evaluation set everywhere).
    shard_index / num_shards: which part of the training data this node holds.
    partition / alpha: "iid" shards, or "dirichlet" label skew with concentration alpha.
    max_steps: stop after this many local steps (0: run until stopped).
    wait_for_peers / wait_for_peers_s: before the first step, wait until this many other peers
        showed up (alive, or came and left), at most wait_for_peers_s seconds, so a swarm starts
        training together.
    eval_every: evaluate the held-out metric every this many steps.
    eval_every_s: also evaluate once this many seconds have passed since the last evaluation
        (or the first step), whichever comes first; for slow steps, where a step count is
        minutes. 0: by steps only.
    slowdown: emulate a slower machine (the testbed's stragglers); 1.0 is full speed.
    step_time_ms: compute emulation: every step is padded to this many milliseconds (times
        slowdown), so a run measures the network and the algorithm, not how shared cores were
        scheduled; steps whose compute alone took longer are counted (status
        steps_over_step_time). 0: off.
    threads: torch CPU threads (0 leaves torch's default).
    precision: "fp32", or "bf16": forward pass and loss under autocast in bfloat16 (on GPUs
        that have it, and on CPUs); weights, gradients and what travels stay float32 or the
        codec's. "auto" (the default): bf16 on a CUDA device that has it, fp32 elsewhere.
    weight_decay: L2 (sgd, adam) or decoupled (adamw) weight decay.
    warmup_steps / schedule / total_steps / min_lr_ratio: the learning rate rises linearly over
        warmup_steps, then stays ("constant") or decays to lr x min_lr_ratio at total_steps
        ("cosine", "linear").
    clip_grad_norm: scale each step's gradients down to at most this total L2 norm (0: none).
        Each of optimizer, weight_decay, the schedule's four and clip_grad_norm, left unset, takes
        the task's recipe (most tasks: SGD with momentum, 0, constant, no clipping; `gpt`: AdamW,
        warmup and cosine, clipping at 1); a value set here always wins.
    accumulate: batches whose gradients are averaged into one optimizer step (a bigger batch than
        fits in memory at once).
    max_nonfinite_steps: this many steps in a row with a NaN or infinite loss stop training
        (the daemon exits with status 1; a loop of the user's own gets `geotrain.Diverged` from
        its optimizer's step()). 0: train on. Whatever it is, a model with a non-finite value is
        never checkpointed, so a restart resumes from the newest good checkpoint.
    """

    task: str = "digits-mlp"
    params: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    optimizer: str | None = None
    lr: float | None = None
    seed: int = 0
    shard_index: int = 0
    num_shards: int = 1
    partition: str = "iid"
    alpha: float = 0.5
    max_steps: int = 0
    wait_for_peers: int = 0
    wait_for_peers_s: float = 300.0
    eval_every: int = 50
    eval_every_s: float = 0.0
    slowdown: float = 1.0
    step_time_ms: float = 0.0
    threads: int = 0
    precision: str = "auto"  # bf16 on CUDA: tensor cores; fp32 on a CPU, which gains little
    weight_decay: float | None = None  # None: the task's recipe (for every setting below too)
    warmup_steps: int | None = None
    schedule: str | None = None
    total_steps: int | None = None
    min_lr_ratio: float | None = None
    clip_grad_norm: float | None = None
    accumulate: int = 1
    max_nonfinite_steps: int = 100

    def __post_init__(self) -> None:
        check_types(self, "training")
        _check(
            self.optimizer in (None, "sgd", "adam", "adamw"),
            "training.optimizer",
            self.optimizer,
            "sgd, adam or adamw",
        )
        cuda, colon, index = self.device.partition(":")
        _check(self.device in ("auto", "cpu", "cuda") or (cuda == "cuda" and colon
               and index.isdigit()), "training.device", self.device,
               "auto, cpu, cuda or cuda:N")  # fmt: skip
        # unset (None) takes the task's recipe, checked when the trainer merges them
        wd, warmup, total = self.weight_decay, self.warmup_steps, self.total_steps
        _check(wd is None or 0 <= wd <= 1e6, "training.weight_decay", wd, "0..1e6")
        _check(warmup is None or warmup >= 0, "training.warmup_steps", warmup, ">= 0")
        _check(self.schedule in (None, "constant", "cosine", "linear"), "training.schedule",
               self.schedule, "constant, cosine or linear")  # fmt: skip
        _check(total is None or total >= 0, "training.total_steps", total, ">= 0")
        decaying = f"> training.warmup_steps ({warmup or 0}) for a decaying schedule"
        _check(self.schedule in (None, "constant") or total is None or total > (warmup or 0),
               "training.total_steps", total, decaying)  # fmt: skip
        ratio, clip = self.min_lr_ratio, self.clip_grad_norm
        _check(ratio is None or 0 <= ratio <= 1, "training.min_lr_ratio", ratio, "0..1")
        _check(clip is None or clip >= 0, "training.clip_grad_norm", clip, ">= 0 (0: no clipping)")
        # (upper bounds: 1e39 overflowed float32 at the first step; an accumulate of 10^8 made
        # a step no signal could end)
        _check(1 <= self.accumulate <= 100_000, "training.accumulate", self.accumulate,
               "1..100000 batches per step")  # fmt: skip
        _check(self.lr is None or 0 < self.lr <= 1e6, "training.lr", self.lr, "> 0 and <= 1e6")
        _check(self.max_nonfinite_steps >= 0, "training.max_nonfinite_steps",
               self.max_nonfinite_steps, ">= 0 steps (0: never stop)")  # fmt: skip
        _check(self.num_shards >= 1, "training.num_shards", self.num_shards, ">= 1")
        _check(
            0 <= self.shard_index < self.num_shards,
            "training.shard_index",
            self.shard_index,
            f"0..{self.num_shards - 1} (training.num_shards = {self.num_shards})",
        )
        _check(
            self.partition in PARTITIONS,
            "training.partition",
            self.partition,
            " or ".join(PARTITIONS),
        )
        _check(self.alpha > 0, "training.alpha", self.alpha, "> 0")
        _check(self.max_steps >= 0, "training.max_steps", self.max_steps, ">= 0")
        _check(self.wait_for_peers >= 0, "training.wait_for_peers", self.wait_for_peers, ">= 0")
        _check(self.wait_for_peers_s > 0, "training.wait_for_peers_s", self.wait_for_peers_s,
               "> 0 seconds")
        _check(self.eval_every >= 1, "training.eval_every", self.eval_every, ">= 1")
        _check(0 <= self.eval_every_s <= 86_400, "training.eval_every_s", self.eval_every_s,
               "seconds, 0..86400 (0: by steps only)")  # fmt: skip
        _check(1.0 <= self.slowdown <= 10_000, "training.slowdown", self.slowdown, "1.0..10000")
        _check(0 <= self.step_time_ms <= 3_600_000, "training.step_time_ms", self.step_time_ms,
               "milliseconds, 0..3600000 (an hour)")  # fmt: skip
        _check(self.threads >= 0, "training.threads", self.threads, ">= 0")
        _check(self.precision in ("auto", "fp32", "bf16"), "training.precision", self.precision,
               "auto, fp32 or bf16")  # fmt: skip
        for key, value in self.params.items():
            _check(
                isinstance(value, int | float | str | bool),
                f"training.params.{key}",
                value,
                "a number, string or boolean",
            )


@dataclass(frozen=True)
class GossipConfig:
    """How this node averages with the swarm.

    algorithm: what the swarm runs (every node of a swarm must run the same one); see
        node/algorithms/ and docs/explanation/algorithms.md:
        "adpsgd" (default): asynchronous pairwise model averaging. Assumes nothing about peers'
            speed; trades a slower agreement (one partner at a time) for never waiting.
        "dpsgd": synchronous rounds of exchange_every steps with up to [gossip.dpsgd] degree
            neighbours; a neighbour that misses the round's deadline is left out.
        "choco": CHOCO-SGD, pairwise gossip of compressed differences against public estimates,
            made for sparse or coarse codecs (e.g. codec = "topk:0.01").
        "diloco": local SGD: [gossip.diloco] inner_steps local steps, then the compressed
            pseudo-gradient is gossip-averaged and applied by an outer Nesterov step.
        "selsync": a pairwise exchange (as adpsgd) only when the model moved more than
            [gossip.selsync] threshold since the last one.
    exchange_every: local steps between two exchanges this node starts (adpsgd, choco); the
        length of a dpsgd round; how often selsync checks its threshold. With comm_fraction,
        the fewest steps between two.
    comm_fraction: 0 (default): exchanges every exchange_every steps. Above 0 (adpsgd, choco,
        selsync): the exchanges a node starts take at most about this share of its computing
        time, measured: after an exchange of T seconds the next one waits T / (comm_fraction x
        seconds per step) steps, from exchange_every up to max_exchange_every; a slower link
        or a faster step spaces them out, and back. (diloco has its own [gossip.diloco]
        comm_fraction for its rounds; dpsgd's rounds stay fixed.)
    max_exchange_every: the most steps between two exchanges under comm_fraction.
    probe_interval_s: failure-detection period (SWIM); 2 s suits WAN links, less suits a LAN.
    policy: partner choice: "bandwidth" (measured links), "uniform", "ring" or "exponential".
    codec: "auto" picks per link from its measured bandwidth; or a fixed compress/ spec.
    max_norm_ratio: refuse a peer's model whose norm exceeds this multiple of ours (+1).
    clip: bound the L2 distance a single exchange may move us (clipped gossip); unset = no bound.
        With `robust`, it caps the adaptive radius.
    robust: how a neighbour's model is mixed when the swarm is not fully trusted (see
        gossip/_robust.py for the rules and what they assume): "none" (default: plain averaging,
        as before), "clip" (self-centred clipping, ClippedGossip: every neighbour's difference
        x_j - x_i is clipped to an adaptive radius tau, half the lower quartile of recent distances;
        adpsgd, selsync, choco's exchanges, dpsgd and diloco's outer exchange) or "trim"
        (dpsgd: coordinate-wise trimmed mean of a round with at least 3 neighbours, clipping in
        smaller rounds and in the other algorithms).
    state_sync: a node with no checkpoint first fetches the current model from a peer.
    preset: "" or a name of GOSSIP_PRESETS ("frugal"): its settings fill in what the [gossip]
        table (and its algorithm tables) leave unset.
    algorithm_settings: each algorithm's own table by name ([gossip.dpsgd], [gossip.choco], ...);
        `settings` is the chosen algorithm's (its defaults when the table is absent).
    """

    algorithm: str = "adpsgd"
    exchange_every: int = 4
    comm_fraction: float = 0.0
    max_exchange_every: int = 1000
    probe_interval_s: float = 2.0
    policy: str = "bandwidth"
    codec: str = "auto"
    max_norm_ratio: float = 10.0
    clip: float | None = None
    robust: str = "none"
    state_sync: bool = True
    preset: str = ""
    algorithm_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self, "gossip")
        from .algorithms import algorithm_specs  # the registry imports this module

        specs = algorithm_specs()
        _check(self.algorithm in specs, "gossip.algorithm", self.algorithm,
               " or ".join(sorted(specs)))  # fmt: skip
        _check(self.exchange_every >= 1, "gossip.exchange_every", self.exchange_every, ">= 1")
        _check(isinstance(self.comm_fraction, int | float) and 0 <= self.comm_fraction < 1,
               "gossip.comm_fraction", self.comm_fraction,
               "0 (a fixed cadence) or a fraction in (0, 1)")  # fmt: skip
        _check(self.max_exchange_every >= self.exchange_every, "gossip.max_exchange_every",
               self.max_exchange_every, f">= exchange_every ({self.exchange_every})")  # fmt: skip
        _check(self.probe_interval_s >= 0.05, "gossip.probe_interval_s", self.probe_interval_s,
               ">= 0.05 seconds")
        _check(self.policy in POLICIES, "gossip.policy", self.policy, " or ".join(POLICIES))
        _check(self.max_norm_ratio > 1, "gossip.max_norm_ratio", self.max_norm_ratio, "> 1")
        _check(self.clip is None or self.clip > 0, "gossip.clip", self.clip, "> 0")
        _check(self.robust in ROBUST_RULES, "gossip.robust", self.robust,
               " or ".join(repr(r) for r in ROBUST_RULES))  # fmt: skip
        self._check_codec()
        for name, settings in self.algorithm_settings.items():
            spec = specs.get(name)
            _check(spec is not None and spec.settings is not None, f"gossip.{name}", settings,
                   f"a table of an algorithm with settings: {_with_settings(specs)}")
            _check(isinstance(settings, spec.settings), f"gossip.{name}", settings,  # type: ignore
                   f"a {spec.settings.__name__}")  # type: ignore[union-attr]

    def _check_codec(self) -> None:
        if self.codec == "auto":
            return
        from geotrain import compress

        try:
            codec = compress.get_codec(self.codec)
        except ValueError as exc:
            _fail("gossip.codec", self.codec, f"'auto' or a codec spec ({exc})")
        # a codec whose error can exceed what it compresses (unbiased, not a contraction):
        # with error feedback on whole models (adpsgd, dpsgd, selsync) or pseudo-gradients
        # (diloco) the models diverged; choco, which compresses differences to its estimates,
        # is left to them
        if not codec.contractive and self.algorithm != "choco":
            _fail("gossip.codec", self.codec,
                  f"a codec {self.algorithm} can average with: {codec.spec} is unbiased but adds "
                  "noise as large as what it compresses, and the models diverged (digits, two "
                  "nodes: adpsgd with qsgd:levels=4 ended at loss 5e5, diloco with randk:0.1 at "
                  "1e6); use int8, int4, sign, topk:F[+int8], randk:F,unscaled, or "
                  "'auto'")  # fmt: skip

    @property
    def settings(self) -> Any:
        """The chosen algorithm's settings: its [gossip.<algorithm>] table, or its defaults."""
        from .algorithms import get_algorithm

        given = self.algorithm_settings.get(self.algorithm)
        return given if given is not None else get_algorithm(self.algorithm).default_settings()


def _with_settings(specs) -> str:
    return ", ".join(name for name, spec in specs.items() if spec.settings is not None)


# Settings that moved into their algorithm's table (geotrain < 0.2 had them flat in [gossip]).
MOVED_GOSSIP_KEYS = {
    "dpsgd_degree": "dpsgd.degree",
    "round_slack": "dpsgd.round_slack",
    "choco_gamma": "choco.gamma",
    "choco_max_peers": "choco.max_peers",
    "diloco_inner_steps": "diloco.inner_steps",
    "diloco_outer_lr": "diloco.outer_lr",
    "diloco_outer_momentum": "diloco.outer_momentum",
    "diloco_fanout": "diloco.fanout",
    "diloco_max_staleness": "diloco.max_staleness",
    "selsync_threshold": "selsync.threshold",
}


@dataclass(frozen=True)
class StateConfig:
    """Where this node keeps its state.

    dir: the state directory (checkpoints, metrics.jsonl, status.json).
    checkpoint_every: write a checkpoint every this many steps (and always on shutdown).
    keep: how many checkpoints to keep.
    status_every_s: how often status.json and a metrics line are written.
    metrics_max_mb: metrics.jsonl past this size becomes metrics.jsonl.1 (one kept: at most
        twice this on disk; ~1 KB a line, ~90 MB a day at status_every_s = 1); 0: no
        metrics.jsonl at all (status.json and the Prometheus endpoint still say the figures).
    """

    dir: Path = Path("state")
    checkpoint_every: int = 200
    keep: int = 3
    status_every_s: float = 1.0
    metrics_max_mb: float = 64.0

    def __post_init__(self) -> None:
        check_types(self, "state")
        _check(self.checkpoint_every >= 1, "state.checkpoint_every", self.checkpoint_every, ">= 1")
        _check(self.keep >= 1, "state.keep", self.keep, ">= 1")
        _check(self.status_every_s > 0, "state.status_every_s", self.status_every_s, "> 0")
        _check(self.metrics_max_mb >= 0, "state.metrics_max_mb", self.metrics_max_mb, ">= 0")


@dataclass(frozen=True)
class LimitsConfig:
    """What this node may use of its machine.

    memory_gb: the most memory the node may need, estimated at start from the model's size: the
        plain training loop (weights, gradients, optimizer state), what the algorithm keeps (see
        docs/explanation/memory.md) and the runtime. A config that cannot fit is refused before
        anything starts, with the figures. Unset: no limit (the estimate is still logged).
    """

    memory_gb: float | None = None

    def __post_init__(self) -> None:
        check_types(self, "limits")
        _check(self.memory_gb is None or self.memory_gb > 0, "limits.memory_gb", self.memory_gb,
               "> 0 (GB)")  # fmt: skip


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics of this node.

    listen: HOST:PORT to serve them on over HTTP (e.g. "127.0.0.1:9400"; port 0 picks one), or
        unset: no endpoint. A port in use stops the node at start with a clear error.
    """

    listen: str | None = None

    def __post_init__(self) -> None:
        check_types(self, "metrics")
        if self.listen is None:
            return
        host, sep, port = self.listen.rpartition(":")
        _check(bool(sep and host and port.isdigit() and int(port) <= 65535), "metrics.listen",
               self.listen, "HOST:PORT, e.g. 127.0.0.1:9400")  # fmt: skip


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy of this node's training data: Opacus' per-sample gradient clipping
    and Gaussian noise, and its accountant (`pip install 'geotrain[privacy]'`).

    epsilon: the budget; unset (the default): no privacy. Once spent, the node stops training on
        its data and keeps mixing (its steps become mixing-only), and says so.
    delta: the budget's delta (well below 1 / the number of training examples).
    max_grad_norm: each sample's gradient is clipped to this L2 norm.
    noise_multiplier: the noise's std over max_grad_norm; unset: the one that spends exactly
        epsilon in training.max_steps steps (which must then be set).
    accountant: "rdp" (Renyi DP) or "prv" (privacy random variables, tighter, slower).
    sample_rate: batch size / training examples of the shard; unset: the task's own figures.
    """

    epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    sample_rate: float | None = None

    @property
    def enabled(self) -> bool:
        return self.epsilon is not None

    def __post_init__(self) -> None:
        check_types(self, "privacy")
        _check(self.epsilon is None or self.epsilon > 0, "privacy.epsilon", self.epsilon, "> 0")
        _check(0 < self.delta < 1, "privacy.delta", self.delta, "0 < delta < 1")
        _check(self.max_grad_norm > 0, "privacy.max_grad_norm", self.max_grad_norm, "> 0")
        _check(self.noise_multiplier is None or self.noise_multiplier > 0,
               "privacy.noise_multiplier", self.noise_multiplier, "> 0")  # fmt: skip
        _check(self.accountant in ("rdp", "prv"), "privacy.accountant", self.accountant,
               "rdp or prv")  # fmt: skip
        _check(self.sample_rate is None or 0 < self.sample_rate <= 1, "privacy.sample_rate",
               self.sample_rate, "0 < rate <= 1")  # fmt: skip


@dataclass(frozen=True)
class NodeConfig:
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    state: StateConfig = field(default_factory=StateConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        check_types(self, "")
        p, t = self.privacy, self.training
        if not p.enabled:
            return
        _check(p.noise_multiplier is not None or t.max_steps > 0, "privacy.noise_multiplier",
               None, "a value, or training.max_steps > 0 to spend the epsilon over")  # fmt: skip
        _check(t.accumulate == 1, "training.accumulate", t.accumulate, "1 with [privacy]")
        _check(not t.clip_grad_norm, "training.clip_grad_norm", t.clip_grad_norm,
               "unset with [privacy] (privacy.max_grad_norm clips every sample)")  # fmt: skip


def _coerce(name: str, value: Any, hint: Any, base: Path) -> Any:
    """Check one TOML value against a field's type hint and convert it (paths, tuples): what
    a TOML file means beyond a value built in Python (check_types) is a path relative to the
    config's folder, "" for unset, and a float written as an integer."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None or (value == "" and type(None) in args):
            return None
        if isinstance(value, str) and str in args:  # (e.g. seconds or "auto": the dataclass
            return value  # checks which words it takes)
        return _coerce(name, value, next((a for a in args if a not in (type(None), str)), str),
                       base)  # fmt: skip
    if hint is Path:
        _check(isinstance(value, str) and value != "", name, value, "a path")
        path = Path(value).expanduser()
        return path if path.is_absolute() else base / path
    value = _python_value(name, value, hint)
    return float(value) if hint is float else dict(value) if origin is dict else value


def _section(cls: type, table: Any, section: str, base: Path) -> Any:
    _check(isinstance(table, dict), section, table, "a table")
    if cls is GossipConfig:
        table = _algorithm_tables(table, base)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            shown = sorted(known - {"algorithm_settings"})  # (written as [gossip.<algorithm>])
            if cls is GossipConfig:
                shown.append("an algorithm's table ([gossip.dpsgd], ...)")
            _fail(f"{section}.{key}", table[key], f"one of the keys {shown}")
    values = {k: _coerce(f"{section}.{k}", v, hints[k], base) for k, v in table.items()}
    return cls(**values)


def _algorithm_tables(table: dict, base: Path) -> dict:
    """[gossip] with each algorithm's sub-table parsed into its settings dataclass."""
    from .algorithms import algorithm_specs

    specs = algorithm_specs()
    rest, settings = {}, {}
    for key, value in table.items():
        if key in MOVED_GOSSIP_KEYS:
            where = MOVED_GOSSIP_KEYS[key]
            name, field_name = where.split(".")
            _fail(f"gossip.{key}", value, f"it moved: write [gossip.{name}] {field_name} = ... "
                  f"(or --set gossip.{where}=...)")  # fmt: skip
        spec = specs.get(key)
        if spec is None:
            rest[key] = value
            continue
        _check(spec.settings is not None, f"gossip.{key}", value,
               f"nothing: {key} has no settings of its own (those that do: "
               f"{_with_settings(specs)})")  # fmt: skip
        settings[key] = _section(spec.settings, value, f"gossip.{key}", base)
    _check("algorithm_settings" not in rest, "gossip.algorithm_settings", "...",
           "per-algorithm tables such as [gossip.dpsgd]")  # fmt: skip
    return {**rest, "algorithm_settings": settings} if settings else rest


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override {item!r} (--set, or join's overrides): expected "
                          "section.key=value")
    return key.strip().split("."), override_value(raw)


def override_value(raw: str) -> Any:
    """An override's value as TOML (`0.1`, `true`, `["tcp://a:1"]`, `"x"`), or a bare word as
    the string it is (`uniform`)."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


Settings = typing.Mapping[str, typing.Mapping[str, Any]]  # {"gossip": {"algorithm": ...}, ...}


def config_from_toml(
    text: str, *, base: Path, overrides: typing.Sequence[str] = (), settings: Settings | None = None
) -> NodeConfig:
    """Build a NodeConfig from TOML text, then `settings`, then `section.key=value` overrides.

    Args:
        text: the TOML document.
        base: the folder relative paths are resolved against (the config file's).
        overrides: `--set` items; values are TOML (`lr=0.1`, `bootstrap=["tcp://a:1"]`) or a bare
            string.
        settings: section -> {key: value} with Python values (what `geotrain.join` takes as
            keyword arguments), set over the file's keys as overrides are; a Path is a path
            and an algorithm's table a dict (`{"diloco": {"inner_steps": 50}}` in "gossip").

    Raises:
        ConfigError: bad TOML, an unknown section or key, or a bad value.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config is not valid TOML: {exc}") from exc
    for section, values in (settings or {}).items():
        _set_section(doc, section, values)
    for item in overrides:
        path, value = _parse_override(item)
        table = doc
        for part in path[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {item!r}: {part} is not a table")
        table[path[-1]] = value
    _apply_preset(doc)
    sections = {f.name: f for f in dataclasses.fields(NodeConfig)}
    for name in doc:
        if name not in sections:
            _fail(name, doc[name], f"one of the sections {sorted(sections)}")
    privacy = doc.get("privacy")
    if isinstance(privacy, dict) and "epsilon" not in privacy:  # (off, said: not silently)
        given = ", ".join(sorted(privacy)) or "nothing"
        _fail("privacy.epsilon", None, f"a budget: the [privacy] table sets {given} but no "
              "epsilon, and without one privacy is off (leave the table out to train without "
              "it)")  # fmt: skip
    hints = typing.get_type_hints(NodeConfig)
    built = {name: _section(hints[name], doc[name], name, base) for name in doc}
    config = NodeConfig(**built)
    # the defaults' relative paths too are the config file's, not wherever the node was started
    # from (a node started from another folder began from scratch in a state/ of its own there)
    return dataclasses.replace(
        config,
        identity=_rebased(config.identity, "key", base),
        state=_rebased(config.state, "dir", base),
    )


def _set_section(doc: dict, section: str, values: Any) -> None:
    """Set `values` (a mapping of one section's keys, Python values) over doc[section]."""
    _check(isinstance(values, typing.Mapping), section, values, "a mapping of its keys, e.g. "
           "gossip={'algorithm': 'diloco'}")  # fmt: skip

    def plain(value: Any) -> Any:  # (as TOML would give it: paths as text, lists for tuples)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, tuple):
            return list(value)
        if isinstance(value, typing.Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        return value

    table = doc.setdefault(section, {})
    _check(isinstance(table, dict), section, table, "a table")
    for key, value in values.items():
        mine = table.get(key)
        if isinstance(mine, dict) and isinstance(value, typing.Mapping):  # [gossip.diloco]
            table[key] = {**mine, **plain(value)}
        else:
            table[key] = plain(value)


def _rebased(section: Any, field: str, base: Path) -> Any:
    path = getattr(section, field)
    if path.is_absolute():
        return section
    return dataclasses.replace(section, **{field: base / path})


def preset_overrides(gossip: GossipConfig) -> dict[str, tuple[Any, Any]]:
    """The preset's settings that the [gossip] table (or --set) set otherwise, which win:
    {"algorithm": (the value in force, the preset's), "diloco.inner_steps": (...), ...}."""
    out: dict[str, tuple[Any, Any]] = {}
    for key, wanted in GOSSIP_PRESETS.get(gossip.preset, {}).items():
        if isinstance(wanted, dict):
            table = gossip.algorithm_settings.get(key)
            for name, value in wanted.items():
                mine = getattr(table, name, value) if table is not None else value
                if mine != value:
                    out[f"{key}.{name}"] = (mine, value)
        elif getattr(gossip, key) != wanted:
            out[key] = (getattr(gossip, key), wanted)
    return out


def _apply_preset(doc: dict) -> None:
    """Fill [gossip] from its preset's settings, where the table leaves them unset."""
    gossip = doc.get("gossip")
    if not isinstance(gossip, dict) or "preset" not in gossip:
        return
    name = gossip["preset"]
    if name == "":
        return
    _check(isinstance(name, str) and name in GOSSIP_PRESETS, "gossip.preset", name,
           f"one of {sorted(GOSSIP_PRESETS)} (or \"\")")  # fmt: skip
    for key, value in GOSSIP_PRESETS[name].items():
        mine = gossip.get(key)
        if isinstance(value, dict) and isinstance(mine, dict):
            gossip[key] = {**value, **mine}
        elif key not in gossip:
            gossip[key] = dict(value) if isinstance(value, dict) else value


def config_to_toml(doc: typing.Mapping[str, typing.Mapping[str, Any]]) -> str:
    """TOML text of a config document: sections of scalars, lists and tables (e.g.
    [training.params], [gossip.dpsgd]); Path values are written as strings. The one writer of
    node configs (the testbed's peers, the test and benchmark launchers)."""

    def value(v: Any) -> str:
        if isinstance(v, Path):
            v = str(v)
        if isinstance(v, tuple):
            v = list(v)
        return json.dumps(v)  # JSON scalars, strings and lists are valid TOML

    lines: list[str] = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for key, sub in table.items():
            if isinstance(sub, dict):
                lines.append(f"[{section}.{key}]")
                lines += [f"{k} = {value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def load_config(
    path: Path, overrides: typing.Sequence[str] = (), settings: Settings | None = None
) -> NodeConfig:
    """Read a TOML config file (see config_from_toml)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})") from None  # fmt: skip
    try:
        return config_from_toml(text, base=path.resolve().parent, overrides=overrides,
                                settings=settings)
    except ConfigError as exc:
        if str(exc).startswith("config is not valid TOML"):  # which file, with its line
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: "
                              f"{exc.__cause__}") from exc.__cause__  # fmt: skip
        raise
