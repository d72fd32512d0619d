"""`geotrain status --watch`: the live view rendered from a real node's status, the watch loop
over the network, and the command run as a user runs it (Ctrl-C, a terminal or a pipe, a state
directory that is not there, a node that does not answer)."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from rich.console import Console

import geotrain
from geotrain.node import Identity, NodeStatus, config_from_toml
from geotrain.node.cli._main import main
from geotrain.node.cli._status_watch import (
    SPARK_BARS,
    TREND_SAMPLES,
    Trend,
    WatchView,
    open_network_reader,
    render_view,
    sparkline,
    watch,
)
from geotrain.node.identity import Admission
from geotrain.node.state import exchange_time_note

CONFIG = """
[identity]
open_swarm = true
[training]
task = "synthetic-linreg"
threads = 1
eval_every = 5
[gossip]
probe_interval_s = 0.2
exchange_every = 2
[state]
status_every_s = 0.1
"""
CLIENT = """
[identity]
key = "client.key"
open_swarm = true
[training]
task = "synthetic-linreg"
"""
SPARK = re.compile(f"[{SPARK_BARS}]+")


def config(tmp_path: Path, name: str, *overrides: str):
    return config_from_toml(
        CONFIG, base=tmp_path, overrides=[f'state.dir="{tmp_path / name}"', *overrides]
    )


@dataclass(frozen=True)
class RealNode:
    status: NodeStatus  # taken while a peer was alive and exchanging
    state_dir: Path  # what the node left on disk: status.json, a metrics.jsonl history


@pytest.fixture(scope="module")
def real_node(tmp_path_factory) -> RealNode:
    """Two nodes trained briefly on loopback; node a's live status and its state directory."""
    tmp = tmp_path_factory.mktemp("watch")

    async def run() -> NodeStatus:
        admission = Admission.open_swarm("geotrain")
        async with geotrain.open_node(config(tmp, "a"), identity=Identity.generate(),
                                      admission=admission) as a:  # fmt: skip
            async with geotrain.open_node(
                config(tmp, "b", f'network.bootstrap=["{a.address}"]'),
                identity=Identity.generate(), admission=admission,
            ):  # fmt: skip
                with trio.fail_after(60):
                    while (a.status().exchanges_ok < 3 or a.status().metric is None
                           or _lines(tmp / "a" / "metrics.jsonl") < 12):  # fmt: skip
                        await trio.sleep(0.1)
                return a.status()

    return RealNode(trio.run(run), tmp / "a")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def shown(value: float) -> str:
    """How the view prints a loss or metric: four decimals, unless too large or small for them
    (the demo task's loss sometimes runs away)."""
    return f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.4e}"


def render(view: WatchView) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(render_view(view))
    return console.file.getvalue()


# -- the view ------------------------------------------------------------------------------------


def test_sparkline_scales_between_the_minimum_and_the_maximum():
    assert sparkline(range(8)) == SPARK_BARS
    assert sparkline([3.0, None, float("nan"), 1.0]) == "█▁"
    assert sparkline([0.0, 1.0, 10.0]) == "▁▂█"
    assert sparkline([2.0, 2.0, 2.0]) == "▅▅▅"
    assert sparkline([]) == ""


def test_a_trend_keeps_one_sample_per_new_step_and_evaluation():
    trend = Trend()
    for step in range(100):
        status = {"step": step, "loss": float(step), "metric_step": step // 10 * 10,
                  "metric": float(step // 10)}  # fmt: skip
        trend.add(status)
        trend.add(status)  # read again before the node wrote a new one: not a new sample
    assert list(trend.loss) == [float(s) for s in range(100 - TREND_SAMPLES, 100)]
    assert list(trend.metric) == [float(m) for m in range(10)]


def test_the_view_of_a_real_node_shows_its_numbers_peers_and_trends(real_node):
    s = real_node.status
    view = WatchView(source="state", interval_s=2.0)
    view.trend.seed(real_node.state_dir / "metrics.jsonl")
    view.update(s.to_json(), age_s=3.0)
    text = render(view)
    assert s.peers and s.peers[0].state == "alive"
    for peer in s.peers:
        row = next(line for line in text.splitlines() if peer.peer in line)
        cells = [cell.strip() for cell in row.split("│")[1:-1]]
        assert cells[:3] == [peer.peer, "alive", peer.address]
        assert cells[5:] == [str(peer.codec), str(peer.exchanges_ok), str(peer.exchanges_failed)]
        assert cells[3] == (f"{peer.rtt_ms:.1f}" if peer.rtt_ms is not None else "-")
    busy = f"{s.utilization:.0%}"
    assert re.search(rf"step\s+{s.step}\s+\({s.steps_per_s:.2f} steps/s, {busy} of the time in "
                     r"steps\)", text)  # fmt: skip
    assert re.search(rf"loss\s+{re.escape(shown(s.loss))}\s", text)
    assert re.search(rf"mse\s+{re.escape(shown(s.metric))} \(step {s.metric_step}\)", text)
    timed = exchange_time_note(s.to_json())  # (how long the exchanges it started took)
    assert (f"ok {s.exchanges_ok}{timed}  failed {s.exchanges_failed}  "
            f"rejected updates {s.rejected_updates}") in text  # fmt: skip
    view.update({**s.to_json(), "sync_bytes_in": 5_000_000, "exchange_last_s": 16.7,
                 "exchange_mean_s": 0.25}, age_s=3.0)  # fmt: skip
    again = render(view)
    assert re.search(r"traffic\s+in .* \(state sync in 5\.0 MB[,)]", again), again
    assert "(started here: last 16.7 s, mean 250 ms)" in again
    view.update(s.to_json(), age_s=3.0)
    assert f"peak {s.peak_rss_mb:.0f} MB" in text and re.search(r"uptime\s+\d+s", text)
    assert re.search(rf"open files\s+{s.open_files} of {s.open_files_limit}", text)
    assert s.peer_id in text and "running" in text and "written 3s before" in text
    loss_line = next(line for line in text.splitlines() if line.startswith("loss"))
    metric_line = next(line for line in text.splitlines() if line.startswith("mse"))
    assert len(SPARK.findall(loss_line)[0]) == len(view.trend.loss) >= 5  # history + this read
    assert len(SPARK.findall(metric_line)[0]) == len(view.trend.metric) >= 2
    assert not re.search(r"(?m)^reach\s", text)  # it was dialled back: nothing to say
    view.update({**s.to_json(), "not_dialled": True}, age_s=3.0)
    assert re.search(r"(?m)^reach\s+no peer could dial this address", render(view))


def test_trends_start_from_the_end_of_the_node_history(real_node, tmp_path):
    records = [json.loads(line) for line in
               (real_node.state_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    trend = Trend()
    trend.seed(real_node.state_dir / "metrics.jsonl")
    steps = list(dict.fromkeys(r["step"] for r in records if r["loss"] is not None))
    assert len(trend.loss) == min(len(steps), TREND_SAMPLES) >= 5
    assert trend.loss[-1] == records[-1]["loss"]
    empty = Trend()
    empty.seed(tmp_path / "nothing.jsonl")
    assert empty.seeded and not empty.loss and not empty.metric


def test_a_failed_read_is_shown_with_the_last_status(real_node):
    view = WatchView(source="tcp://127.0.0.1:9", interval_s=0.5)
    view.failed("tcp://127.0.0.1:9: cannot connect to tcp://127.0.0.1:9: Connection refused")
    text = render(view)
    assert "no status: tcp://127.0.0.1:9: cannot connect" in text
    assert "retrying every 0.5s, waiting for a first status" in text
    view.update(real_node.status.to_json(), age_s=None)
    view.failed("tcp://127.0.0.1:9: no reply from tcp://127.0.0.1:9 within 10 s")
    text = render(view)
    assert "no reply" in text and "showing the last one read" in text
    assert real_node.status.peer_id in text


# -- the watch loop over the network -------------------------------------------------------------


async def watch_for(address: str, client, shows: int) -> tuple[WatchView, list[str]]:
    """Run the watch loop on `address` (every 0.2 s) until it has shown `shows` views."""
    view = WatchView(source=address, interval_s=0.2)
    texts: list[str] = []
    with trio.fail_after(60):
        async with open_network_reader(address, client, 10) as read:
            async with trio.open_nursery() as nursery:

                def show(renderable) -> None:
                    texts.append(render(view))
                    if len(texts) == shows:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch, read, view, show)
    return view, texts


async def test_watching_a_node_over_the_network_follows_its_steps(tmp_path):
    Identity.generate().save(tmp_path / "client.key")
    client = config_from_toml(CLIENT, base=tmp_path)
    async with geotrain.open_node(config(tmp_path, "solo"), identity=Identity.generate(),
                                  admission=Admission.open_swarm("geotrain")) as node:  # fmt: skip
        with trio.fail_after(60):
            while node.status().step == 0:  # training has started: the steps must move
                await trio.sleep(0.05)
        view, texts = await watch_for(node.address, client, shows=3)
    steps = [int(re.search(r"step\s+(\d+)", t).group(1)) for t in texts]
    assert node.identity.peer_id in texts[-1] and "no status" not in "".join(texts)
    assert steps == sorted(steps) and steps[-1] > steps[0]  # read live, not a snapshot
    assert view.trend.loss and "(no peers known yet)" in texts[-1]


async def test_watching_an_unreachable_node_shows_why_and_retries(tmp_path):
    Identity.generate().save(tmp_path / "client.key")
    client = config_from_toml(CLIENT, base=tmp_path)
    address = f"tcp://127.0.0.1:{closed_port()}"
    view, texts = await watch_for(address, client, shows=2)
    assert all(f"cannot connect to {address}: Connection refused" in t for t in texts)
    assert all("retrying every 0.2s, waiting for a first status" in t for t in texts)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens there once the socket closes


def test_a_bad_client_identity_stops_the_watch_at_once(tmp_path, capsys):
    (tmp_path / "client.toml").write_text(CLIENT)  # client.key does not exist
    args = ["status", "--watch", "--node", "tcp://127.0.0.1:9", "--config"]
    assert main([*args, str(tmp_path / "client.toml")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("geotrain status: identity.key") and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [(["--watch", "--json"], "choose one"), (["--interval", "1"], "--interval is the refresh"),
     (["--watch", "--interval", "0"], "'0': expected seconds > 0")],
)  # fmt: skip
def test_watch_options_are_checked(argv, message, capsys, monkeypatch):
    def never(*args):
        raise AssertionError("refused options started a watch")

    monkeypatch.setattr("geotrain.node.cli._status_watch.run_watch", never)
    try:
        code = main(["status", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


# -- the command, as a user runs it --------------------------------------------------------------

HEADER = b"geotrain status"


@contextmanager
def watching(args: list[str], cwd: Path, stdout) -> Iterator[subprocess.Popen[bytes]]:
    """`geotrain status --watch --interval 0.3 ARGS` in `cwd`; killed on the way out if still
    running."""
    # rich would draw a terminal view into a pipe if these forced it to
    forcing = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    env = {k: v for k, v in os.environ.items() if k not in forcing}
    env.update(COLUMNS="120", TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain.node", "status", "--watch", "--interval", "0.3", *args],
        cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def read_until(fd: int, done, timeout_s: float = 90) -> bytes:
    """Read `fd` until `done(everything read)` or end of file; fails after `timeout_s`."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while not done(out):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; read so far: {out[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty whose other end closed
                chunk = b""
            if not chunk:
                break
            out += chunk
    return out


def interrupt(proc: subprocess.Popen[bytes], fd: int) -> tuple[int, bytes, str]:
    """Ctrl-C, then everything else it prints; returns (exit status, stdout rest, stderr)."""
    proc.send_signal(signal.SIGINT)
    rest = read_until(fd, lambda _: False, timeout_s=60)
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), rest, err


@pytest.mark.slow
def test_watch_a_state_dir_through_a_pipe_then_ctrl_c(real_node, tmp_path):
    shutil.copytree(real_node.state_dir, tmp_path / "state")  # the default --node, relative
    with watching([], tmp_path, subprocess.PIPE) as proc:
        first = read_until(proc.stdout.fileno(), lambda out: out.count(HEADER) >= 2)
        code, rest, err = interrupt(proc, proc.stdout.fileno())
    out = (first + rest).decode()
    assert code == 0 and "Traceback" not in err, err
    assert "\x1b" not in out  # not a terminal: plain snapshots, one per interval
    snapshots = [s for s in out.split("geotrain status state") if s.strip()]
    assert len(snapshots) >= 2
    assert all(real_node.status.peer_id in s and real_node.status.peers[0].peer in s
               for s in snapshots)  # fmt: skip


@pytest.mark.slow
def test_watch_a_state_dir_on_a_terminal_then_ctrl_c(real_node, tmp_path):
    import fcntl
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 140, 0, 0))
    try:
        with watching(["--node", str(real_node.state_dir)], tmp_path, follower) as proc:
            os.close(follower)
            first = read_until(leader, lambda out: out.count(HEADER) >= 3)  # redrawn in place
            code, rest, err = interrupt(proc, leader)
    finally:
        os.close(leader)
    assert code == 0 and "Traceback" not in err, err
    assert b"\x1b[2K\x1b[1A" in first  # rich Live erases the last view before drawing the next
    assert real_node.status.peers[0].peer.encode() in first + rest
    assert b"\x1b[?25h" in rest  # and it gave the cursor back on the way out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["missing state dir", "unreachable node"])
def test_watch_without_a_status_explains_and_retries(where, tmp_path):
    if where == "missing state dir":
        args, expected = ["--node", "nowhere"], "nowhere: No such file or directory"
    else:
        Identity.generate().save(tmp_path / "client.key")
        (tmp_path / "client.toml").write_text(CLIENT)
        port = closed_port()
        args = ["--node", f"tcp://127.0.0.1:{port}", "--config", "client.toml"]
        expected = f"cannot connect to tcp://127.0.0.1:{port}: Connection refused"
    with watching(args, tmp_path, subprocess.PIPE) as proc:
        first = read_until(proc.stdout.fileno(), lambda out: out.count(b"retrying every") >= 2)
        code, rest, err = interrupt(proc, proc.stdout.fileno())
    out = (first + rest).decode()
    # it never read a status: exit status 1, and the last problem on stderr
    assert code == 1 and "Traceback" not in err + out, err
    last = err.strip().splitlines()[-1]
    assert "never read a status" in last and expected in last, err
    assert out.count(expected) >= 2 and "waiting for a first status" in out


def test_status_and_the_command_line_load_no_torch(real_node):
    """`geotrain status` is what an operator runs over and over, often under `watch`: it reads a
    JSON file and must not pay for importing torch (seconds on a busy machine)."""
    script = (
        "import sys\n"
        "from geotrain.node.cli import main\n"
        f"rc = main(['status', '--node', {str(real_node.state_dir)!r}])\n"
        "assert 'torch' not in sys.modules, 'geotrain status imported torch'\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "exchanges ok" in done.stdout


def test_a_status_left_running_by_a_node_that_died_says_stopped(real_node, tmp_path, capsys):
    """A node that crashed (or was killed) left "running" in its status.json; no node holds
    the directory's lock any more, so `geotrain status` says it stopped."""
    import json
    import shutil

    from geotrain.node.cli._main import main
    from geotrain.node.state import StateDir

    copy = tmp_path / "crashed"
    shutil.copytree(real_node.state_dir, copy)
    doc = json.loads((copy / "status.json").read_text())
    (copy / "status.json").write_text(json.dumps({**doc, "running": True}))
    assert (copy / "lock").exists()
    assert main(["status", "--node", str(copy)]) == 0
    assert "(stopped)" in capsys.readouterr().out
    held = StateDir(copy).lock()  # a node holds it: running, as its status says
    try:
        assert main(["status", "--node", str(copy)]) == 0
        assert "(stopped)" not in capsys.readouterr().out
    finally:
        held.close()


@pytest.mark.parametrize("change", [
    {"steps_per_s": None, "elapsed_s": None, "pid": None},
    {"loss": "low", "bytes_in": "many", "metric": "good", "algorithm_stats": ["x"]},
    {"peers": [{"peer": "gtabc", "rtt_ms": "near", "exchanges_ok": None}, "not a peer"]},
    {"algorithm": None, "algorithm_stats": {"x": 1}, "certificate_expires_at": float("nan"),
     "peers": 7, "task": "\x1b[2Jcleared"},
])
def test_a_status_with_numbers_that_are_not_numbers_is_shown_not_a_traceback(
        real_node, tmp_path, capsys, change):  # fmt: skip
    """A status document from another version (or an admitted node's made-up one, read over
    the network) with a null or a text where a number goes ended `geotrain status` in a
    traceback."""
    copy = tmp_path / "odd"
    shutil.copytree(real_node.state_dir, copy)
    doc = json.loads((copy / "status.json").read_text())
    (copy / "status.json").write_text(json.dumps({**doc, **change}))
    assert main(["status", "--node", str(copy)]) == 0
    out = capsys.readouterr().out
    assert doc["peer_id"] in out and "steps/s" in out and "\x1b" not in out


def test_status_of_a_node_folder_or_its_config_file_reads_its_state_directory(
        real_node, tmp_path, capsys):  # fmt: skip
    """`geotrain node init DIR` makes DIR/node.toml with its state in DIR/state: `--node DIR`
    said "DIR/status.json: No such file", `--node DIR/node.toml` "not JSON"."""
    import shutil

    folder = tmp_path / "a"
    folder.mkdir()
    shutil.copytree(real_node.state_dir, folder / "state")
    (folder / "node.toml").write_text("[identity]\nopen_swarm = true\n")  # state.dir: "state"
    for given in (folder, folder / "node.toml"):
        assert main(["status", "--node", str(given)]) == 0
        assert "exchanges ok" in capsys.readouterr().out
    (folder / "node.toml").write_text("[stat]\ndir = 'x'\n")
    assert main(["status", "--node", str(folder)]) == 1
    assert "read as a node config: " in capsys.readouterr().err
