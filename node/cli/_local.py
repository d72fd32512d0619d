# `geotrain local -n N -- python train.py ARGS`: N peers of the user's own script on loopback, in
# an open swarm of their own (torchrun --nproc-per-node's spirit: a first try of a swarm on one
# machine, no keys, certificates or config files to write). Invariants: each peer has a folder of
# its own under --dir (key, node.toml, state dir, log.txt), kept between runs so that a second run
# resumes; the peers listen on 127.0.0.1 only; each runs in its own session with its output in its
# log, relayed here line by line with its index in front; the script's `geotrain.join(model)`
# finds its node config through `launched_config()`, the one reader of that variable (the
# environment is read in the CLI package only); SIGINT, SIGTERM or SIGHUP here is passed on to
# every peer as SIGINT (each swarm closes: checkpoint, leave), a peer still running after
# --grace-s is killed, a second signal kills them all at once; nothing outlives this command.
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

import structlog

from .._config import ConfigError, config_to_toml, load_config, override_value
from .._launch import ManagedProcess
from .._signals import DUPLICATE_SIGNAL_S
from ..identity import Identity

log = structlog.get_logger()

CONFIG_ENV = "GEOTRAIN_CONFIG"  # the node config of a peer `geotrain local` started
INDEX_ENV = "GEOTRAIN_LOCAL_INDEX"  # which peer this process is (0 .. N-1), as LOCAL_RANK
PEERS_ENV = "GEOTRAIN_LOCAL_PEERS"  # how many there are, as LOCAL_WORLD_SIZE
POLL_S = 0.1


def launched_config() -> Path | None:
    """The node config `geotrain local` wrote for this process ($GEOTRAIN_CONFIG), or None when
    it was not started by `geotrain local` (`geotrain.join(model)` with no config reads it)."""
    value = os.environ.get(CONFIG_ENV, "")
    return Path(value) if value else None


def register_local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "local",
        help="run N peers of your training script on this machine, in a swarm of their own",
        description="Start N copies of a training script that calls geotrain.join(model), as "
        "peers of an open swarm on 127.0.0.1 (each with its own key, state dir and log under "
        "--dir), and stop them all cleanly on Ctrl-C. Each peer finds its config through "
        f"${CONFIG_ENV}; ${INDEX_ENV} and ${PEERS_ENV} say which peer it is of how many.",
        epilog="example: geotrain local -n 3 -- python train.py --steps 1000",
    )
    p.add_argument("-n", "--peers", type=int, default=2, help="how many peers (default 2)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where each peer's folder goes; a second run resumes from it "
                   "(default ./geotrain-local/SCRIPT, SCRIPT the name of the command's .py "
                   "file: another script starts afresh)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting for every peer's node config, e.g. gossip.algorithm=diloco "
                   "(repeatable)")  # fmt: skip
    p.add_argument("--grace-s", type=float, default=120.0,
                   help="how long stopping peers get to close their swarms before they are "
                   "killed (default 120)")  # fmt: skip
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the script to run, after --: python train.py ARGS")
    p.set_defaults(handler=run_local)


def run_local(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("geotrain local: no command: geotrain local -n 3 -- python train.py",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.peers < 1:
        print(f"geotrain local: -n {args.peers}: expected at least 1 peer", file=sys.stderr)
        return 2
    folder = args.dir if args.dir is not None else Path("geotrain-local") / _run_name(command)
    try:
        configs = write_configs(folder.resolve(), args.peers, args.set)
    except ConfigError as exc:
        print(f"geotrain local: {exc}", file=sys.stderr)
        return 2
    peers = [ManagedProcess(command, config.parent / "log.txt", _env(config, i, args.peers))
             for i, config in enumerate(configs)]  # fmt: skip
    log.info("local_swarm", peers=args.peers, dir=str(folder), command=" ".join(command),
             detail=f"logs in {folder}/peer-*/log.txt; Ctrl-C stops them all")  # fmt: skip
    return _supervise(peers, args.grace_s)


def _run_name(command: list[str]) -> str:
    """The stem of the command's first .py file ("train" for python train.py), or "run"."""
    script = next((Path(a) for a in command if a.endswith(".py")), None)
    return script.stem if script is not None else "run"


def write_configs(root: Path, n: int, overrides: list[str]) -> list[Path]:
    """Each peer's folder under `root`: its key (made once, kept), its node.toml (written
    afresh: new ports each run) with `overrides` set. Returns the node.toml paths.

    Raises:
        ConfigError: an override that does not make a valid config.
    """
    ports = _free_ports(n)
    swarm_id = _swarm_id(root)
    configs = []
    for i, port in enumerate(ports):
        folder = root / f"peer-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        key = folder / "identity.key"
        if not key.exists():
            Identity.generate().save(key)
        first = i == 0  # the others dial it and start from its model; it waits for them all
        doc = {
            "identity": {"key": key, "open_swarm": True, "swarm_id": swarm_id},
            "network": {"listen": f"tcp://127.0.0.1:{port}",
                        "bootstrap": [] if first else [f"tcp://127.0.0.1:{ports[0]}"]},
            "training": {"wait_for_peers": n - 1 if first else 1},
            "state": {"dir": folder / "state"},
        }  # fmt: skip
        for item in overrides:
            key_path, sep, raw = item.partition("=")
            parts = key_path.strip().split(".")
            if not sep or len(parts) < 2:
                raise ConfigError(f"--set {item!r}: expected section.key=value")
            table = doc
            for part in parts[:-1]:
                table = table.setdefault(part, {})
            table[parts[-1]] = override_value(raw)
        config = folder / "node.toml"
        config.write_text(config_to_toml(doc))
        load_config(config)  # (a bad --set fails here, before anything starts)
        configs.append(config)
    return configs


def _swarm_id(root: Path) -> str:
    """This folder's swarm: the same across runs (a second run resumes it), its own otherwise
    (two folders' local swarms never admit each other's peers)."""
    path = root / "swarm_id"
    with contextlib.suppress(OSError):
        return path.read_text().strip() or _new_swarm_id(path)
    return _new_swarm_id(path)


def _new_swarm_id(path: Path) -> str:
    value = f"local-{secrets.token_hex(4)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    return value


def _free_ports(n: int) -> list[int]:
    """`n` ports free on 127.0.0.1 now (held together, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _env(config: Path, index: int, n: int) -> dict[str, str]:
    return {**os.environ, CONFIG_ENV: str(config), INDEX_ENV: str(index), PEERS_ENV: str(n),
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


class _Relay:
    """Copies what each peer's log gains to our stdout, a whole line at a time, "[i] " first."""

    def __init__(self, peers: list[ManagedProcess]) -> None:
        self._peers = peers
        self._offsets = [_size(p.log) for p in peers]  # (a resumed run's old lines stay there)
        self._partial = [b""] * len(peers)

    def pump(self, final: bool = False) -> None:
        for i, peer in enumerate(self._peers):
            with contextlib.suppress(OSError), open(peer.log, "rb") as f:
                f.seek(self._offsets[i])
                data = f.read()
            if not data and not final:
                continue
            self._offsets[i] += len(data)
            text = self._partial[i] + data
            *lines, self._partial[i] = text.split(b"\n")
            if final and self._partial[i]:
                lines.append(self._partial[i])
                self._partial[i] = b""
            for line in lines:
                sys.stdout.write(f"[{i}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _supervise(peers: list[ManagedProcess], grace_s: float) -> int:
    """Run the peers to their end; a signal here stops them all (see the module's comment).
    Returns 0 when every peer exited 0, the first failure's status otherwise (the others are
    stopped then, as torchrun does), 130 after a signal."""
    signals: list[float] = []

    def asked(signum: int, _frame: object) -> None:
        if not signals or time.monotonic() - signals[-1] > DUPLICATE_SIGNAL_S:
            signals.append(time.monotonic())

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, asked) for s in handled}
    relay = _Relay(peers)
    try:
        for peer in peers:
            peer.start()
        failed = _wait(peers, relay, signals)
        if signals or failed is not None:
            if failed is not None:
                log.error("peer_failed", peer=failed, status=peers[failed].proc.returncode,
                          log=str(peers[failed].log), detail="stopping the other peers")
            _stop(peers, relay, signals, grace_s)
        relay.pump(final=True)
        if signals:
            return 130
        if failed is not None:
            code = peers[failed].proc.returncode
            return 128 - code if code < 0 else code  # (killed by a signal: as a shell says it)
        return 0
    finally:
        for peer in peers:
            peer.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wait(peers: list[ManagedProcess], relay: _Relay, signals: list[float]) -> int | None:
    """Until every peer exited, one failed (its index is returned) or a signal came."""
    while not signals:
        relay.pump()
        for i, peer in enumerate(peers):
            if not peer.running and peer.proc is not None and peer.proc.returncode != 0:
                return i
        if not any(peer.running for peer in peers):
            return None
        time.sleep(POLL_S)
    return None


def _stop(peers: list[ManagedProcess], relay: _Relay, signals: list[float],
          grace_s: float) -> None:  # fmt: skip
    """SIGINT to every peer; wait up to `grace_s` for them (a second signal: kill at once)."""
    asked = len(signals)
    for peer in peers:
        peer.signal(signal.SIGINT)
    log.info("local_swarm_stopping", peers=sum(p.running for p in peers),
             detail=f"each closes its swarm (checkpoint, leave); killed after {grace_s:g} s, "
             "or at once on a second Ctrl-C")  # fmt: skip
    deadline = time.monotonic() + grace_s
    while any(p.running for p in peers) and time.monotonic() < deadline:
        if len(signals) > asked:
            break
        relay.pump()
        time.sleep(POLL_S)
    left = [i for i, p in enumerate(peers) if p.running]
    if left:
        log.warning("peers_killed", peers=left, detail="they had not stopped: killed")
