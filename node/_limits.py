# The process's open-files limit. Invariant: raised once, at a node's start, never lowered.
from __future__ import annotations

import os

import structlog

try:
    import resource
except ImportError:  # (not on every platform)
    resource = None  # type: ignore[assignment]

log = structlog.get_logger("geotrain.node")

# the soft limit a node raises its process's to, where the hard limit allows
OPEN_FILES_WANTED = 65536


def raise_open_files_limit() -> None:
    """Raise the process's soft limit on open files towards its hard limit (at most
    OPEN_FILES_WANTED). nng accepts every TCP connection before it knows whether a peer is
    behind it, and holds an idle one for up to ~16 s: 400 idle connections took all 256 of a
    node's descriptors, and every checkpoint written meanwhile failed (EMFILE). The common soft
    limit (1024) is far below the hard one (often 524288 under systemd). Process-wide."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("open_files_limit_kept", limit=soft, wanted=wanted, error=str(exc))
            return
        log.debug("open_files_limit_raised", limit=wanted, was=soft)


def open_files() -> tuple[int | None, int | None]:
    """(descriptors this process has open, its soft limit); None where not known."""
    try:
        count: int | None = len(os.listdir("/proc/self/fd")) - 1  # (less listdir's own)
    except OSError:
        count = None
    if resource is None:
        return count, None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return count, None if soft == resource.RLIM_INFINITY else soft
