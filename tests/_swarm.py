"""A swarm of real `geotrain node run` processes on loopback, for the daemon's tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node._checkpoint import CheckpointStore
from node._identity import Identity


@dataclass
class NodeProc:
    name: str
    config: Path
    state: Path
    log: Path
    proc: subprocess.Popen | None = None

    def status(self) -> dict | None:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def address(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = json.loads((self.state / "node.json").read_text())
                if self.proc is not None and info["pid"] == self.proc.pid:
                    return info["address"]
            except (OSError, json.JSONDecodeError, KeyError):
                pass
            self.check_alive()
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not start; log:\n{self.log.read_text()[-3000:]}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() not in (None, 0):
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def params(self) -> dict[str, torch.Tensor]:
        ckpt, _ = CheckpointStore(self.state / "checkpoints").load_latest()
        assert ckpt is not None, f"{self.name} wrote no checkpoint"
        return {k: v for k, v in ckpt.tensors.items() if k.startswith("model/")}


@dataclass
class LocalSwarm:
    """Writes keys and configs under `root` and runs nodes as subprocesses (all killed at exit)."""

    root: Path
    common: dict[str, dict] = field(default_factory=dict)
    nodes: list[NodeProc] = field(default_factory=list)

    def add(self, name: str, **sections: dict) -> NodeProc:
        key = self.root / f"{name}.key"
        Identity.generate().save(key)
        merged: dict[str, dict] = {}
        for section in {*self.common, *sections}:
            merged[section] = {**self.common.get(section, {}), **sections.get(section, {})}
        merged.setdefault("identity", {}).update({"key": str(key), "open_swarm": True})
        merged.setdefault("state", {})["dir"] = str(self.root / f"state-{name}")
        config = self.root / f"{name}.toml"
        config.write_text(_toml(merged))
        node = NodeProc(name, config, self.root / f"state-{name}", self.root / f"{name}.log")
        self.nodes.append(node)
        return node

    def start(self, node: NodeProc, *overrides: str) -> NodeProc:
        cmd = [sys.executable, "-m", "node", "--log-format", "json", "node", "run"]
        cmd += ["--config", str(node.config)]
        for item in overrides:
            cmd += ["--set", item]
        log = open(node.log, "a")
        tests_dir = str(Path(__file__).resolve().parent)  # so nodes can load tests_tasks:...
        path = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        node.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        return node

    def wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{node.name} still running:\n{node.log_text()}") from None
            assert node.proc.returncode == 0, f"{node.name} failed:\n{node.log_text()}"

    def wait_until(self, predicate, timeout: float, what: str) -> None:
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
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGKILL)
                node.proc.wait(10)


def consensus_distance(models: list[dict[str, torch.Tensor]]) -> float:
    """Mean over nodes of ||x_i - mean||^2 / ||mean||^2 (relative squared distance)."""
    names = sorted(models[0])
    flat = torch.stack([torch.cat([m[n].flatten().float() for n in names]) for m in models])
    mean = flat.mean(dim=0)
    return float(((flat - mean) ** 2).sum(dim=1).mean() / (mean**2).sum())


def _toml(doc: dict[str, dict]) -> str:
    lines = []
    for section, table in doc.items():
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
        for k, sub in table.items():
            if isinstance(sub, dict):
                lines.append(f"[{section}.{k}]")
                lines += [f"{kk} = {json.dumps(vv)}" for kk, vv in sub.items()]
    return "\n".join(lines) + "\n"
