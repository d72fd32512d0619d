"""`geotrain testbed report DIR --html`: one self-contained HTML file made from the directory of a
real `geotrain testbed run` (2 peers, faults, the DDP baseline), opened in headless Chromium; and
the directories it refuses (exit 2, every problem named, no traceback) or reports while naming the
parts they lack."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from geotrain.node.cli._main import main

# Faults of every kind the plots mark: kill/restart (skipped by DDP), a link change and a heal.
# The description holds markup, quotes and a `$`: the report must show it as text.
SCENARIO = """
description = "2 peers <b>&amp;</b> \\"quoted\\" <script>alert('x')</script> $x$"
task = "digits-mlp"
duration_s = 8
[[regions]]
name = "east"
peers = 1
[[regions]]
name = "west"
peers = 1
[links.inside]
delay_ms = 1
rate_mbit = 200
[[links.between]]
regions = ["east", "west"]
delay_ms = 5
rate_mbit = 200
[[faults]]
at_s = 0
action = "kill"
peer = 1
[[faults]]
at_s = 0.5
action = "degrade"
regions = ["east", "west"]
delay_ms = 20
rate_mbit = 50
[[faults]]
at_s = 1
action = "restart"
peer = 1
[[faults]]
at_s = 3
action = "heal"
"""
# A target no system reaches in 8 s: a run that reached it stopped early, before its last
# faults, and every fault is to be on the plots
RUN_ARGS = ["--scenario", "tiny.toml", "--duration", "8", "--target", "0.995", "--out", "run"]


def _geotrain(*argv: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "geotrain.node", *argv]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run through the `geotrain` command, once for this module (~35 s on 2 cores).

    Namespaces and the userspace emulator when root, plain loopback otherwise (the run says so).
    """
    work = tmp_path_factory.mktemp("report")
    (work / "tiny.toml").write_text(SCENARIO)
    done = _geotrain("testbed", "run", *RUN_ARGS, cwd=work, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return work / "run"


@pytest.fixture
def run_copy(real_run: Path, tmp_path: Path) -> Path:
    """A copy of the real run for a test to damage (without checkpoints: no report reads them,
    and without any report.html another test wrote)."""
    copy = tmp_path / "run"
    shutil.copytree(real_run, copy, ignore=shutil.ignore_patterns("checkpoints", "report.html"))
    return copy


class _Dom(HTMLParser):
    """Tags, the link attributes, and each table's cell texts, by table id."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.links: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.texts: dict[str, str] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._id: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        self.links += [v or "" for k, v in attrs if k in ("src", "href", "srcset", "action")]
        if tag == "table":
            self._table = a.get("id") or "?"
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            self._cell = []
        elif a.get("id") and tag in ("pre", "section"):
            self._id = a["id"]
            self.texts[self._id] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "section"):
            self._id = None
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.texts[self._id] += data


def _table_rows_printed(stdout: str, n_systems: int) -> list[list[str]]:
    """The comparison table as the CLI printed it, split into cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("system "))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start : start + 1 + n_systems]]


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser; without it the test is skipped before the run is paid for (list it first)."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium): the HTML "
                    "report is not opened in a browser")  # fmt: skip
    return path


def _chromium_run(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _distinct_colours(png: Path | bytes) -> int:
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(io.BytesIO(png) if isinstance(png, bytes) else png)
    rgb = (pixels[..., :3] * 255).round().astype(np.uint32)  # (height, width, 3)
    return len(np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]))


def _non_white_share(png: Path) -> float:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    return float((pixels[..., :3].min(axis=-1) < 0.95).mean())


@pytest.mark.slow
def test_html_report_of_a_real_run_opens_offline_in_chromium(chromium: str, real_run: Path,
                                                              tmp_path: Path):  # fmt: skip
    work = real_run.parent
    done = _geotrain("testbed", "report", "run", "--html", cwd=work, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    report = work / "run" / "report.html"
    assert f"html: {Path('run') / 'report.html'}" in done.stdout
    text = report.read_text()
    summary = json.loads((real_run / "summary.json").read_text())
    names = [s["system"] for s in summary["systems"]]
    assert names == ["geotrain", "ddp"]

    # one file: nothing to fetch, nothing to run
    page = _Dom(text)
    assert page.links and all(link.startswith("data:image/png;base64,") for link in page.links)
    assert not {"script", "link", "iframe", "object", "embed"} & set(page.tags)
    images = [base64.b64decode(link.split(",", 1)[1]) for link in page.links]
    assert len(images) == 3 + len(names)  # metric, bytes, consensus, one per system
    assert all(_distinct_colours(png) > 50 for png in images)  # real plots, not empty frames

    # Chromium draws it (no network is needed: everything is in the file) ...
    shot = tmp_path / "shot.png"
    drawn = _chromium_run(chromium, tmp_path / "profile", f"--screenshot={shot}",
                          "--window-size=1200,1600", report.as_uri())  # fmt: skip
    assert drawn.returncode == 0 and shot.is_file(), drawn.stderr[-3000:]
    assert _distinct_colours(shot) > 200 and _non_white_share(shot) > 0.02

    # ... and its DOM holds the table with the very cells the CLI printed
    dumped = _chromium_run(chromium, tmp_path / "profile", "--dump-dom", report.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    dom = _Dom(dumped.stdout)
    comparison = dom.tables["comparison"]
    assert [row[0] for row in comparison[1:]] == names
    assert comparison == _table_rows_printed(done.stdout, len(names))
    assert "script" not in dom.tags  # the description's markup stayed text
    assert "<script>alert('x')</script> $x$" in dom.texts["run"]
    assert dom.texts["command"] == "geotrain testbed run " + " ".join(
        RUN_ARGS[:3] + ["8.0"] + RUN_ARGS[4:]
    )
    faults = {(row[1], row[2], row[5]) for row in dom.tables["faults"][1:]}
    assert ("geotrain", "t=0s kill peer 1", "yes") in faults
    assert ("ddp", "t=0s kill peer 1", "no") in faults
    links = {row[0]: row for row in dom.tables["links"][1:]}
    emulated = summary["emulation"] != "none"
    assert (links["east -> west"][3] != "not measured") == emulated, links
    assert "missing" not in dom.texts  # a complete run lacks nothing


@pytest.mark.slow
def test_every_time_axis_marks_every_fault_of_its_systems(real_run: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from geotrain.testbed._plots import fault_label, fault_x, load_systems, report_figures

    run = json.loads((real_run / "run.json").read_text())
    systems = load_systems(real_run, run)
    assert all(s.faults for s in systems) and all("t" in f for _, f in systems[0].faults)
    labels = [f"peer {i}" for i in range(run["peers"])]
    for name, _, draw in report_figures(run, systems, labels):
        shown = [s for s in systems if name.endswith(s.name)] or (
            [s for s in systems if s.name == "geotrain"] if name == "consensus" else systems
        )
        fig = draw(plt)
        try:
            for ax in fig.axes:
                vertical = [line for line in ax.get_lines() if len(set(line.get_xdata())) == 1]
                xs = {round(line.get_xdata()[0], 6) for line in vertical}
                texts = " | ".join(t.get_text() for t in ax.texts)
                for s in shown:
                    for number, fault in s.faults:
                        assert round(fault_x(fault, s.t0), 6) in xs, (name, fault)
                        assert fault_label(number, fault) in texts, (name, texts)
        finally:
            plt.close(fig)


@pytest.mark.slow
def test_run_json_records_the_command_line_and_its_directory(real_run: Path):
    run = json.loads((real_run / "run.json").read_text())
    assert run["command"] == ["geotrain", "testbed", "run", *RUN_ARGS[:3], "8.0", *RUN_ARGS[4:]]
    assert run["cwd"] == str(real_run.parent)


def test_command_line_keeps_only_what_was_set_flags_and_repeats_included():
    import argparse

    from geotrain.testbed._cli import _command_line

    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--peers", type=int)
    parser.add_argument("--node-set", action="append", default=[])
    parser.add_argument("--no-link-check", action="store_true")
    args = parser.parse_args(["--peers", "3", "--node-set", "a.b=1", "--node-set", "c.d=x y",
                              "--no-link-check"])  # fmt: skip
    assert _command_line(parser, args) == (
        "geotrain", "testbed", "run", "--peers", "3", "--node-set", "a.b=1", "--node-set",
        "c.d=x y", "--no-link-check",
    )  # fmt: skip


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["testbed", "report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_directory_without_run_json_is_refused(tmp_path: Path, capsys):
    (tmp_path / "geotrain").mkdir()  # a run that crashed before its end
    code, _, err = _report(capsys, str(tmp_path), "--html")
    assert code == 2
    assert "run.json not found: not a testbed run's folder, or one whose run crashed" in err
    assert not (tmp_path / "report.html").exists()


def test_an_interrupted_run_is_refused_as_interrupted_not_as_older(tmp_path: Path, capsys):
    """A run stopped before any system finished writes what it had, marked interrupted: the
    report blamed "an older geotrain"."""
    (tmp_path / "run.json").write_text(json.dumps({
        "scenario": "x", "emulation": "userspace", "emulation_reason": "-", "peers": 4,
        "task": "digits-mlp", "algorithm": "adpsgd", "target_value": 0.9, "metric": "accuracy",
        "rate_scale": 1.0, "systems": {}, "faults": [], "links": [],
        "interrupted": "KeyboardInterrupt"}))  # fmt: skip
    code, _, err = _report(capsys, str(tmp_path))
    assert code == 2 and "the run was interrupted (KeyboardInterrupt)" in err, err
    assert "systems finished: none" in err and "older" not in err
    assert "peer logs and metrics" in err and "consensus_distance_final" not in err, err


def test_a_torn_run_json_is_refused(tmp_path: Path, capsys):
    (tmp_path / "run.json").write_text('{"scenario": "demo", "peers": ')
    code, _, err = _report(capsys, str(tmp_path), "--html")
    assert code == 2 and "run.json: not a JSON object" in err
    assert not (tmp_path / "report.html").exists()


def test_no_such_directory_is_refused(tmp_path: Path, capsys):
    code, _, err = _report(capsys, str(tmp_path / "nowhere"), "--html")
    assert code == 2 and "no such directory" in err


@pytest.mark.slow
def test_an_older_run_json_is_refused_naming_the_fields(run_copy: Path, capsys):
    run = json.loads((run_copy / "run.json").read_text())
    del run["links"], run["consensus_distance_final"]
    (run_copy / "run.json").write_text(json.dumps(run))
    code, _, err = _report(capsys, str(run_copy), "--html")
    assert code == 2
    assert "run.json lacks links, consensus_distance_final" in err
    assert not (run_copy / "report.html").exists()


@pytest.mark.slow
def test_missing_metrics_files_are_refused_naming_each(run_copy: Path):
    (run_copy / "geotrain" / "peer-00" / "metrics.jsonl").unlink()
    (run_copy / "ddp" / "peer-00.jsonl").unlink()
    done = _geotrain("testbed", "report", str(run_copy), "--html", cwd=run_copy, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert any("geotrain: no metrics file for peer(s) 0" in line for line in lines), lines
    assert any("ddp: no metrics file for peer(s) 0" in line for line in lines), lines
    assert not (run_copy / "report.html").exists()


@pytest.mark.slow
def test_a_peer_killed_before_its_first_metric_is_named_not_refused(run_copy: Path):
    # the scenario kills peer 1 at 0 s: on a busy box it can be killed before its first
    # metrics line and come back too late to write one, and the run is still whole
    (run_copy / "geotrain" / "peer-01" / "metrics.jsonl").unlink(missing_ok=True)
    done = _geotrain("testbed", "report", str(run_copy), "--html", cwd=run_copy, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "missing: geotrain peer 1's metrics (killed before it wrote any" in done.stdout
    assert (run_copy / "report.html").exists()


@pytest.mark.slow
def test_missing_optional_parts_are_named_in_the_report(run_copy: Path, tmp_path: Path, capsys):
    summary = json.loads((run_copy / "summary.json").read_text())
    for name in ("summary.json", "scenario.json", "bytes-ddp.jsonl"):
        (run_copy / name).unlink()
    run = json.loads((run_copy / "run.json").read_text())  # as an older geotrain wrote it
    del run["command"], run["cwd"]
    for fault in run["faults"]:
        del fault["t"]
    (run_copy / "run.json").write_text(json.dumps(run))
    dest = tmp_path / "elsewhere.html"
    code, out, err = _report(capsys, str(run_copy), "--html-out", str(dest))
    assert code == 0, err
    assert dest.is_file() and not (run_copy / "report.html").exists()
    page = _Dom(dest.read_text())
    said = [line for line in out.splitlines() if line.startswith("missing: ")]
    for part in ("summary.json", "scenario.json", "bytes-ddp.jsonl", "the command line",
                 "wall-clock times"):  # fmt: skip
        assert part in page.texts["missing"] and any(part in line for line in said), said
    assert "bytes-geotrain.jsonl" not in page.texts["missing"]
    # summary.json is rebuilt from what is left: the same numbers, but DDP's bytes are unknown
    geotrain, ddp = json.loads((run_copy / "summary.json").read_text())["systems"]
    # (without the faults' times the kill of peer 1 cannot be placed: its metrics from before
    # the kill count on, so the target can only be found as soon or sooner, and the best level
    # every peer reached is taken over other lines, higher or lower; the rest is equal)
    by_kill = ("time_to_target_s", "bytes_to_target", "best_swarm_metric")
    original = summary["systems"][0]
    assert {k: v for k, v in geotrain.items() if k not in by_kill} == {
        k: v for k, v in original.items() if k not in by_kill}
    if original["time_to_target_s"] is not None:
        assert geotrain["time_to_target_s"] <= original["time_to_target_s"]
    assert (geotrain["best_swarm_metric"] is None) == (original["best_swarm_metric"] is None)
    assert ddp["bytes_sent_total"] is None
    assert ddp["time_to_target_s"] == summary["systems"][1]["time_to_target_s"]
    rows = {row[0]: row for row in page.tables["comparison"][1:]}
    assert list(rows) == ["geotrain", "ddp"] and rows["ddp"][4] == "-"


@pytest.mark.slow
def test_an_unwritable_html_out_is_one_line_and_exit_1(run_copy: Path, capsys):
    dest = run_copy / "no-such-folder" / "report.html"
    code, _, err = _report(capsys, str(run_copy), "--html-out", str(dest))
    assert code == 1 and "--html-out" in err and str(dest) in err
