"""Node identity keys: peer IDs, files written 0600, never overwritten."""

import stat

import pytest

from geotrain.node.identity._identity import (
    Identity,
    KeyFileError,
    peer_id_from_public_key,
    public_key_from_peer_id,
    short_id,
    verify_signature,
)


def test_peer_id_round_trips_to_the_public_key():
    identity = Identity.generate()
    assert identity.peer_id.startswith("gt")
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key
    assert identity.short_id == short_id(identity.peer_id) == identity.peer_id[2:10]


def test_two_identities_have_different_peer_ids():
    assert Identity.generate().peer_id != Identity.generate().peer_id


@pytest.mark.parametrize(
    "bad", ["", "gt", "xx" + "a" * 52, "gt" + "a" * 51, "gt" + "1" * 52, "gt" + "a" * 53]
)
def test_malformed_peer_ids_are_refused(bad):
    with pytest.raises(ValueError, match="peer ID"):
        public_key_from_peer_id(bad)


def test_saved_key_is_private_and_loads_back(tmp_path):
    identity = Identity.generate()
    path = tmp_path / "node.key"
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == identity.peer_id


def test_save_refuses_to_overwrite(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"precious")
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        Identity.generate().save(path)
    assert path.read_bytes() == b"precious"


def test_loading_garbage_says_what_is_wrong(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"not a key")
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        Identity.load(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        Identity.load(tmp_path / "missing.key")


def test_signatures_verify_only_for_the_signer_and_message():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"hello")
    assert verify_signature(a.public_key, sig, b"hello")
    assert not verify_signature(b.public_key, sig, b"hello")
    assert not verify_signature(a.public_key, sig, b"hellO")
    assert peer_id_from_public_key(a.public_key) == a.peer_id
