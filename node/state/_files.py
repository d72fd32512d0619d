# Files written whole or not at all. Invariant: after a crash a reader finds either the old file
# or the new one, never a mix (temp file in the same folder, fsync, rename, fsync of the folder).
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# the name of write_atomically's temporary file (mkstemp's 8 random characters)
_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def left_temp_files(directory: Path) -> list[Path]:
    """The temporary files write_atomically left in `directory` when its process was killed
    mid-write (a whole checkpoint's size each; hidden from a plain `ls`)."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return [p for p in entries if _TEMP_NAME.fullmatch(p.name) and p.is_file()]


def write_atomically(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one.

    Args:
        data: the bytes, or a function that writes them to the open file (so a big file can be
            written piece by piece, never held whole).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
