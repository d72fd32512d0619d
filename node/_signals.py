# Every way a signal stops a node, in one place: the daemon's (`geotrain node run`: SIGINT,
# SIGTERM, SIGHUP), the in-process node's (`open_node`: Ctrl-C) and the library's (geotrain.join:
# SIGTERM). Invariants: the first stop signal asks for a clean stop (exchange finished or
# abandoned, checkpoint, leave); only a repeated one cuts that short; a handler the program set
# itself is never replaced; nothing here is installed off the main thread.
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Protocol

import structlog
import trio

log = structlog.get_logger()

# A second signal this soon after the first is the same one delivered twice (timeout(1) and
# process-group kills send it to the process and to its group): it is not a second request.
DUPLICATE_SIGNAL_S = 0.5


class Stoppable(Protocol):
    def request_stop(self) -> None: ...

    async def wait_stopped(self) -> None: ...


# -- the daemon ---------------------------------------------------------------------------------
def stop_signals() -> tuple[int, ...]:
    """What stops a daemon gracefully: SIGINT, SIGTERM, and SIGHUP (a node started in an ssh
    session without nohup gets it at logout, and would die without its checkpoint or a leave)
    unless it was ignored when the process started: under nohup the node is meant to outlive
    the terminal. Read before the node ignores them itself."""
    hup_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM) + (() if hup_ignored else (signal.SIGHUP,))


def ignore_signals(signals: tuple[int, ...]) -> dict[int, Any]:
    """Ignore `signals` (outside a signal receiver, which restores this when it closes: a
    second SIGTERM after the node stopped, from a supervisor or timeout, would kill a cleanly
    stopped node with 143). Returns the handlers to put back with restore_signals."""
    return {s: signal.signal(s, signal.SIG_IGN) for s in signals}


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def terminals() -> tuple[int, ...]:
    """Which of stdout and stderr are a terminal (asked at start: a hung-up one cannot say)."""
    ttys = []
    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError):
            if os.isatty(fd):
                ttys.append(fd)
    return tuple(ttys)


def _detach(ttys: tuple[int, ...]) -> None:
    """After a hangup, writes to the terminal fail (EIO), and the node's first log line on its
    way out would fail it, checkpoint and leave unwritten: what went there goes nowhere now."""
    if not ttys:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in ttys:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


async def stop_on_signals(node: Stoppable, signals: tuple[int, ...], ttys: tuple[int, ...],
                          run_scope: trio.CancelScope) -> None:  # fmt: skip
    """The first of `signals` stops `node` gracefully (checkpoint, leave), a second cancels
    `run_scope` (what the node waits for), and a third exits at once: a step running in a
    worker thread cannot be cancelled, and a node inside a very long step would ignore every
    later signal. A SIGHUP also points `ttys` (the fds that were a terminal) at /dev/null."""
    requested_at, forced = None, False
    with trio.open_signal_receiver(*signals) as received:
        async for signum in received:
            name, now = signal.Signals(signum).name, trio.current_time()
            if signum == signal.SIGHUP:
                _detach(ttys)
            if requested_at is None:
                requested_at = now
                node.request_stop()  # (first: nothing below may keep it from happening)
                log.info("stop_requested", signal=name)
            elif now - requested_at < DUPLICATE_SIGNAL_S:
                continue
            elif not forced:
                forced = True
                log.warning("stop_forced", signal=name,
                            hint="another signal exits at once, without a checkpoint")
                run_scope.cancel()
            else:
                log.error("stop_immediate", signal=name)
                os._exit(128 + signum)  # (the node's threads may be mid-step)


def ignore_stop_signals_at_exit() -> None:
    """For the console script once `main` returned: SIGINT, SIGTERM and SIGHUP ignored for the
    interpreter's exit, which takes ~0.75 s with torch's threads; a second SIGTERM there (a
    supervisor's, timeout's) would kill a cleanly stopped node with 143."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


# -- a node inside the caller's trio program (open_node) ----------------------------------------
async def stop_on_ctrl_c(node: Stoppable, watching: trio.CancelScope, interrupted: trio.Event,
                         then_cancel: trio.CancelScope) -> None:  # fmt: skip
    """Ctrl-C asks `node` to stop cleanly (trio's own KeyboardInterrupt would land in whichever
    of the node's tasks ran, taking the node down without a checkpoint or a goodbye, and reach
    the caller wrapped in an exception group): `interrupted` is set, and once the node has
    stopped `then_cancel` is cancelled; the caller raises KeyboardInterrupt. A second Ctrl-C is
    trio's again: at once. Left alone where SIGINT is not trio's (a program's own handler or
    signal receiver) or off the main thread; `watching` ends the watch."""
    handler = signal.getsignal(signal.SIGINT)
    if not getattr(handler, "__qualname__", "").startswith("KIManager."):
        return
    with watching:
        try:
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    interrupted.set()
                    log.warning("interrupted", signal="SIGINT",
                                detail="the node stops cleanly (checkpoint, leave); the block "
                                "then raises KeyboardInterrupt; Ctrl-C again stops at "
                                "once")  # fmt: skip
                    node.request_stop()
                    break
        except RuntimeError:  # not the main thread: trio catches no signal there
            return
    if interrupted.is_set():
        await node.wait_stopped()
        then_cancel.cancel()  # the block too: a loop of its own ends


# -- the library (geotrain.join) ----------------------------------------------------------------
def _sigterm_exits(signum: int, frame: Any) -> None:
    from .training import exit_or_defer  # (here: `geotrain status` imports this module, not torch)

    exit_or_defer(128 + signum)  # (after a mix the loop's thread is applying, not mid-way)


def exit_on_sigterm() -> None:
    """SIGTERM (systemd, `kill`, a scheduler, `timeout`) would end a program that joined
    without its exit handlers: the node cut off, no checkpoint, no leave. A program without a
    SIGTERM handler of its own gets one that exits (143) as the end of a script does, closing
    its swarms; set in the main thread only (Python runs handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _sigterm_exits)


def default_sigterm() -> None:
    """Put SIGTERM's default back where exit_on_sigterm set it (once no swarm is open)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is _sigterm_exits:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
