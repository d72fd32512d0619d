# Launching node processes: the one launcher the testbed, the tests and the benchmarks share.
# Invariants: a process is started in its own session (Ctrl-C in a terminal reaches only whoever
# launched it) with its output appended to its log file; `signal` reaches its whole process group;
# `close()` kills and reaps it, so nothing outlives its owner; the node's files are read through
# StateDir (the one owner of the state directory's layout).
from __future__ import annotations

import contextlib
import json
import os
import signal as signals
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .state import StateDir

if TYPE_CHECKING:
    from ._forkserver import ForkedProcess, ForkServer


def node_argv(
    config: Path, overrides: Sequence[str] = (), *, log_format: str = "json"
) -> list[str]:
    """`geotrain node run` with `config` and `--set` overrides (e.g. "gossip.policy=uniform"),
    through this Python (so the node runs the same geotrain as its launcher)."""
    argv = [sys.executable, "-m", "geotrain.node", "--log-format", log_format, "node", "run",
            "--config", str(config)]  # fmt: skip
    for item in overrides:
        argv += ["--set", item]
    return argv


@dataclass
class ManagedProcess:
    """One child process with a log file.

    Attributes:
        argv: the command; prefix: put before it (e.g. `ip netns exec NS`), empty by default.
        log: stdout and stderr are appended here.
        env: its environment (None: ours).
    """

    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    prefix: tuple[str, ...] = ()
    proc: subprocess.Popen | ForkedProcess | None = field(default=None, repr=False)
    fork_server: bool | ForkServer = False

    def start(self) -> None:
        """Start it. With `fork_server` (True: one per environment, or that server), a
        `python -m geotrain.…` (a node, a testbed worker), alone or after `ip netns exec NS`,
        is forked from a warm process (ForkServer) instead of starting a fresh Python."""
        netns = self.prefix[3] if self.prefix[:3] == ("ip", "netns", "exec") else None
        plain = not self.prefix or (netns is not None and len(self.prefix) == 4)
        ours = (
            self.argv[:2] == [sys.executable, "-m"]
            and self.argv[2:3] != []
            and self.argv[2].startswith("geotrain.")
        )
        if self.fork_server and plain and ours:
            from ._forkserver import ForkServer

            env = dict(os.environ) if self.env is None else self.env
            server = self.fork_server
            if not isinstance(server, ForkServer):
                server = ForkServer.for_env(env)
            self.proc = server.spawn(self.argv[3:], str(self.log), module=self.argv[2],
                                     netns=netns, env=env)  # fmt: skip
            return
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def signal(self, signum: int) -> None:
        """Send `signum` to the process group, if it still runs."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)  # type: ignore[union-attr]

    def wait(self, timeout: float) -> int:
        """Its exit status once it exited (subprocess.TimeoutExpired after `timeout`)."""
        assert self.proc is not None, "not started"
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Kill it (if it runs) and reap it. Idempotent."""
        self.signal(signals.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def note(self, event: str, **fields: object) -> None:
        """Append a line of the launcher's own to the process's log, in the node's JSON log
        shape (a testbed's kill or restart of the process, which its log did not show)."""
        record = {"event": event, **fields, "level": "warning", "by": "launcher",
                  "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        with contextlib.suppress(OSError), open(self.log, "a") as log:
            log.write(json.dumps(record, default=str) + "\n")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class NodeProcess(ManagedProcess):
    """A `geotrain node run` process, its config file and its state directory.

    Attributes:
        config: the node's TOML file; state: its state.dir (as the config names it).
    """

    config: Path = Path("node.toml")
    state: Path = Path("state")

    @classmethod
    def create(
        cls, config: Path, state: Path, log: Path, *, overrides: Sequence[str] = (),
        env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
        fork_server: bool | ForkServer = False,
    ) -> NodeProcess:  # fmt: skip
        return cls(node_argv(config, overrides), log, env, prefix, fork_server=fork_server,
                   config=config, state=state)  # fmt: skip

    def restart_with(self, *overrides: str) -> None:
        """Start again (after it exited) with extra `--set` overrides."""
        self.argv = node_argv(self.config, overrides)
        self.start()

    def status(self) -> dict | None:
        """Its status.json, or None while there is none (written atomically by the node)."""
        return _read_json(StateDir(self.state).status)

    def address(self, timeout_s: float = 120.0) -> str:
        """The address it listens on, once its node.json names this process.

        Raises:
            RuntimeError: it exited first. TimeoutError: not in time. (Both with its log's tail.)
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = _read_json(StateDir(self.state).node_info)
            if info and self.proc is not None and info.get("pid") == self.proc.pid:
                return str(info["address"])
            if not self.running:
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"node exited ({code}) before it listened; log {self.log}:\n"
                                   f"{self.log_tail(2000)}")  # fmt: skip
            time.sleep(0.1)
        raise TimeoutError(f"node did not listen within {timeout_s:g} s; log {self.log}:\n"
                           f"{self.log_tail(2000)}")  # fmt: skip


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
