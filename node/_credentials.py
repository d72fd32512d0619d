# A node's credentials from its config: the identity key and how it admits peers. Invariants: a
# missing or unreadable file, or a certificate issued to another key, is a ConfigError naming the
# field, raised before anything starts.
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from ._config import ConfigError, IdentityConfig, NodeConfig
from .identity import Admission, Identity, KeyFileError, MembershipCertificate, SwarmInfo

T = TypeVar("T")
log = structlog.get_logger()


def admission_from_config(cfg: IdentityConfig) -> Admission:
    """Build the admission policy the config names.

    Raises:
        ConfigError: a file is missing or unreadable, or the pieces do not fit together.
    """
    if cfg.swarm is not None and cfg.certificate is not None:
        swarm = _load("identity.swarm", cfg.swarm, SwarmInfo.load)
        cert = _load("identity.certificate", cfg.certificate, MembershipCertificate.load)
        try:
            return Admission.with_certificate(swarm, cert)
        except ValueError as exc:
            raise ConfigError(f"identity: {exc}") from exc
    try:
        if cfg.allow:
            return Admission.with_allow_list(cfg.swarm_id, cfg.allow)
        return Admission.open_swarm(cfg.swarm_id)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"identity: {exc}") from exc


def _load(field: str, path: Path, load: Callable[[Path], T]) -> T:
    """`load(path)`, or a ConfigError naming the field and the file (an empty, truncated or
    malformed file was a KeyFileError traceback)."""
    try:
        return load(path)
    except (KeyFileError, OSError, ValueError) as exc:
        said = str(exc).removeprefix(f"{path}: ")  # (the path is said once, with the field)
        raise ConfigError(f"{field} = {str(path)!r}: {said}") from exc


def _warn_if_readable(path: Path) -> None:
    """A private key others on the machine can read is said (keygen writes 0600)."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        log.warning("identity_key_readable", path=str(path), mode=oct(mode),
                    hint=f"others on this machine can read the node's private key: chmod 600 "
                    f"{path}")  # fmt: skip


def load_identity(config: NodeConfig) -> tuple[Identity, Admission]:
    """The node's key and admission policy, checked against each other.

    Raises:
        ConfigError: a file is missing or unreadable, or the certificate names another key.
    """
    identity = _load("identity.key", config.identity.key, Identity.load)
    _warn_if_readable(config.identity.key)
    admission = admission_from_config(config.identity)
    if admission.certificate is not None and (
        admission.certificate.peer_public_key != identity.public_key
    ):
        raise ConfigError(
            f"identity.certificate = {str(config.identity.certificate)!r}: issued to another key "
            f"than identity.key"
        )
    return identity, admission
