# A fork server for `geotrain node run` processes (LocalSwarm's with fork_server=True, and the
# testbed's): one warm process that has imported torch, torch._dynamo (which torch.optim imports
# on an optimizer's first use) and geotrain, and forks a node for each request. A node then
# starts in ~0.1 s of CPU instead of ~4 s. The child is a real process of its own session, in the
# network namespace asked for, that runs the CLI's own entry point as `python -m geotrain.node
# ARGS` would: signals, sockets, exit codes and files are the same. Invariants: the server forks
# only while it is single-threaded in Python (torch's and numpy's own pools are fork-safe, as
# DataLoader workers rely on); it is started with the exact environment its nodes get, so
# anything read at import time matches; a child's environment, cwd, sys.path, argv and global
# random seeds are its own; when its client goes away (pipe closed), the server kills every
# process it forked and exits, so nothing outlives the process that asked for them.
from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

MODULE = "geotrain.node"
ANSWER_TIMEOUT_S = 180.0


def _warm() -> None:
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it: 1-1.5 s)

    import geotrain.node.cli  # noqa: F401


def _child(request: dict[str, Any], base_path: list[str], ready: int) -> None:
    """In the forked child: become the node `request` asks for, run it, exit. Never returns.
    A byte on `ready` says it leads its own session (so its group can be signalled)."""
    code: int = 1
    try:
        os.setsid()
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.write(ready, b"1")
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 1 << 16)  # the server's pipes and selector are not the node's
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *base_path]
        module = request.get("module", MODULE)
        sys.argv = [module, *request["args"]]
        import numpy
        import torch

        numpy.random.seed()  # a fresh process's global generators differ from its siblings'
        torch.seed()
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # what a fresh interpreter would print, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _enter_netns(name: str) -> None:
    """Join network namespace `name` (as `ip netns exec NAME` does for the network; root)."""
    import ctypes

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def serve() -> None:
    """The server's loop: JSON lines in on stdin, JSON lines out on stdout (see ForkServer)."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # nothing printed by an import reaches the protocol
    _warm()
    base_path = [p for p in sys.path if p not in ("", os.getcwd())]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()

    def send(message: dict) -> None:
        os.write(proto_out, json.dumps(message).encode() + b"\n")

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    sel = selectors.DefaultSelector()
    sel.register(proto_in, selectors.EVENT_READ, "in")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    buf = b""
    try:
        while True:
            for key, _ in sel.select():
                if key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                    reap()
                    continue
                data = os.read(proto_in, 1 << 16)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    request = json.loads(line)
                    if threading.active_count() != 1:
                        send({"error": "the fork server runs threads: not forking"})
                        continue
                    for stream in (sys.stdout, sys.stderr):
                        stream.flush()
                    ready_r, ready_w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        _child(request, base_path, ready_w)
                    os.close(ready_w)
                    os.read(ready_r, 1)  # (b"" if it died first: its exit comes as usual)
                    os.close(ready_r)
                    children.add(pid)
                    send({"pid": pid})
            reap()
    finally:
        for pid in children:  # the client is gone: so are its nodes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


class ForkServer:
    """The client: starts the server with `env` and asks it for nodes.

    One per environment (see `for_env`); the server lives until this process exits or `close()`.
    """

    _by_env: dict[tuple, ForkServer] = {}
    _lock = threading.Lock()

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.proc: subprocess.Popen | None = None  # (started by the first spawn)
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()
        self._buf = b""

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "geotrain.node._forkserver"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )  # fmt: skip
        return self.proc

    @classmethod
    def for_env(cls, env: dict[str, str]) -> ForkServer:
        key = tuple(sorted(env.items()))
        with cls._lock:
            server = cls._by_env.get(key)
            if server is None or (server.proc is not None and server.proc.poll() is not None):
                server = cls._by_env[key] = cls(env)
                atexit.register(server.close)
            return server

    def _read(self, timeout: float | None) -> dict | None:
        """One message (None when none came within `timeout`)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if not sel.select(timeout):
                    return None
            data = os.read(fd, 1 << 16)
            if not data:
                raise RuntimeError("the fork server exited")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _dispatch(self, message: dict) -> dict | None:
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
            return None
        return message

    def spawn(
        self, args: list[str], log: str, cwd: str | None = None, module: str = MODULE,
        netns: str | None = None, env: dict[str, str] | None = None,
    ) -> ForkedProcess:
        """Fork `python -m MODULE ARGS` (geotrain's CLI by default) in `cwd` (ours by default),
        its stdout and stderr appended to `log`; inside network namespace `netns` if given;
        with `env` (the server's by default: one that differs in what a module reads at import
        time gets what the server read)."""
        request = {"args": args, "log": log, "cwd": cwd or os.getcwd(),
                   "env": self.env if env is None else env, "module": module,
                   "netns": netns}  # fmt: skip
        with self.lock:
            proc = self._started()
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            while True:  # (the first answer waits for the server's imports: a busy box's 2 cores)
                message = self._read(ANSWER_TIMEOUT_S)
                if message is None:
                    raise RuntimeError(f"the fork server did not answer in {ANSWER_TIMEOUT_S} s")
                reply = self._dispatch(message)
                if reply is not None:
                    break
        if "error" in reply:
            raise RuntimeError(f"fork server: {reply['error']}")
        self.exits.pop(reply["pid"], None)  # (an earlier child's, whose pid the kernel reused)
        return ForkedProcess(self, reply["pid"])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """`pid`'s exit code once the server reaped it; None if not within `timeout` (0: now)."""
        with self.lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while pid not in self.exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                message = self._read(left)
                if message is None:
                    return None
                self._dispatch(message)
            return self.exits[pid]

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server; every process it forked that still runs is killed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ForkedProcess:
    """What a node forked by a ForkServer offers of subprocess.Popen's interface."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(MODULE, timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve()
