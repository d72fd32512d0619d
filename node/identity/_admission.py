# Swarm admission: an authority key signs expiring membership certificates; an `Admission` policy
# (certificate, allow-list or open) decides whether a peer whose identity key the handshake proved
# may join. Invariants: a certificate's signed bytes have one fixed layout (no pickle, no JSON
# canonicalisation games); `Admission.check` is pure (time comes in as `now`) and either returns or
# raises AdmissionRefused with the reason; key files are 0600 and never overwritten.
from __future__ import annotations

import base64
import json
import math
import os
import pathlib
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ._identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    KeyFileError,
    load_private_key,
    peer_id_from_public_key,
    private_key_pem,
    raw_public_key,
    verify_signature,
    write_private_file,
)

CERT_MAGIC = b"geotrain-cert-v1"
MAX_SWARM_ID_CHARS = 64
# Clocks of peers disagree; a certificate issued slightly "in the future" is still accepted.
CLOCK_SKEW_S = 300.0
AUTHORITY_KEY_FILE = "authority.key"
SWARM_FILE = "swarm.json"
CERT_FORMAT = "geotrain-membership-certificate-v1"


class AdmissionRefused(Exception):
    """A peer may not join: `reason` says why (missing, foreign, expired, forged, not listed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _check_swarm_id(swarm_id: str) -> None:
    if not isinstance(swarm_id, str) or not 1 <= len(swarm_id) <= MAX_SWARM_ID_CHARS:
        raise ValueError(f"swarm_id: {swarm_id!r}, expected a string of 1-64 characters")
    if not swarm_id.isascii() or not swarm_id.isprintable():
        raise ValueError(f"swarm_id: {swarm_id!r}, expected printable ASCII")


@dataclass(frozen=True)
class MembershipCertificate:
    """A signed statement "this public key belongs to this swarm until `expires_at`".

    Attributes:
        swarm_id: the swarm the peer is admitted to.
        peer_public_key: raw 32-byte Ed25519 key of the admitted peer.
        issued_at: POSIX seconds.
        expires_at: POSIX seconds; the certificate is refused from this instant on.
        signature: the authority's Ed25519 signature of `signed_bytes()`.
    """

    swarm_id: str
    peer_public_key: bytes
    issued_at: int
    expires_at: int
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_swarm_id(self.swarm_id)
        if len(self.peer_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"peer_public_key: {len(self.peer_public_key)} bytes, expected 32")
        if not 0 <= self.issued_at < self.expires_at < 2**62:
            raise ValueError(
                f"issued_at={self.issued_at}, expires_at={self.expires_at}: "
                "expected 0 <= issued_at < expires_at"
            )
        if len(self.signature) != SIGNATURE_BYTES:
            raise ValueError(f"signature: {len(self.signature)} bytes, expected 64")

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.peer_public_key)

    def signed_bytes(self) -> bytes:
        """The exact bytes the authority signs."""
        return signed_certificate_bytes(
            self.swarm_id, self.peer_public_key, self.issued_at, self.expires_at
        )

    def to_bytes(self) -> bytes:
        """Wire form: signed bytes followed by the 64-byte signature."""
        return self.signed_bytes() + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> MembershipCertificate:
        """Parse the wire form (does not verify the signature).

        Raises:
            ValueError: malformed.
        """
        magic_len = len(CERT_MAGIC)
        if len(data) < magic_len + 1 or data[:magic_len] != CERT_MAGIC:
            raise ValueError("certificate: bad magic")
        id_len = data[magic_len]
        expected = magic_len + 1 + id_len + PUBLIC_KEY_BYTES + 16 + SIGNATURE_BYTES
        if len(data) != expected:
            raise ValueError(f"certificate: {len(data)} bytes, expected {expected}")
        at = magic_len + 1
        try:
            swarm_id = data[at : at + id_len].decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("certificate: swarm ID is not ASCII") from None
        at += id_len
        key = data[at : at + PUBLIC_KEY_BYTES]
        issued, expires = struct.unpack_from(">qq", data, at + PUBLIC_KEY_BYTES)
        return cls(swarm_id, bytes(key), issued, expires, bytes(data[-SIGNATURE_BYTES:]))

    def save(self, path: str | os.PathLike[str], *, renew: bool = False) -> None:
        """Write as JSON (readable fields plus the base64 wire form); refuses to overwrite,
        unless `renew`: then `path` must hold a certificate of the same peer and swarm, which is
        replaced in one rename (a node watching the file reads the old or the new one whole).

        Raises:
            KeyFileError: the file exists (renew: does not, or holds something else).
        """
        doc = {
            "format": CERT_FORMAT,
            "swarm_id": self.swarm_id,
            "peer_id": self.peer_id,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "certificate": base64.b64encode(self.to_bytes()).decode("ascii"),
        }
        data, target = (json.dumps(doc, indent=2) + "\n").encode(), pathlib.Path(path)
        if not renew:
            write_private_file(target, data)
            return
        if not target.exists():
            raise KeyFileError(f"{target}: no certificate there to renew (leave out --renew)")
        old = MembershipCertificate.load(target)  # KeyFileError: not a certificate
        if (old.peer_id, old.swarm_id) != (self.peer_id, self.swarm_id):
            raise KeyFileError(f"{target}: holds the certificate of peer {old.peer_id} in "
                               f"swarm {old.swarm_id}, not this one's: refusing to replace it")
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        write_private_file(temp, data)
        os.replace(temp, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MembershipCertificate:
        """Read a file written by `save`.

        Raises:
            KeyFileError: unreadable or malformed.
        """
        doc = _read_json(pathlib.Path(path), CERT_FORMAT)
        try:
            return cls.from_bytes(base64.b64decode(doc["certificate"], validate=True))
        except (KeyError, ValueError, TypeError) as exc:
            raise KeyFileError(f"{path}: not a membership certificate ({exc})") from None


def signed_certificate_bytes(
    swarm_id: str, peer_public_key: bytes, issued_at: int, expires_at: int
) -> bytes:
    sid = swarm_id.encode("ascii")
    return (
        CERT_MAGIC
        + bytes([len(sid)])
        + sid
        + peer_public_key
        + struct.pack(">qq", issued_at, expires_at)
    )


def _read_json(path: pathlib.Path, fmt: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise KeyFileError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise KeyFileError(f"{path}: expected a JSON object with format {fmt!r}")
    return doc


@dataclass(frozen=True)
class SwarmInfo:
    """What members need to check certificates: the swarm ID and the authority public key."""

    swarm_id: str
    authority_public_key: bytes

    def __post_init__(self) -> None:
        _check_swarm_id(self.swarm_id)
        if len(self.authority_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(
                f"authority_public_key: {len(self.authority_public_key)} bytes, expected 32"
            )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as JSON; refuses to overwrite."""
        doc = {
            "format": "geotrain-swarm-v1",
            "swarm_id": self.swarm_id,
            "authority_public_key": base64.b64encode(self.authority_public_key).decode("ascii"),
        }
        write_private_file(pathlib.Path(path), (json.dumps(doc, indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmInfo:
        """Read a file written by `save` (a swarm directory's swarm.json).

        Raises:
            KeyFileError: unreadable or malformed.
        """
        doc = _read_json(pathlib.Path(path), "geotrain-swarm-v1")
        try:
            key = base64.b64decode(doc["authority_public_key"], validate=True)
            return cls(doc["swarm_id"], key)
        except (KeyError, ValueError, TypeError) as exc:
            raise KeyFileError(f"{path}: not a swarm file ({exc})") from None


@dataclass(frozen=True, eq=False)
class SwarmAuthority:
    """The operator's key that admits members. Whoever holds it decides who joins."""

    swarm_id: str
    private_key: Ed25519PrivateKey

    def __post_init__(self) -> None:
        _check_swarm_id(self.swarm_id)

    @classmethod
    def generate(cls, swarm_id: str | None = None) -> SwarmAuthority:
        """A fresh authority with a random 128-bit swarm ID (hex) unless one is given."""
        return cls(swarm_id or secrets.token_hex(16), Ed25519PrivateKey.generate())

    @property
    def info(self) -> SwarmInfo:
        return SwarmInfo(self.swarm_id, raw_public_key(self.private_key))

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write authority.key (0600) and swarm.json into `directory` (created if missing).

        Raises:
            KeyFileError: either file exists already.
        """
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name in (AUTHORITY_KEY_FILE, SWARM_FILE):
            if (d / name).exists():
                raise KeyFileError(f"{d / name}: already exists, refusing to overwrite")
        write_private_file(d / AUTHORITY_KEY_FILE, private_key_pem(self.private_key))
        self.info.save(d / SWARM_FILE)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> SwarmAuthority:
        """Load an authority saved by `save` (or `geotrain swarm init`).

        Raises:
            KeyFileError: missing or malformed files, or a key that does not match swarm.json.
        """
        d = pathlib.Path(directory)
        info = SwarmInfo.load(d / SWARM_FILE)
        key = load_private_key(d / AUTHORITY_KEY_FILE)
        if raw_public_key(key) != info.authority_public_key:
            raise KeyFileError(f"{d}: authority.key does not match swarm.json")
        return cls(info.swarm_id, key)

    def admit(
        self, peer_public_key: bytes, *, expires_in_s: float, now: float
    ) -> MembershipCertificate:
        """Sign a certificate for `peer_public_key`, valid from `now` for `expires_in_s` seconds."""
        if not expires_in_s > 0:
            raise ValueError(f"expires_in_s: {expires_in_s}, expected > 0")
        issued = int(now)
        expires = int(now + expires_in_s)
        signed = signed_certificate_bytes(self.swarm_id, peer_public_key, issued, expires)
        return MembershipCertificate(
            self.swarm_id, peer_public_key, issued, expires, self.private_key.sign(signed)
        )


AdmissionMode = Literal["certificate", "allow_list", "open"]


@dataclass(frozen=True)
class Admission:
    """Who may join, and what this node presents to prove it may.

    Build one with `with_certificate`, `with_allow_list` or `open_swarm`. `swarm_id` goes into the
    handshake prologue, so nodes of different swarms cannot even finish a handshake.
    """

    mode: AdmissionMode
    swarm_id: str
    authority_public_key: bytes = b""
    certificate: MembershipCertificate | None = None
    allowed_peer_ids: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _check_swarm_id(self.swarm_id)
        if self.mode == "certificate":
            if self.certificate is None or len(self.authority_public_key) != PUBLIC_KEY_BYTES:
                raise ValueError("mode 'certificate': needs a certificate and the authority key")
            if self.certificate.swarm_id != self.swarm_id:
                raise ValueError(
                    f"certificate: for swarm {self.certificate.swarm_id!r}, "
                    f"expected {self.swarm_id!r}"
                )
        elif self.mode == "allow_list":
            if not self.allowed_peer_ids:
                raise ValueError("allowed_peer_ids: empty, expected at least one peer ID")
        elif self.mode != "open":
            raise ValueError(f"mode: {self.mode!r}, expected certificate, allow_list or open")

    @classmethod
    def with_certificate(cls, swarm: SwarmInfo, certificate: MembershipCertificate) -> Admission:
        """Members prove membership with certificates signed by `swarm`'s authority."""
        return cls("certificate", swarm.swarm_id, swarm.authority_public_key, certificate)

    @classmethod
    def with_allow_list(cls, swarm_id: str, peer_ids: Iterable[str]) -> Admission:
        """Only the listed peer IDs may connect (both ways)."""
        return cls("allow_list", swarm_id, allowed_peer_ids=frozenset(peer_ids))

    @classmethod
    def open_swarm(cls, swarm_id: str) -> Admission:
        """Anyone who knows the swarm ID may connect. Only behind an explicit flag."""
        return cls("open", swarm_id)

    @property
    def prologue(self) -> bytes:
        return b"geotrain/1/swarm/" + self.swarm_id.encode("ascii")

    def credential(self) -> bytes:
        """What this node presents in the handshake (its certificate, or nothing)."""
        return self.certificate.to_bytes() if self.certificate is not None else b""

    def check(self, peer_public_key: bytes, credential: bytes, now: float) -> float:
        """Admit the peer whose identity key the handshake proved, or raise.

        Returns:
            Until when the admission holds (the certificate's expiry; infinity otherwise).

        Raises:
            AdmissionRefused: with the reason.
        """
        if self.mode == "open":
            return math.inf
        if self.mode == "allow_list":
            if peer_id_from_public_key(peer_public_key) not in self.allowed_peer_ids:
                raise AdmissionRefused("peer is not on the allow-list")
            return math.inf
        return self._check_certificate(peer_public_key, credential, now)

    def _check_certificate(self, peer_public_key: bytes, credential: bytes, now: float) -> float:
        if not credential:
            raise AdmissionRefused("no membership certificate presented")
        try:
            cert = MembershipCertificate.from_bytes(credential)
        except ValueError as exc:
            raise AdmissionRefused(f"malformed certificate: {exc}") from None
        if cert.swarm_id != self.swarm_id:
            raise AdmissionRefused(f"certificate is for another swarm ({cert.swarm_id!r})")
        if not verify_signature(self.authority_public_key, cert.signature, cert.signed_bytes()):
            raise AdmissionRefused("certificate signature is not the swarm authority's")
        if cert.peer_public_key != peer_public_key:
            raise AdmissionRefused("certificate names another peer")
        if now >= cert.expires_at:
            raise AdmissionRefused("certificate expired")
        if cert.issued_at > now + CLOCK_SKEW_S:
            raise AdmissionRefused("certificate issued in the future")
        return float(cert.expires_at)
