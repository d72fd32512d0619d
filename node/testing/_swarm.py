# A swarm of real `geotrain node run` processes on loopback, for tests and benchmarks. Invariants:
# every file it writes is under its root; every node it starts is killed by `stop_all()`; configs
# are written by the node's own config writer and nodes started by the node's own launcher.
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._config import config_to_toml
from .._launch import NodeProcess, node_argv
from ..identity import Identity


@dataclass
class SwarmNode(NodeProcess):
    """One node of a LocalSwarm (a NodeProcess with a name)."""

    name: str = ""

    def check_alive(self) -> None:
        """Raise if it exited with an error (with its log)."""
        if self.proc is not None and self.proc.poll() not in (None, 0):
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_tail(4000)

    def log_events(self) -> list[dict]:
        """Its log's JSON lines (a node started with --log-format json), in order; other lines
        are skipped."""
        events = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    def params(self) -> dict:
        """The model tensors of its newest checkpoint (names start with "model/")."""
        from ..state import CheckpointStore, StateDir

        ckpt, _ = CheckpointStore(StateDir(self.state).checkpoints).load_latest()
        if ckpt is None:
            raise AssertionError(f"{self.name} wrote no checkpoint")
        return {k: v for k, v in ckpt.tensors.items() if k.startswith("model/")}


@dataclass
class LocalSwarm:
    """Writes keys and configs under `root` and runs nodes as subprocesses on 127.0.0.1.

    Attributes:
        root: its folder (created if missing).
        common: config sections every node gets (a node's own sections are merged on top,
            key by key within a section).
        python_path: folders put first on the nodes' PYTHONPATH (for task modules).
        fork_server: fork the nodes from one warm process (see ForkServer): ~0.1 s of CPU to
            start a node instead of ~4 s of importing torch, for tests of many short runs.
    """

    root: Path
    common: dict[str, dict] = field(default_factory=dict)
    python_path: Sequence[Path] = ()
    fork_server: bool = False
    nodes: list[SwarmNode] = field(default_factory=list)

    def add(self, name: str, **sections: dict) -> SwarmNode:
        """Write a key and a config for node `name` (open swarm on loopback); not started."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.root / f"{name}.key"
        Identity.generate().save(key)
        merged: dict[str, dict] = {}
        for section in {*self.common, *sections}:
            merged[section] = {**self.common.get(section, {}), **sections.get(section, {})}
        merged.setdefault("identity", {}).update({"key": str(key), "open_swarm": True})
        state = self.root / f"state-{name}"
        merged.setdefault("state", {})["dir"] = str(state)
        config = self.root / f"{name}.toml"
        config.write_text(config_to_toml(merged))
        node = SwarmNode(node_argv(config), self.root / f"{name}.log", self._env(),
                         config=config, state=state, name=name,
                         fork_server=self.fork_server)  # fmt: skip
        self.nodes.append(node)
        return node

    def _env(self) -> dict[str, str]:
        entries = [*map(str, self.python_path), os.environ.get("PYTHONPATH", "")]
        path = os.pathsep.join(e for e in entries if e)
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}

    def start(self, node: SwarmNode, *overrides: str) -> SwarmNode:
        """Start (or restart) `node`, with extra `--set` overrides."""
        node.argv = node_argv(node.config, overrides)
        node.start()
        return node

    def wait_all(self, timeout: float) -> None:
        """Wait for every started node to exit; each must exit 0."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                code = node.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired
                raise TimeoutError(f"{node.name} still running:\n{node.log_text()}") from None
            if code != 0:
                raise AssertionError(f"{node.name} failed ({code}):\n{node.log_text()}")

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `predicate` until true; raise TimeoutError (with every log's tail) after `timeout`
        or as soon as a node exits with an error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for node in self.nodes:
                node.check_alive()
            time.sleep(0.2)
        logs = "\n".join(f"--- {n.name}\n{n.log_text()[-1500:]}" for n in self.nodes)
        raise TimeoutError(f"timed out waiting for {what}\n{logs}")

    def stop_all(self) -> None:
        """Kill every node that still runs."""
        for node in self.nodes:
            node.close()
