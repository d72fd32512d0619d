# Text corpora for the language-model tasks. Invariants: nothing is downloaded; the same directory
# gives the same bytes on every node (files in sorted path order, each read whole up to the cap).
from __future__ import annotations

import sysconfig
from pathlib import Path

MIN_CORPUS_BYTES = 10_000


def stdlib_corpus(max_bytes: int, directory: str | None = None, pattern: str = "*.py") -> bytes:
    """Up to `max_bytes` of text: the files matching `pattern` under `directory` (default:
    Python's own standard library, its .py sources), concatenated in sorted path order.

    Raises:
        ValueError: `directory` is not a directory, or holds fewer than 10,000 bytes of such files.
    """
    root = Path(directory) if directory else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"training.params.corpus={str(root)!r}: not a directory")
    chunks, total = [], 0
    for path in sorted(root.rglob(pattern)):
        if "site-packages" in path.parts or total >= max_bytes or not path.is_file():
            continue
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    if total < MIN_CORPUS_BYTES:
        raise ValueError(
            f"training.params.corpus={str(root)!r}: fewer than 10,000 bytes of {pattern} text"
        )
    return b"".join(chunks)
