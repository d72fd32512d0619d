"""Noise XX handshake, identity proofs, frames and the replay window (no I/O)."""

import os
import random
import struct

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from geotrain.node.identity._identity import Identity
from geotrain.node.transport._noise import (
    FRAME_CHUNK,
    FrameRejected,
    HandshakeFailed,
    NoiseHandshake,
    PartInfo,
    ReplayWindow,
    check_identity_proof,
    make_identity_proof,
    open_frame,
    parse_frame_prefix,
    part_bounds,
    seal_frame,
)


def _pair(prologue_i=b"swarm-a", prologue_r=b"swarm-a"):
    return (
        NoiseHandshake(True, X25519PrivateKey.generate(), prologue_i),
        NoiseHandshake(False, X25519PrivateKey.generate(), prologue_r),
    )


def _run(i, r, tamper=None):
    msgs = []
    m = i.write_message(b"")
    msgs.append(m)
    m = tamper(0, m) if tamper else m
    assert r.read_message(m) == b""
    m = r.write_message(b"from responder")
    m = tamper(1, m) if tamper else m
    assert i.read_message(m) == b"from responder"
    m = i.write_message(b"from initiator")
    m = tamper(2, m) if tamper else m
    assert r.read_message(m) == b"from initiator"


def test_handshake_agrees_on_keys_and_learns_static_keys():
    i, r = _pair()
    _run(i, r)
    assert i.complete and r.complete
    assert i.split() == r.split()[::-1]
    assert i.split()[0] != i.split()[1]
    assert i.handshake_hash == r.handshake_hash
    assert i.remote_static == r._s.public_key().public_bytes_raw()
    assert r.remote_static == i._s.public_key().public_bytes_raw()


def test_a_different_prologue_fails_the_handshake():
    # the reason points at the usual cause (it said only "failed authentication")
    i, r = _pair(b"swarm-a", b"swarm-b")
    with pytest.raises(HandshakeFailed, match="authentication: the peer is of another swarm"):
        _run(i, r)


def test_a_recorded_handshake_replayed_to_a_responder_fails_and_says_it_may_be_a_replay():
    i, r = _pair()
    first = i.write_message(b"")
    r.read_message(first)
    i.read_message(r.write_message(b""))
    third = i.write_message(b"proof")
    again = NoiseHandshake(False, r._s, b"swarm-a")  # the same responder, a new handshake
    again.read_message(first)  # (the first message has nothing to authenticate)
    again.write_message(b"")  # a new ephemeral key: the recorded third message cannot fit it
    with pytest.raises(HandshakeFailed, match="or replayed from another handshake"):
        again.read_message(third)


@pytest.mark.parametrize("which", [1, 2])
def test_any_tampered_byte_of_an_encrypted_message_fails(which):
    rng = random.Random(which)
    for _ in range(20):
        i, r = _pair()

        def flip(index, msg, rng=rng):
            if index != which:
                return msg
            b = bytearray(msg)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            return bytes(b)

        with pytest.raises(HandshakeFailed):
            _run(i, r, tamper=flip)


def test_out_of_turn_calls_are_refused():
    i, r = _pair()
    with pytest.raises(HandshakeFailed, match="out of turn"):
        r.write_message(b"")
    with pytest.raises(HandshakeFailed, match="split before"):
        i.split()


def test_identity_proof_binds_the_static_key():
    identity = Identity.generate()
    static = os.urandom(32)
    proof = make_identity_proof(identity, static, b"cred")
    assert check_identity_proof(proof, static).identity_key == identity.public_key
    with pytest.raises(HandshakeFailed, match="not signed by the claimed identity"):
        check_identity_proof(proof, os.urandom(32))
    with pytest.raises(HandshakeFailed, match="malformed"):
        check_identity_proof(b"\x93garbage", static)


KEY = ChaCha20Poly1305(bytes(range(32)))


def _open(frame, max_header=1024, max_payload=1 << 24, key=KEY):
    return open_frame(key, parse_frame_prefix(frame, max_header, max_payload), frame)


@pytest.mark.parametrize("size", [0, 1, FRAME_CHUNK, FRAME_CHUNK + 1, 3 * FRAME_CHUNK - 7])
def test_frames_round_trip_at_chunk_edges(size):
    payload = random.Random(size).randbytes(size)
    header, out = _open(seal_frame(KEY, 7, b"hdr", payload))
    assert header == b"hdr" and out == payload


def test_any_changed_byte_of_a_frame_is_rejected():
    frame = seal_frame(KEY, 3, b"header", b"p" * (FRAME_CHUNK + 100))
    rng = random.Random(0)
    for _ in range(30):
        bad = bytearray(frame)
        bad[rng.randrange(len(bad))] ^= 0x80
        with pytest.raises(FrameRejected):
            _open(bytes(bad))


def test_frame_with_wrong_key_or_plaintext_is_rejected():
    frame = seal_frame(KEY, 0, b"h", b"payload")
    with pytest.raises(FrameRejected) as exc:
        _open(frame, key=ChaCha20Poly1305(os.urandom(32)))
    assert exc.value.reason == "auth"
    with pytest.raises(FrameRejected):
        _open(b"\x10" + b"plain text pretending to be a frame" * 3)


def test_length_limits_are_checked_before_decryption():
    frame = seal_frame(KEY, 0, b"h", b"x" * 1000)
    with pytest.raises(FrameRejected) as exc:
        _open(frame, max_payload=999)
    assert exc.value.reason == "length"
    with pytest.raises(FrameRejected) as exc:
        _open(frame[:-1])
    assert exc.value.reason == "length"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_frames_only_raise_frame_rejected(data):
    try:
        _open(data)
    except FrameRejected:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.integers(0, 2))
def test_fuzzed_handshake_messages_only_raise_handshake_failed(data, step):
    i, r = _pair()
    if step >= 1:
        r.read_message(i.write_message(b""))
    if step == 2:
        i.read_message(r.write_message(b""))
    target = i if step == 1 else r
    try:
        target.read_message(data)
    except HandshakeFailed:
        pass


@pytest.mark.parametrize("point", [bytes(32), b"\x01" + bytes(31)])
def test_a_low_order_ephemeral_key_is_a_handshake_failure_on_either_side(point):
    """The responder reads a stranger's HS1 fine (an ephemeral key is any 32 bytes) and then
    computes "ee" writing its reply: a low-order key raised ValueError there, which the node
    logged with a traceback for every such connection and did not count."""
    _, r = _pair()
    r.read_message(point)
    with pytest.raises(HandshakeFailed, match="invalid public key"):
        r.write_message(b"")
    i, r = _pair()
    i.write_message(b"")
    with pytest.raises(HandshakeFailed, match="invalid public key"):
        i.read_message(point + bytes(64))


def test_replay_window_accepts_once_and_refuses_old_counters():
    w = ReplayWindow(size=8)
    for c in (0, 2, 1, 5):
        w.accept(c)
    for c in (0, 1, 2, 5):
        with pytest.raises(FrameRejected, match="seen before"):
            w.accept(c)
    w.accept(3)  # reordered but inside the window
    w.accept(20)
    with pytest.raises(FrameRejected, match="older than the window"):
        w.accept(12)
    w.accept(13)


def test_replay_window_check_does_not_record():
    w = ReplayWindow()
    w.check(4)
    w.check(4)
    w.accept(4)
    with pytest.raises(FrameRejected):
        w.check(4)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([0x10, 0x11, 0x12]),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**64 - 1),
    st.tuples(
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
    ),
    st.binary(max_size=120),
)
def test_fuzzed_prefixes_only_raise_frame_rejected(kind, counter, hlen, plen, part, body):
    """Well-formed-looking prefixes with wild lengths and part numbers: refused, never a crash
    or an allocation of what they claim."""
    data = struct.pack("<BQIQ", kind, counter, hlen, plen)
    if kind != 0x10:
        data += struct.pack("<QIIQ", *part)
    try:
        _open(data + body)
    except FrameRejected:
        pass


def test_part_numbers_are_checked():
    part = PartInfo(message_id=1, index=1, count=3, message_len=10)
    assert part_bounds(10, 3, 0) == (0, 4) and part_bounds(10, 3, 2) == (8, 10)
    part.check(4)
    for bad, size in [(part, 3), (PartInfo(1, 3, 3, 10), 2), (PartInfo(1, 0, 1, 10), 10)]:
        with pytest.raises(FrameRejected) as exc:
            bad.check(size)
        assert exc.value.reason == "part"
    frame = seal_frame(KEY, 0, b"", b"4567", part)
    info = parse_frame_prefix(frame, 10, 10)
    out = bytearray(4)
    assert open_frame(KEY, info, frame, memoryview(out)) == (b"", None) and out == b"4567"


def test_replay_window_survives_a_huge_jump():
    # A peer's counter jumping by 2**62 must not shift a 2**62-bit integer into existence.
    w = ReplayWindow(size=64)
    w.accept(1)
    w.accept(2**62)
    with pytest.raises(FrameRejected):
        w.accept(2**62)
    with pytest.raises(FrameRejected):
        w.accept(1)
    w.accept(2**62 - 5)  # still inside the window
