# The processes of a testbed run: where each peer runs (its own namespace, or plain loopback when
# there is no emulation), the swarm files that admit it (a throwaway authority, one key and one
# certificate per peer) and the `geotrain node run` / DDP worker processes themselves.
# Invariants: every process started here is tracked by its Peers object and is gone once
# `Peers.close()` returns (SIGTERM, then SIGKILL); files are written only under the run's output
# directory; nothing here imports torch.
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node import Identity, SwarmAuthority

from ._namespaces import NamespaceSet

NODE_PORT = 7000
DDP_PORT = 29500
CERT_LIFETIME_S = 7 * 24 * 3600.0
STOP_GRACE_S = 30.0  # SIGTERM -> checkpoint + leave; SIGKILL after this


class TestbedError(RuntimeError):
    """The run could not go on (a peer did not start, a backend is unusable); message says why."""

    __test__ = False


@dataclass(frozen=True)
class Host:
    """Where one peer's processes run.

    Attributes:
        index: the peer index.
        address: the IPv4 address the peer listens on.
        ifname: its network device (GLOO_SOCKET_IFNAME for the DDP baseline).
        prefix: argv prefix that puts a command inside the peer's namespace (empty on loopback).
    """

    index: int
    address: str
    ifname: str
    prefix: tuple[str, ...] = ()

    @property
    def fixed_port(self) -> bool:
        """Whether every peer can listen on NODE_PORT (its own namespace) or must pick one."""
        return bool(self.prefix)


def hosts_for(namespaces: NamespaceSet | None, n: int, backend: str) -> list[Host]:
    """One Host per peer: in its namespace, or all on 127.0.0.1 when `namespaces` is None."""
    if namespaces is None:
        return [Host(i, "127.0.0.1", "lo") for i in range(n)]
    ifname = {"netem": "eth0"}  # userspace: the TUN device carries the namespace's name
    return [
        Host(ns.index, str(ns.address), ifname.get(backend, ns.name), tuple(ns.exec_argv([])))
        for ns in namespaces
    ]


def _toml_value(value: Any) -> str:
    if isinstance(value, Path):
        return json.dumps(str(value))
    return json.dumps(value)


def toml_text(doc: dict[str, dict[str, Any]]) -> str:
    """A small TOML writer for node configs: sections of scalars, lists and one level of tables."""
    lines: list[str] = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
        for key, sub in table.items():
            if isinstance(sub, dict):
                lines.append(f"[{section}.{key}]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def write_swarm_files(directory: Path, n: int, now: float) -> list[tuple[Path, Path, Path]]:
    """Create a throwaway swarm authority and admit `n` fresh peer identities.

    Returns:
        For each peer (key file, certificate file, swarm info file).
    """
    authority = SwarmAuthority.generate()
    swarm_dir = directory / "authority"
    authority.save(swarm_dir)
    info = directory / "swarm.json"
    authority.info.save(info)
    out = []
    for i in range(n):
        identity = Identity.generate()
        key, cert = directory / f"peer-{i:02d}.key", directory / f"peer-{i:02d}.cert"
        identity.save(key)
        authority.admit(identity.public_key, expires_in_s=CERT_LIFETIME_S, now=now).save(cert)
        out.append((key, cert, info))
    return out


@dataclass
class PeerProcess:
    """One running (or stopped) process of a peer, with its log file."""

    host: Host
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.host.prefix, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # Ctrl-C in the terminal reaches the orchestrator only
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)  # type: ignore[union-attr]


class Peers:
    """The processes of one system's run; every one is stopped by `close()`."""

    def __init__(self) -> None:
        self.procs: list[PeerProcess] = []

    def add(self, proc: PeerProcess) -> PeerProcess:
        self.procs.append(proc)
        return proc

    def running(self) -> list[PeerProcess]:
        return [p for p in self.procs if p.running]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every running process, wait up to `grace_s`, then SIGKILL what is left."""
        for p in self.running():
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.close()

    def close(self) -> None:
        """SIGKILL whatever still runs and reap it. Idempotent."""
        for p in self.procs:
            p.signal(signal.SIGKILL)
            if p.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=10)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of peer processes: one BLAS/OpenMP thread (the testbed shares few cores), and a
    PYTHONPATH of absolute folders that starts with the working directory, so a task module found
    here (`--task my_tasks:fn`) is found by every peer, whatever folder it runs in."""
    entries = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    path = os.pathsep.join(dict.fromkeys(os.path.abspath(e) for e in entries if e))
    return {
        **os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path,
        **(extra or {}),
    }  # fmt: skip


def node_argv(config: Path, overrides: Sequence[str] = ()) -> list[str]:
    """`geotrain node run` with `config` and `--set` overrides (e.g. "gossip.policy=uniform")."""
    argv = [sys.executable, "-m", "node", "--log-format", "json", "node", "run", "--config",
            str(config)]  # fmt: skip
    for item in overrides:
        argv += ["--set", item]
    return argv


def ddp_argv(
    *, rank: int, world: int, master: str, task: str, params: dict, seed: int, slowdown: float,
    duration: float, target: float, eval_every: int, metrics: Path,
) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "testbed._ddp", "--rank", str(rank), "--world", str(world),
        "--master", master, "--task", task, "--params", json.dumps(params), "--seed", str(seed),
        "--slowdown", str(slowdown), "--duration", str(duration), "--target", str(target),
        "--eval-every", str(eval_every), "--metrics", str(metrics),
    ]  # fmt: skip


def read_json(path: Path) -> dict | None:
    """A JSON file a running process replaces atomically, or None while it is not there yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def last_json_line(path: Path) -> dict | None:
    """The last complete JSON line of a growing .jsonl file, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            return json.loads(line)
    return None


def wait_for_address(state: Path, proc: PeerProcess, timeout_s: float = 120.0) -> str:
    """The address peer `proc` listens on, once its node.json names its pid.

    Raises:
        TestbedError: it exited first or did not get there in time (the log's tail is included).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_json(state / "node.json")
        if info and proc.proc is not None and info.get("pid") == proc.proc.pid:
            return str(info["address"])
        if not proc.running:
            break
        time.sleep(0.1)
    tail = proc.log.read_text()[-2000:] if proc.log.exists() else ""
    raise TestbedError(f"peer {proc.host.index} did not start (log {proc.log}):\n{tail}")


def free_port() -> int:
    """A TCP port free on loopback now (for the DDP rendezvous when peers share loopback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_pids(peers: Sequence[Peers]) -> list[int]:
    """Pids of every process of these runs that still runs (for the leftover check)."""
    return [p.proc.pid for ps in peers for p in ps.procs if p.running and p.proc is not None]
