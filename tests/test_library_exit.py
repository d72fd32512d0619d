"""A training script of its own that ends without close(), or is interrupted with Ctrl-C while
geotrain.join waits for peers: the node stops cleanly either way (checkpoint, node_stopped) and
the process exits normally; its logs go to standard error. Real processes (slow)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

JOIN = """
import os, sys, torch, geotrain
from pathlib import Path
from torch import nn
from geotrain.node import Admission, Identity, config_from_toml
config = config_from_toml('''
[identity]
open_swarm = true
[training]
wait_for_peers = {wait}
[gossip]
probe_interval_s = 0.2
[state]
status_every_s = 0.2
''', base=Path('{state}'), overrides=['state.dir="{state}"'])
model = nn.Linear(4, 1)
swarm = geotrain.join(config, model, identity=Identity.generate(),
                      admission=Admission.open_swarm("geotrain"))
opt = swarm.wrap(torch.optim.SGD(model.parameters(), lr=0.1))
"""  # a script of one's own up to its loop

SCRIPT = JOIN + """
for _ in range(5):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("TRAINED", swarm.step, flush=True)
"""  # (and no swarm.close(): the program simply ends)


def _script(tmp_path: Path, wait: int) -> list[str]:
    path = tmp_path / "loop.py"
    path.write_text(SCRIPT.format(wait=wait, state=tmp_path / "state"))
    return [sys.executable, str(path)]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_script_that_never_closes_its_swarm_ends_cleanly(tmp_path):
    run = subprocess.run(_script(tmp_path, 0), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == "TRAINED 5\n"  # the script's own output only: logs go to stderr
    assert "swarm_closed_at_exit" in run.stderr
    assert "checkpoint_written" in run.stderr and "node_stopped" in run.stderr
    assert "panic" not in run.stderr
    assert list((tmp_path / "state" / "checkpoints").glob("ckpt-*"))


def _interrupt_a_waiting_join(tmp_path: Path, gaps: tuple[float, ...]) -> tuple[int, str]:
    """Run a script whose join waits for a peer that never comes, send it SIGINT once plus once
    after each of `gaps` seconds; its exit code and standard error."""
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        # (a runner started in the background passes SIGINT on ignored, and Python then
        # installs no KeyboardInterrupt: the script gets Ctrl-C as a terminal gives it)
        proc = subprocess.Popen(_script(tmp_path, 1), stdout=subprocess.PIPE, stderr=err,
                                text=True, preexec_fn=_default_sigint)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "node_started" not in log.read_text():  # join waits now: nobody comes
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            for gap in gaps:
                time.sleep(gap)
                proc.send_signal(signal.SIGINT)
            code = proc.wait(90)
        finally:
            proc.kill()
    return code, log.read_text()


def test_ctrl_c_while_join_waits_for_peers_stops_the_node_first(tmp_path):
    code, text = _interrupt_a_waiting_join(tmp_path, ())
    assert "KeyboardInterrupt" in text and "node_stopped" in text, text[-3000:]
    assert "panic" not in text and code in (-signal.SIGINT, 1, 130), (code, text[-3000:])


@pytest.mark.parametrize("gap_s", [0.001, 0.02])
def test_a_second_ctrl_c_while_the_node_stops_waits_for_it_too(tmp_path, gap_s):
    """Two SIGINTs a moment apart (GNU timeout forwards one twice; an impatient user): the
    second one cut the wait for the stopping node short, the interpreter exited under its
    running thread, and nng aborted the process (pthread_mutex_lock panic, heap corruption)."""
    code, text = _interrupt_a_waiting_join(tmp_path, (gap_s,))
    assert "node_stopped" in text and "KeyboardInterrupt" in text, text[-3000:]
    assert "panic" not in text and "corrupted" not in text, text[-3000:]
    assert code in (-signal.SIGINT, 1, 130), (code, text[-3000:])


TERMINATED = JOIN.replace("import os,", "import os, signal,") + """
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as the README tells a service to
print("LOOPING", flush=True)
try:
    while True:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
finally:
    swarm.close()
"""


def _sigterm_a_loop(tmp_path: Path, script: str, gaps: tuple[float, ...] = ()) -> tuple[int, str]:
    """Run `script` until it loops, send it SIGTERM once plus once after each of `gaps`
    seconds; its exit code and standard error."""
    path = tmp_path / "loop.py"
    path.write_text(script.format(wait=0, state=tmp_path / "state"))
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=err,
                                text=True)  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "LOOPING\n"
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            for gap in gaps:
                time.sleep(gap)
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(90)
        finally:
            proc.kill()
    return code, log.read_text()


@pytest.mark.parametrize("gap_s", [0.001, 0.02])
def test_two_sigterms_with_the_readmes_handler_still_stop_the_node_first(tmp_path, gap_s):
    """The README's SIGTERM handler raises SystemExit; a second SIGTERM while close() waited
    for the node cut the wait short (only Ctrl-C was held back), and the interpreter exited
    under the node's thread: nng's pthread_mutex_lock panic, no final checkpoint, no leave."""
    code, text = _sigterm_a_loop(tmp_path, TERMINATED, (gap_s,))
    # (143: the handler's exit; -15: the second SIGTERM came as the interpreter finished)
    assert code in (143, -signal.SIGTERM) and "node_stopped" in text, (code, text[-3000:])
    assert "panic" not in text and "terminate called" not in text, text[-3000:]


UNHANDLED = JOIN + """
print("LOOPING", flush=True)
while True:  # no handler, no close(), no finally: a script run by a scheduler that stops it
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_sigterm_to_a_script_without_a_handler_checkpoints_and_leaves(tmp_path):
    """SIGTERM (systemd, kill, a scheduler, timeout) ended a script that joined without its
    exit handlers: no final checkpoint, no leave, unless it had installed the README's handler.
    join installs one where the program has none."""
    code, text = _sigterm_a_loop(tmp_path, UNHANDLED)
    assert code == 143, (code, text[-3000:])
    assert "swarm_closed_at_exit" in text and "checkpoint_written" in text, text[-3000:]
    assert "node_stopped" in text and "panic" not in text, text[-3000:]


THREADED = JOIN.replace("import os,", "import os, threading,") + """
def train():
    while True:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
worker = threading.Thread(target=train)  # not a daemon: Python waits for it at exit
worker.start()
print("LOOPING", flush=True)
worker.join()
"""


def test_sigterm_to_a_script_training_in_a_thread_of_its_own_ends_it_too(tmp_path):
    """The main thread waits in join() on a (non-daemon) training thread: SIGTERM still ends
    the program (143) after the swarm is closed, the thread's next step raising LoopClosed."""
    code, text = _sigterm_a_loop(tmp_path, THREADED)
    assert code == 143, (code, text[-3000:])
    assert "node_stopped" in text and "panic" not in text, text[-3000:]


FORKS = JOIN + """
pid = os.fork()
if pid == 0:  # a child of the user's own that simply ends (it closes no swarm of the parent's)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), flush=True)
swarm.close()
print("CLOSED", flush=True)
"""


def test_a_forked_child_that_exits_leaves_the_parents_swarm_alone(tmp_path):
    """A child forked after join closed the parent's swarm at its exit, waiting for ever on the
    parent's node loop, which does not run in the child: the child hung."""
    path = tmp_path / "forks.py"
    path.write_text(FORKS.format(wait=0, state=tmp_path / "state"))
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == "CHILD 0\nCLOSED\n", run.stderr[-3000:]
    assert "swarm_closed_at_exit" not in run.stderr


OPEN_NODE = """
import sys, trio, geotrain
from pathlib import Path
from geotrain.node import Admission, Identity, config_from_toml
config = config_from_toml('''
[identity]
open_swarm = true
[training]
task = "synthetic-linreg"
threads = 1
[state]
status_every_s = 0.2
checkpoint_every = 1000000
''', base=Path('{state}'), overrides=['state.dir="{state}"'])

async def main():
    async with geotrain.open_node(config, identity=Identity.generate(),
                                  admission=Admission.open_swarm("geotrain")) as node:
        {wait}

try:
    trio.run(main)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("wait", [
    "await node.wait_stopped()",  # the README's program: until stopped
    "await trio.sleep_forever()",  # a block of its own that does not wait on the node
])  # fmt: skip
def test_ctrl_c_stops_a_node_run_by_open_node_cleanly_and_raises_keyboardinterrupt(
    tmp_path, wait
):
    """trio's KeyboardInterrupt landed in whichever of the node's tasks ran: no checkpoint, no
    node_stopped, and the caller got an exception group it could not catch as
    KeyboardInterrupt (a stranger's trial of the README's program)."""
    path, log = tmp_path / "program.py", tmp_path / "stderr.txt"
    path.write_text(OPEN_NODE.format(state=tmp_path / "state", wait=wait))
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=err,
                                text=True, preexec_fn=_default_sigint)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (tmp_path / "state" / "status.json").exists():  # it trains
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.1)
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=90)
        finally:
            proc.kill()
    text = log.read_text() + out  # (structlog unconfigured: its lines go to stdout)
    assert proc.returncode == 130 and out.endswith("INTERRUPTED\n"), (proc.returncode, text[-3000:])
    assert "checkpoint_written" in text and "node_stopped" in text, text[-3000:]
    assert list((tmp_path / "state" / "checkpoints").glob("ckpt-*"))
