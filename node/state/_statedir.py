# The one owner of a node's state-directory layout. Invariant: every path a node reads or writes
# under its state directory is named here, nowhere else.
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

from ._files import left_temp_files

LOCK_TRIES = 10  # 0.5 s in all

# The lock files this process holds. A forked child (a DataLoader worker, a user's subprocess
# started by fork) closes its copies at once: a flock belongs to the open file, so a child still
# running with a copy would keep the directory locked after the node closed (its next join on
# the same directory refused as "in use").
_HELD: weakref.WeakSet[BinaryIO] = weakref.WeakSet()


def _close_inherited_locks() -> None:
    for f in list(_HELD):
        f.close()  # the child's copy only: the parent's lock stays
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


@dataclass(frozen=True)
class StateDir:
    """Paths inside a node's state directory.

    Layout:
        checkpoints/ckpt-<step>.safetensors   model, optimizer, error feedback, link estimates
        metrics.jsonl                         one JSON object per line, appended while running
        status.json                           the latest status snapshot, replaced atomically
        node.json                             who is running here: peer ID, address, pid
        privacy.json                          [privacy]: the budget spent, recorded before each
                                              block of private steps is taken (a killed node's
                                              checkpoint forgot the steps after it)
        lock                                  held (flock) by the node running here, if any
    """

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def node_info(self) -> Path:
        return self.root / "node.json"

    @property
    def privacy_ledger(self) -> Path:
        return self.root / "privacy.json"

    @property
    def lock_path(self) -> Path:
        return self.root / "lock"

    def lock(self) -> BinaryIO | None:
        """Take the directory for this process: an exclusive flock on `lock` (with our pid in
        it), released when the returned file is closed or the process ends, however it ends;
        a child forked from this process does not hold it.
        None where the filesystem has no flock (the node runs unguarded there).

        Raises:
            StateDirInUse: another node holds it (two nodes on one directory overwrote each
                other's checkpoints and status unnoticed).
            OSError: the lock file cannot be made.
        """
        for attempt in range(LOCK_TRIES):  # a `geotrain status` may hold it for a moment
            try:
                f = open(self.lock_path, "a+b")  # noqa: SIM115 (held open for the node's life)
            except FileNotFoundError:  # a node refused at start removed the directory just now
                if attempt == LOCK_TRIES - 1:
                    raise
                self.root.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if attempt == LOCK_TRIES - 1:
                    self._refuse_in_use(f)
                f.close()  # (opened again: the holder may remove this file as it gives up)
                time.sleep(0.05)
                continue
            except OSError as exc:
                f.close()
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return None  # no flock on this filesystem (some network mounts)
                raise
            except BaseException:
                f.close()
                raise
            if not self._is_lock_file(f):  # unlinked between our open and our flock by a node
                f.close()  # refused at start (remove_unused): a lock on it guards nothing
                continue
            try:
                f.truncate(0)
                f.write(f"{os.getpid()}\n".encode())
                f.flush()
            except BaseException:
                f.close()
                raise
            _HELD.add(f)
            return f
        raise StateDirInUse(f"state.dir = {str(self.root)!r}: its lock file was replaced "
                            f"{LOCK_TRIES} times while this node tried to take it")  # fmt: skip

    def _is_lock_file(self, f: BinaryIO) -> bool:
        """Whether the open file `f` is the one at lock_path now."""
        try:
            now = os.stat(self.lock_path)
        except FileNotFoundError:
            return False
        held = os.fstat(f.fileno())
        return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def _refuse_in_use(self, f: BinaryIO) -> NoReturn:
        """StateDirInUse naming who holds the lock of `f` (closed here)."""
        f.seek(0)
        holder = f.read(32).decode("ascii", "replace").strip() or "unknown"
        f.close()
        if holder == str(os.getpid()):  # a notebook's cell run again, a second join
            raise StateDirInUse(
                f"state.dir = {str(self.root)!r} is in use by a node of this process: "
                "close() the swarm that joined with it first (or give this one a state "
                "directory of its own)") from None  # fmt: skip
        if holder == str(os.getppid()):  # join() in a forked child: a DataLoader worker
            raise StateDirInUse(
                f"state.dir = {str(self.root)!r} is in use by this process's parent (pid "
                f"{holder}), which joined with it: join once, in the main process, before "
                "forking (a DataLoader worker must not call join)") from None  # fmt: skip
        raise StateDirInUse(
            f"state.dir = {str(self.root)!r} is in use by another node (pid {holder}): "
            "each node needs a state directory of its own"
        ) from None

    def locked(self) -> bool:
        """Whether a node holds the directory now (a status that says running may be stale)."""
        try:
            with open(self.lock_path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # no lock file: no node of this version ran here
            return False
        return False

    def create(self) -> StateDir:
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        return self

    def remove_left_temp_files(self) -> tuple[int, int]:
        """Remove the temporary files an earlier node here left when it was killed mid-write
        (a checkpoint's, status.json's): (how many, their bytes). Call it holding the lock: a
        running node's temporary file is in use."""
        count = size = 0
        for path in left_temp_files(self.root) + left_temp_files(self.checkpoints):
            with contextlib.suppress(OSError):
                nbytes = path.stat().st_size
                path.unlink()
                count, size = count + 1, size + nbytes
        return count, size

    def remove_unused(self) -> None:
        """Remove what `create` and `lock` made, for a node refused before it wrote anything
        (a config that does not fit its memory budget left a state/ with a lock and an empty
        checkpoints/). Call it holding the lock; whatever else lies there is kept.

        checkpoints/ goes first, while the lock still guards it: a node that takes the directory
        once the lock file is gone (lock() retries on a file unlinked under it) makes its own."""
        with contextlib.suppress(OSError):
            self.checkpoints.rmdir()  # (only when empty)
        with contextlib.suppress(OSError):
            self.lock_path.unlink(missing_ok=True)
            self.root.rmdir()  # (only when empty: a node taking it now made a lock file there)


class StateDirInUse(ValueError):
    """Another node runs on this state directory (of another process, this process, or its
    parent: `join` called in a forked child)."""
