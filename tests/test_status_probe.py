"""`geotrain status --max-age S`: the container image's health probe. It exits non-zero when the
node's status file is older than S seconds or says the node stopped, and 0 for a fresh one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from geotrain.node.cli._main import main
from geotrain.node.cli._node_cli import STALE_EXIT
from geotrain.node.state import StateDir
from geotrain.node.state._status import STATUS_FORMAT


def _status_dir(tmp_path: Path, age_s: float, **change) -> Path:
    """A state directory whose status.json was written `age_s` seconds ago."""
    state = tmp_path / "state"
    state.mkdir()
    file = StateDir(state).status
    doc = {"format": STATUS_FORMAT, "peer_id": "gtabc", "address": "tcp://10.0.0.1:7000",
           "step": 12, "task": "synthetic-linreg", "algorithm": "adpsgd", "metric_name": "loss",
           "running": True, "status_every_s": 1.0, **change}  # fmt: skip
    file.write_text(json.dumps(doc))
    then = time.time() - age_s
    os.utime(file, (then, then))
    return state


def test_a_fresh_status_passes_the_probe(tmp_path, capsys):
    state = _status_dir(tmp_path, age_s=2)
    assert main(["status", "--node", str(state), "--max-age", "60", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peer_id"] == "gtabc"


def test_a_stale_status_fails_the_probe_and_says_why(tmp_path, capsys):
    state = _status_dir(tmp_path, age_s=300)
    assert main(["status", "--node", str(state), "--max-age", "60"]) == STALE_EXIT
    assert "written 300 s ago" in capsys.readouterr().err
    # without --max-age the same status is shown, not failed (status stays a viewer)
    assert main(["status", "--node", str(state)]) == 0


def test_a_status_that_says_stopped_fails_the_probe(tmp_path, capsys):
    state = _status_dir(tmp_path, age_s=1, running=False)
    assert main(["status", "--node", str(state), "--max-age", "60"]) == STALE_EXIT
    assert "not running" in capsys.readouterr().err


def test_no_status_yet_fails_the_probe(tmp_path, capsys):
    assert main(["status", "--node", str(tmp_path / "nothing"), "--max-age", "60"]) != 0


@pytest.mark.parametrize("seconds", ["0", "-1", "x"])
def test_a_bad_max_age_is_refused(tmp_path, seconds):
    state = _status_dir(tmp_path, age_s=1)
    with pytest.raises(SystemExit) as exited:
        main(["status", "--node", str(state), "--max-age", seconds])
    assert exited.value.code == 2


def test_max_age_with_watch_is_refused(tmp_path, capsys):
    state = _status_dir(tmp_path, age_s=1)
    assert main(["status", "--node", str(state), "--max-age", "5", "--watch"]) == 2
    assert "one-shot probe" in capsys.readouterr().err
