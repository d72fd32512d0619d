# `geotrain keygen` and `geotrain swarm init|admit`. Invariants: these commands only read and write
# key/certificate files (never the network); they never overwrite a file; every failure prints one
# line to standard error and returns a non-zero status; results go to standard output.
from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import pathlib
import re
import sys
import time

from ..identity import (
    Identity,
    KeyFileError,
    SwarmAuthority,
    public_key_from_peer_id,
    short_id,
)

_DURATION = re.compile(r"^([0-9]+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds in a duration like "90s", "15m", "12h", "30d".

    Raises:
        ValueError: not a positive whole number followed by s, m, h or d.
    """
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"duration {text!r}: expected a positive number and s, m, h or d (30d)")
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > MAX_DURATION_S:  # an absurd one overflowed the certificate's time field
        raise ValueError(f"duration {text!r}: expected at most 100 years (36500d)")
    return seconds


MAX_DURATION_S = 36500 * 86400


def parse_peer(text: str) -> bytes:
    """A peer's raw public key from its peer ID, or from the key in hex or base64.

    Raises:
        ValueError: none of those forms.
    """
    text = text.strip()
    if text.startswith("gt"):
        return public_key_from_peer_id(text)
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True)):
        try:
            key = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise ValueError(f"peer {text!r}: expected a peer ID (gt...) or a 32-byte key in hex/base64")


def _fail(command: str, message: str) -> int:
    print(f"geotrain {command}: error: {message}", file=sys.stderr)
    return 1


def _keygen(args: argparse.Namespace) -> int:
    if args.show is not None:  # an existing key's ID (a renewal's `swarm admit` needs it)
        try:
            identity = Identity.load(args.show)
        except KeyFileError as exc:
            return _fail("keygen", str(exc))
    else:
        identity = Identity.generate()
        try:
            identity.save(args.out)
        except KeyFileError as exc:
            message = str(exc)
            with contextlib.suppress(KeyFileError):  # the one there: say whose it is
                there = Identity.load(args.out)
                message += f" (it holds peer {there.peer_id}: `geotrain keygen --show` prints it)"
            return _fail("keygen", message)
    print(f"peer_id {identity.peer_id}")
    print(f"short_id {identity.short_id}")
    return 0


def _swarm_init(args: argparse.Namespace) -> int:
    try:
        authority = SwarmAuthority.generate(args.swarm_id)
        authority.save(args.out)
    except (KeyFileError, ValueError) as exc:
        return _fail("swarm init", str(exc))
    print(f"swarm_id {authority.swarm_id}")
    print(f"swarm_dir {pathlib.Path(args.out).resolve()}")
    return 0


def _swarm_admit(args: argparse.Namespace) -> int:
    try:
        expires_in = parse_duration(args.expires)
        key = parse_peer(args.peer)
        authority = SwarmAuthority.load(args.swarm)
    except (ValueError, KeyFileError) as exc:
        return _fail("swarm admit", str(exc))
    cert = authority.admit(key, expires_in_s=expires_in, now=time.time())
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.swarm) / "certs"
    if not args.out:
        out.mkdir(exist_ok=True)
        out = out / f"{cert.peer_id}.cert.json"
    try:
        cert.save(out, renew=args.renew)
    except KeyFileError as exc:
        return _fail("swarm admit", str(exc))
    print(f"peer_id {cert.peer_id}")
    print(f"short_id {short_id(cert.peer_id)}")
    print(f"expires_at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(cert.expires_at))}")
    print(f"certificate {out.resolve()}")
    return 0


def register_keygen(subparsers: argparse._SubParsersAction) -> None:
    """Add `geotrain keygen`."""
    p = subparsers.add_parser("keygen", help="create a node identity key (Ed25519), or show its ID")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--out", help="key file to create (mode 0600, never overwritten)")
    which.add_argument("--show", metavar="PATH",
                       help="print the peer ID of an existing key file instead")  # fmt: skip
    p.set_defaults(handler=_keygen)


def register_swarm(subparsers: argparse._SubParsersAction) -> None:
    """Add `geotrain swarm init|admit`."""
    p = subparsers.add_parser("swarm", help="swarm authority: create it, admit members")
    sub = p.add_subparsers(title="swarm commands", metavar="SWARM_COMMAND", required=True)
    init = sub.add_parser("init", help="create a swarm authority key and swarm ID")
    init.add_argument("--out", required=True, help="directory for authority.key and swarm.json")
    init.add_argument("--swarm-id", default=None, help="swarm ID (default: 128 random bits, hex)")
    init.set_defaults(handler=_swarm_init)
    admit = sub.add_parser("admit", help="issue an expiring membership certificate")
    admit.add_argument("--swarm", required=True, help="the directory `swarm init` made")
    admit.add_argument("peer", metavar="PEER_PUBKEY_OR_ID", help="peer ID or public key")
    admit.add_argument("--expires", required=True, help="validity, e.g. 30d, 12h, 15m, 90s")
    admit.add_argument("--out", default=None, help="certificate file (default: SWARM/certs/)")
    admit.add_argument("--renew", action="store_true",
                       help="replace the certificate of the same peer there (a running node "
                            "reloads it)")  # fmt: skip
    admit.set_defaults(handler=_swarm_admit)
