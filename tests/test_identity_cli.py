"""`geotrain keygen` and `geotrain swarm init|admit`, run through the real CLI entry point."""

import base64
import json
import stat
import time

import pytest

from geotrain.node.cli._identity_cli import parse_duration, parse_peer
from geotrain.node.cli._main import main
from geotrain.node.identity._admission import Admission, MembershipCertificate, SwarmAuthority
from geotrain.node.identity._identity import Identity


def _fields(out: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in out.strip().splitlines())


def test_keygen_writes_a_private_key_and_prints_its_peer_id(tmp_path, capsys):
    path = tmp_path / "node.key"
    assert main(["keygen", "--out", str(path)]) == 0
    fields = _fields(capsys.readouterr().out)
    identity = Identity.load(path)
    assert fields == {"peer_id": identity.peer_id, "short_id": identity.short_id}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_keygen_refuses_to_overwrite(tmp_path, capsys):
    path = tmp_path / "node.key"
    path.write_text("keep me")
    assert main(["keygen", "--out", str(path)]) == 1
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and len(err.strip().splitlines()) == 1
    assert path.read_text() == "keep me"


def test_keygen_shows_an_existing_keys_peer_id(tmp_path, capsys):
    """A renewal (`swarm admit PEER_ID --renew`) needs the ID of a key made 30 days ago: no
    command printed it."""
    path = tmp_path / "node.key"
    assert main(["keygen", "--out", str(path)]) == 0
    made = _fields(capsys.readouterr().out)
    assert main(["keygen", "--show", str(path)]) == 0
    assert _fields(capsys.readouterr().out) == made
    assert main(["keygen", "--out", str(path)]) == 1  # refused, saying whose key is there
    assert f"(it holds peer {made['peer_id']}" in capsys.readouterr().err
    assert main(["keygen", "--show", str(tmp_path / "none.key")]) == 1
    assert "none.key: cannot read" in capsys.readouterr().err


def test_swarm_init_then_admit_issues_a_certificate_the_swarm_accepts(tmp_path, capsys):
    swarm = tmp_path / "swarm"
    assert main(["swarm", "init", "--out", str(swarm)]) == 0
    swarm_id = _fields(capsys.readouterr().out)["swarm_id"]
    member = Identity.generate()
    assert main(["swarm", "admit", "--swarm", str(swarm), member.peer_id, "--expires", "2h"]) == 0
    fields = _fields(capsys.readouterr().out)
    cert = MembershipCertificate.load(fields["certificate"])
    assert cert.peer_id == member.peer_id == fields["peer_id"]
    assert cert.swarm_id == swarm_id
    assert abs(cert.expires_at - (time.time() + 7200)) < 60
    authority = SwarmAuthority.load(swarm)
    admission = Admission.with_certificate(authority.info, cert)
    admission.check(member.public_key, cert.to_bytes(), time.time())
    doc = json.loads((swarm / "certs" / f"{member.peer_id}.cert.json").read_text())
    assert doc["peer_id"] == member.peer_id


def test_admit_accepts_a_hex_public_key_and_an_explicit_out(tmp_path, capsys):
    swarm = tmp_path / "swarm"
    assert main(["swarm", "init", "--out", str(swarm), "--swarm-id", "lab-7"]) == 0
    member = Identity.generate()
    out = tmp_path / "m.cert"
    args = ["swarm", "admit", "--swarm", str(swarm), member.public_key.hex(), "--expires", "30d"]
    assert main([*args, "--out", str(out)]) == 0
    assert MembershipCertificate.load(out).swarm_id == "lab-7"
    assert main([*args, "--out", str(out)]) == 1  # never overwrites
    assert "refusing to overwrite" in capsys.readouterr().err


def test_renew_replaces_the_same_peers_certificate_and_nothing_else(tmp_path, capsys):
    swarm = tmp_path / "swarm"
    assert main(["swarm", "init", "--out", str(swarm)]) == 0
    member, other = Identity.generate(), Identity.generate()
    admit = ["swarm", "admit", "--swarm", str(swarm)]
    assert main([*admit, member.peer_id, "--expires", "1h"]) == 0  # into SWARM/certs/
    path = swarm / "certs" / f"{member.peer_id}.cert.json"
    first = MembershipCertificate.load(path).expires_at
    capsys.readouterr()
    assert main([*admit, member.peer_id, "--expires", "30d"]) == 1  # not without --renew
    assert "refusing to overwrite" in capsys.readouterr().err
    for _ in range(2):  # the renewal the node's hint gives works again and again
        assert main([*admit, member.peer_id, "--expires", "30d", "--renew"]) == 0
    renewed = MembershipCertificate.load(path)
    assert renewed.expires_at > first + 29 * 86400 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    # --renew never replaces another peer's certificate, a key, or a file that is not there
    capsys.readouterr()
    assert main([*admit, other.peer_id, "--expires", "30d", "--renew", "--out", str(path)]) == 1
    assert "holds the certificate of peer" in capsys.readouterr().err
    assert MembershipCertificate.load(path).peer_id == member.peer_id
    key = tmp_path / "node.key"
    member.save(key)
    assert main([*admit, member.peer_id, "--expires", "30d", "--renew", "--out", str(key)]) == 1
    assert Identity.load(key).peer_id == member.peer_id
    missing = tmp_path / "none.cert.json"
    assert main([*admit, member.peer_id, "--expires", "30d", "--renew", "--out", str(missing)]) == 1
    assert "no certificate there to renew" in capsys.readouterr().err and not missing.exists()


@pytest.mark.parametrize(
    ("peer", "expires", "message"),
    [
        ("gtnotapeer", "30d", "peer ID"),
        ("zz", "30d", "expected a peer ID"),
        (None, "30x", "duration '30x'"),
        (None, "0d", "duration '0d'"),
    ],
)
def test_admit_errors_are_one_clear_line(tmp_path, capsys, peer, expires, message):
    swarm = tmp_path / "swarm"
    assert main(["swarm", "init", "--out", str(swarm)]) == 0
    peer = peer or Identity.generate().peer_id
    assert main(["swarm", "admit", "--swarm", str(swarm), peer, "--expires", expires]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_admit_without_a_swarm_dir_fails_clearly(tmp_path, capsys):
    peer = Identity.generate().peer_id
    args = ["swarm", "admit", "--swarm", str(tmp_path / "nope"), peer, "--expires", "1d"]
    assert main(args) == 1
    assert "cannot read" in capsys.readouterr().err


def test_swarm_init_refuses_an_existing_swarm(tmp_path, capsys):
    assert main(["swarm", "init", "--out", str(tmp_path)]) == 0
    assert main(["swarm", "init", "--out", str(tmp_path)]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_durations_and_peer_forms():
    assert [parse_duration(d) for d in ("90s", "15m", "12h", "30d")] == [90, 900, 43200, 2592000]
    assert parse_duration("36500d") == 36500 * 86400
    with pytest.raises(ValueError, match="at most 100 years"):  # was a struct.error at admit
        parse_duration("99999999999999999d")
    key = Identity.generate().public_key
    assert parse_peer(base64.b64encode(key).decode()) == key
    assert parse_peer(key.hex()) == key


@pytest.mark.parametrize("content", ["", "{", "{}", "[]"], ids=["empty", "truncated", "{}", "[]"])
@pytest.mark.parametrize("broken", ["certificate", "swarm"])
def test_a_malformed_certificate_or_swarm_file_is_one_line_naming_the_field(
    tmp_path, capsys, broken, content
):
    """An empty, truncated or otherwise malformed certificate or swarm.json stops the node with
    one line naming the field and the file, exit status 2, before anything starts (it was a
    KeyFileError traceback and exit status 1)."""
    swarm = tmp_path / "swarm"
    assert main(["swarm", "init", "--out", str(swarm)]) == 0
    assert main(["keygen", "--out", str(tmp_path / "me.key")]) == 0
    peer = Identity.load(tmp_path / "me.key").peer_id
    assert main(["swarm", "admit", "--swarm", str(swarm), peer, "--expires", "1d", "--out",
                 str(tmp_path / "me.cert")]) == 0  # fmt: skip
    files = {"certificate": tmp_path / "me.cert", "swarm": swarm / "swarm.json"}
    assert files["swarm"].exists()
    files[broken].write_text(content)
    (tmp_path / "node.toml").write_text(
        f'[identity]\nkey = "me.key"\ncertificate = "me.cert"\nswarm = "{files["swarm"]}"\n'
        '[training]\ntask = "synthetic-linreg"\nmax_steps = 1\n'
    )
    capsys.readouterr()
    assert main(["node", "run", "--config", str(tmp_path / "node.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert f"identity.{broken} = '{files[broken]}'" in err[0]


def test_a_private_key_others_can_read_is_warned_about(tmp_path):
    from structlog.testing import capture_logs

    from geotrain.node import config_from_toml
    from geotrain.node._credentials import load_identity

    assert main(["keygen", "--out", str(tmp_path / "me.key")]) == 0
    cfg = config_from_toml('[identity]\nkey = "me.key"\nopen_swarm = true\n', base=tmp_path)
    with capture_logs() as logs:
        load_identity(cfg)
    assert not [e for e in logs if e["event"] == "identity_key_readable"]  # keygen's 0600
    (tmp_path / "me.key").chmod(0o644)
    with capture_logs() as logs:
        load_identity(cfg)
    said = [e for e in logs if e["event"] == "identity_key_readable"]
    assert len(said) == 1 and said[0]["mode"] == "0o644" and "chmod 600" in said[0]["hint"]


@pytest.mark.parametrize("kind", ["missing", "empty", "garbage", "ec-key"])
def test_a_bad_identity_key_is_one_line_naming_the_field(tmp_path, capsys, kind):
    """A missing, empty, non-PEM or non-Ed25519 identity.key stops the node with one line naming
    the field and the file, exit status 2."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = tmp_path / "me.key"
    if kind == "empty":
        key.write_bytes(b"")
    elif kind == "garbage":
        key.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    elif kind == "ec-key":
        key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))  # fmt: skip
    (tmp_path / "node.toml").write_text(
        '[identity]\nkey = "me.key"\nopen_swarm = true\n'
        '[training]\ntask = "synthetic-linreg"\nmax_steps = 1\n'
    )
    capsys.readouterr()
    assert main(["node", "run", "--config", str(tmp_path / "node.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert f"identity.key = '{key}'" in err[0] and err[0].count(str(key)) == 1  # (said twice)
