# Node identity: an Ed25519 key whose public half names the node. Invariants: the peer ID is a pure
# function of the public key and can be turned back into it (so `swarm admit` takes either); key
# files are PEM (PKCS#8, unencrypted), created with mode 0600 and never overwritten; nothing here
# touches the network.
from __future__ import annotations

import base64
import os
import pathlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_ID_PREFIX = "gt"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
SHORT_ID_CHARS = 8  # of the base32 part: 40 bits, plenty to tell peers apart in logs


class KeyFileError(Exception):
    """A key or certificate file is missing, malformed, or would be overwritten."""


def peer_id_from_public_key(public_key: bytes) -> str:
    """The peer ID of a raw 32-byte Ed25519 public key: "gt" + lowercase base32, no padding."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"public key: {len(public_key)} bytes, expected {PUBLIC_KEY_BYTES}")
    return PEER_ID_PREFIX + base64.b32encode(public_key).decode("ascii").rstrip("=").lower()


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Inverse of `peer_id_from_public_key`.

    Raises:
        ValueError: `peer_id` is not a well-formed peer ID.
    """
    if not peer_id.startswith(PEER_ID_PREFIX) or len(peer_id) != 54:
        raise ValueError(f"peer ID {peer_id!r}: expected 'gt' followed by 52 base32 characters")
    body = peer_id[len(PEER_ID_PREFIX) :].upper() + "===="
    try:
        key = base64.b32decode(body)
    except ValueError as exc:
        raise ValueError(f"peer ID {peer_id!r}: not base32 ({exc})") from None
    if len(key) != PUBLIC_KEY_BYTES or peer_id_from_public_key(key) != peer_id:
        raise ValueError(f"peer ID {peer_id!r}: does not encode a 32-byte public key")
    return key


def short_id(peer_id: str) -> str:
    """The short form of a peer ID for logs (first 8 base32 characters)."""
    return peer_id[len(PEER_ID_PREFIX) : len(PEER_ID_PREFIX) + SHORT_ID_CHARS]


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public_key`."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def write_private_file(path: pathlib.Path, data: bytes) -> None:
    """Create `path` with mode 0600 and write `data`; refuse if it exists.

    Raises:
        KeyFileError: the file exists or cannot be created.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path}: already exists, refusing to overwrite") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot create ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def load_private_key(path: pathlib.Path) -> Ed25519PrivateKey:
    """Read an unencrypted PKCS#8 PEM Ed25519 private key.

    Raises:
        KeyFileError: unreadable, or not an Ed25519 private key.
    """
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: holds a {type(key).__name__}, expected an Ed25519 key")
    return key


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def raw_public_key(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True, eq=False)
class Identity:
    """A node's Ed25519 identity key. The caller owns the key; `save` never overwrites.

    Attributes:
        private_key: the Ed25519 signing key.
    """

    private_key: Ed25519PrivateKey

    def __post_init__(self) -> None:
        if not isinstance(self.private_key, Ed25519PrivateKey):
            raise TypeError(
                f"private_key: got {type(self.private_key).__name__}, expected Ed25519PrivateKey"
            )

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load an identity written by `save` (or `geotrain keygen`).

        Raises:
            KeyFileError: unreadable or not an Ed25519 key.
        """
        return cls(load_private_key(pathlib.Path(path)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key as PKCS#8 PEM with mode 0600.

        Raises:
            KeyFileError: the file exists or cannot be created.
        """
        write_private_file(pathlib.Path(path), private_key_pem(self.private_key))

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return raw_public_key(self.private_key)

    @property
    def peer_id(self) -> str:
        """The full peer ID (derived from the public key)."""
        return peer_id_from_public_key(self.public_key)

    @property
    def short_id(self) -> str:
        """The short peer ID for logs."""
        return short_id(self.peer_id)

    def sign(self, message: bytes) -> bytes:
        """An Ed25519 signature of `message`."""
        return self.private_key.sign(message)
