# The processes of a testbed run: where each peer runs (its own namespace, or plain loopback when
# there is no emulation), the swarm files that admit it (a throwaway authority, one key and one
# certificate per peer) and the `geotrain node run`, DDP and hivemind worker processes themselves.
# Invariants: every process started here is tracked by its Peers object and is gone once
# `Peers.close()` returns (SIGTERM, then SIGKILL); files are written only under the run's output
# directory; nothing here imports torch.
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from geotrain.node import Identity, ManagedProcess, NodeProcess, SwarmAuthority

from ._namespaces import NamespaceSet

if TYPE_CHECKING:
    from geotrain.node import ForkServer

NODE_PORT = 7000
DDP_PORT = 29500
HIVEMIND_PORT = 31337
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


class Peers:
    """The processes of one system's run (peer i is procs[i]); every one is stopped by `close()`."""

    def __init__(self) -> None:
        self.procs: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.procs.append(proc)
        return proc

    def running(self) -> list[ManagedProcess]:
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
            p.close()


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


def ddp_argv(
    *, rank: int, world: int, master: str, task: str, params: dict, seed: int, slowdown: float,
    duration: float, target: float, eval_every: int, metrics: Path, system: str = "ddp",
    local_sgd_period: int = 0, step_ms: float = 0.0, partition: str = "iid", alpha: float = 0.5,
    eval_every_s: float = 0.0, lr: float | None = None,
) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "geotrain.testbed._ddp", "--rank", str(rank), "--world", str(world),
        "--master", master, "--task", task, "--params", json.dumps(params), "--seed", str(seed),
        "--slowdown", str(slowdown), "--duration", str(duration), "--target", str(target),
        "--eval-every", str(eval_every), "--eval-every-s", str(eval_every_s),
        "--metrics", str(metrics), "--system", system,
        "--local-sgd-period", str(local_sgd_period), "--step-ms", str(step_ms),
        "--partition", partition, "--alpha", str(alpha),
        *(("--lr", str(lr)) if lr is not None else ()),
    ]  # fmt: skip


def hivemind_argv(
    *, rank: int, world: int, host: str, port: int, maddrs_dir: Path, run_id: str,
    settings: dict, system: str, task: str, params: dict, seed: int, slowdown: float,
    duration: float, eval_every: int, metrics: Path, step_ms: float = 0.0, partition: str = "iid",
    alpha: float = 0.5, eval_every_s: float = 0.0,
) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "geotrain.testbed._hivemind", "--rank", str(rank),
        "--world", str(world), "--host", host, "--port", str(port),
        "--maddrs-dir", str(maddrs_dir), "--run-id", run_id, "--settings", json.dumps(settings),
        "--system", system, "--task", task, "--params", json.dumps(params), "--seed", str(seed),
        "--slowdown", str(slowdown), "--duration", str(duration),
        "--eval-every", str(eval_every), "--eval-every-s", str(eval_every_s),
        "--metrics", str(metrics), "--step-ms", str(step_ms),
        "--partition", partition, "--alpha", str(alpha),
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


def start_node(host: Host, config: Path, state: Path, overrides: Sequence[str],
               fork: ForkServer | None = None) -> NodeProcess:  # fmt: skip
    """Start peer `host`'s node with `config` (its log beside its state directory), forked
    from `fork` when given (a fresh Python otherwise)."""
    proc = NodeProcess.create(config, state, state.with_suffix(".log"), overrides=overrides,
                              env=child_env(), prefix=host.prefix,
                              fork_server=fork or False)  # fmt: skip
    proc.start()
    return proc


def wait_for_address(index: int, proc: NodeProcess, timeout_s: float = 120.0) -> str:
    """The address peer `index` listens on.

    Raises:
        TestbedError: it exited first or did not get there in time (the log's tail is included).
    """
    try:
        return proc.address(timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        raise TestbedError(f"peer {index} did not start: {exc}") from None


def free_port() -> int:
    """A TCP port free on loopback now (for the DDP rendezvous when peers share loopback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_pids(peers: Sequence[Peers]) -> list[int]:
    """Pids of every process of these runs that still runs (for the leftover check)."""
    return [p.proc.pid for ps in peers for p in ps.procs if p.running and p.proc is not None]
