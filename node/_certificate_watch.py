# A node's own membership certificate over its lifetime. Invariants: the node says ahead of time
# that its certificate is running out (once a day before, once an hour before), says plainly at
# expiry what happened and what to do (the transport stops dialling from then on: no peer would
# admit it), and picks up a renewed certificate file without a restart; a file that does not hold
# a valid certificate for this identity and swarm, signed by the swarm's authority and not yet
# expired, is refused with a logged reason and changes nothing. All of it runs on the node's loop.
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from .identity import Admission, AdmissionRefused, Identity, KeyFileError, MembershipCertificate
from .transport import Transport, TransportError

log = structlog.get_logger()

WARN_AHEAD_S = (86400.0, 3600.0)  # a day and an hour before expiry
CHECK_EVERY_S = 5.0


def renew_hint(peer_id: str, path: Path | None, running: bool = True) -> str:
    """What to do about an expiring certificate (a running node reloads its file by itself)."""
    where = f"replace {path}" if path is not None else "pass the new certificate to the node"
    then = ("; the node picks it up without a restart" if running and path is not None
            else ", then start the node again")  # fmt: skip
    return (f"ask the swarm operator for a renewed certificate (geotrain swarm admit --swarm "
            f"AUTHORITY_DIR {peer_id} --expires 30d --renew --out CERT_FILE) and "
            f"{where}{then}")  # fmt: skip


def utc(posix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(posix_s))


class CertificateWatch:
    """Warns before the node's certificate expires and loads a renewed one from its file.

    Args:
        transport: whose credential is renewed; it knows the certificate in use.
        identity, admission: the node's key and its admission (certificate mode; others are
            left alone: nothing expires).
        path: the certificate file to watch (None: only warn, e.g. a library node given its
            admission directly).
        clock: wall clock (POSIX seconds).
    """

    def __init__(self, transport: Transport, identity: Identity, admission: Admission,
                 path: Path | None, clock: Callable[[], float] = time.time,
                 check_every_s: float | None = None) -> None:  # fmt: skip
        self._transport, self._identity, self._admission = transport, identity, admission
        self._path, self._clock = path, clock
        self._every = CHECK_EVERY_S if check_every_s is None else check_every_s
        self._warned: set[float] = set()
        self._said_expired = False
        self._file_seen = self._file_key()

    @property
    def active(self) -> bool:
        return self._admission.certificate is not None

    async def run(self) -> None:
        if not self.active:
            return
        while True:
            self.check()
            await trio.sleep(self._every)

    def check(self) -> None:
        """Reload the file if it changed, then warn or say it expired (each once)."""
        self._reload()
        expires_at = self._transport.certificate_expires_at
        if expires_at is None:
            return
        left = expires_at - self._clock()
        hint = renew_hint(self._identity.peer_id, self._path)
        if left <= 0:
            if not self._said_expired:
                self._said_expired = True
                log.error("certificate_expired", expired_at=utc(expires_at),
                          effect="no peer admits this node; it stopped dialling",
                          renew=hint)  # fmt: skip
            return
        for ahead in sorted(WARN_AHEAD_S):  # the most urgent first: one warning, not two
            if left <= ahead and ahead not in self._warned:
                self._warned.update(a for a in WARN_AHEAD_S if a >= ahead)
                log.warning("certificate_expires_soon", expires_at=utc(expires_at),
                            in_hours=round(left / 3600, 2), renew=hint)  # fmt: skip

    def _file_key(self) -> tuple[int, int] | None:
        if self._path is None:
            return None
        try:
            st = self._path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _reload(self) -> None:
        key = self._file_key()
        if key is None or key == self._file_seen:
            return
        self._file_seen = key
        current = self._transport.certificate_expires_at or 0.0
        try:
            cert = MembershipCertificate.load(self._path)  # type: ignore[arg-type]
            if cert.peer_public_key != self._identity.public_key:
                raise AdmissionRefused("issued to another key than this node's")
            admission = dataclasses.replace(self._admission, certificate=cert)
            admission.check(self._identity.public_key, cert.to_bytes(), self._clock())
            if cert.expires_at <= current:
                log.info("certificate_file_changed", note="not newer than the one in use",
                         expires_at=utc(cert.expires_at))  # fmt: skip
                return
            self._transport.renew(admission)
        except (KeyFileError, ValueError, AdmissionRefused, TransportError) as exc:
            log.warning("certificate_file_refused", path=str(self._path),
                        reason=getattr(exc, "reason", str(exc)))  # fmt: skip
            return
        self._admission = admission
        self._warned.clear()
        self._said_expired = False
        log.info("certificate_renewed", expires_at=utc(cert.expires_at))
