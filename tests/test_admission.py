"""Swarm admission: certificates signed by the authority; allow-list; open swarm."""

import math
import stat

import pytest

from geotrain.node.identity._admission import (
    Admission,
    AdmissionRefused,
    MembershipCertificate,
    SwarmAuthority,
    SwarmInfo,
)
from geotrain.node.identity._identity import Identity, KeyFileError

NOW = 1_800_000_000.0
DAY = 86400.0


@pytest.fixture
def authority():
    return SwarmAuthority.generate()


def _admission_for(authority, identity, expires_in_s=DAY, now=NOW):
    cert = authority.admit(identity.public_key, expires_in_s=expires_in_s, now=now)
    return Admission.with_certificate(authority.info, cert)


def test_a_member_with_a_valid_certificate_is_admitted(authority):
    me, peer = Identity.generate(), Identity.generate()
    mine, theirs = _admission_for(authority, me), _admission_for(authority, peer)
    until = mine.check(peer.public_key, theirs.credential(), NOW + 10)
    assert until == theirs.certificate.expires_at == int(NOW + DAY)


def test_missing_certificate_is_refused(authority):
    mine = _admission_for(authority, Identity.generate())
    with pytest.raises(AdmissionRefused, match="no membership certificate"):
        mine.check(Identity.generate().public_key, b"", NOW)


def test_expired_certificate_is_refused(authority):
    peer = Identity.generate()
    mine = _admission_for(authority, Identity.generate())
    theirs = _admission_for(authority, peer, expires_in_s=60)
    mine.check(peer.public_key, theirs.credential(), NOW + 59)
    with pytest.raises(AdmissionRefused, match="expired"):
        mine.check(peer.public_key, theirs.credential(), NOW + 60)


def test_certificate_of_another_swarm_is_refused(authority):
    peer = Identity.generate()
    other = SwarmAuthority.generate()
    mine = _admission_for(authority, Identity.generate())
    theirs = _admission_for(other, peer)
    with pytest.raises(AdmissionRefused, match="another swarm"):
        mine.check(peer.public_key, theirs.credential(), NOW)


def test_same_swarm_id_but_another_authority_is_a_forgery(authority):
    peer = Identity.generate()
    impostor = SwarmAuthority(authority.swarm_id, SwarmAuthority.generate().private_key)
    mine = _admission_for(authority, Identity.generate())
    forged = _admission_for(impostor, peer).credential()
    with pytest.raises(AdmissionRefused, match="not the swarm authority"):
        mine.check(peer.public_key, forged, NOW)


def test_a_changed_expiry_breaks_the_signature(authority):
    peer = Identity.generate()
    mine = _admission_for(authority, Identity.generate())
    cert = authority.admit(peer.public_key, expires_in_s=60, now=NOW)
    stretched = MembershipCertificate(
        cert.swarm_id,
        cert.peer_public_key,
        cert.issued_at,
        cert.expires_at + 365 * 86400,
        cert.signature,
    )
    with pytest.raises(AdmissionRefused, match="not the swarm authority"):
        mine.check(peer.public_key, stretched.to_bytes(), NOW)


def test_a_certificate_naming_another_peer_is_refused(authority):
    holder, thief = Identity.generate(), Identity.generate()
    mine = _admission_for(authority, Identity.generate())
    stolen = _admission_for(authority, holder).credential()
    with pytest.raises(AdmissionRefused, match="another peer"):
        mine.check(thief.public_key, stolen, NOW)


@pytest.mark.parametrize("junk", [b"x", b"geotrain-cert-v1", b"\x00" * 200])
def test_malformed_credentials_are_refused(authority, junk):
    mine = _admission_for(authority, Identity.generate())
    with pytest.raises(AdmissionRefused, match="malformed"):
        mine.check(Identity.generate().public_key, junk, NOW)


def test_allow_list_admits_only_listed_peers():
    listed, stranger = Identity.generate(), Identity.generate()
    adm = Admission.with_allow_list("lab", [listed.peer_id])
    assert adm.check(listed.public_key, b"", NOW) == math.inf
    with pytest.raises(AdmissionRefused, match="allow-list"):
        adm.check(stranger.public_key, b"", NOW)


def test_open_swarm_admits_anyone_and_prologue_names_the_swarm():
    adm = Admission.open_swarm("testbed-1")
    adm.check(Identity.generate().public_key, b"", NOW)
    assert b"testbed-1" in adm.prologue
    assert Admission.open_swarm("testbed-2").prologue != adm.prologue


def test_authority_round_trips_through_files(tmp_path, authority):
    authority.save(tmp_path / "swarm")
    assert stat.S_IMODE((tmp_path / "swarm" / "authority.key").stat().st_mode) == 0o600
    loaded = SwarmAuthority.load(tmp_path / "swarm")
    assert loaded.info == authority.info
    assert SwarmInfo.load(tmp_path / "swarm" / "swarm.json") == authority.info
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        SwarmAuthority.generate().save(tmp_path / "swarm")


def test_certificate_round_trips_through_a_file(tmp_path, authority):
    cert = authority.admit(Identity.generate().public_key, expires_in_s=DAY, now=NOW)
    cert.save(tmp_path / "c.json")
    assert MembershipCertificate.load(tmp_path / "c.json") == cert
    (tmp_path / "bad.json").write_text('{"format": "nope"}')
    with pytest.raises(KeyFileError, match="format"):
        MembershipCertificate.load(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "open", "swarm_id": ""}, "swarm_id"),
        ({"mode": "wide-open", "swarm_id": "s"}, "mode"),
        ({"mode": "allow_list", "swarm_id": "s"}, "allowed_peer_ids"),
        ({"mode": "certificate", "swarm_id": "s"}, "certificate"),
    ],
)
def test_bad_admission_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Admission(**kwargs)
