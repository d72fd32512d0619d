"""The swarm launcher of the daemon's tests: geotrain's own, with this folder on the nodes'
PYTHONPATH (so they can load `tests_tasks:...`)."""

from __future__ import annotations

from pathlib import Path

from geotrain.node.testing import LocalSwarm as _LocalSwarm

TESTS = Path(__file__).resolve().parent


def LocalSwarm(root: Path, common: dict | None = None) -> _LocalSwarm:  # noqa: N802
    return _LocalSwarm(root, common=common or {}, python_path=(TESTS,), fork_server=True)
