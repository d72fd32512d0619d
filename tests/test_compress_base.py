"""decode() on untrusted bytes: only DecodeError, bounded allocation, every field checked."""

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geotrain.compress import DecodeError, decode, get_codec

SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:block=3,stochastic",
    "int4:block=5",
    "qsgd:levels=3",
    "qsgd:levels=20,bucket=7",
    "sign",
    "topk:0.05",
    "topk:0.3+int8",
    "topk:0.05+fp16",
    "topk:0.01+int8",  # index mode 2 (escaped gaps) on the 3000-element tensor
    "randk:0.2+bf16",
    "powersgd:rank=2",
    "powersgd:rank=2+int8",
]
MAX_NUMEL = 4096


def _valid_payloads():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 17, generator=g)
    big = torch.randn(3000, generator=g)
    return [get_codec(s).encode(t, seed=1) for s in SPECS for t in (x, big)]


VALID = _valid_payloads()


def _decode_or_decode_error(data: bytes) -> None:
    try:
        out = decode(data, max_numel=MAX_NUMEL)
    except DecodeError as exc:
        assert str(exc)  # a reason is given
    else:
        assert out.numel() <= MAX_NUMEL


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_decode_error(data):
    _decode_or_decode_error(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(range(len(VALID))),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 10**6),
    st.booleans(),
)
def test_mutated_payloads_raise_only_decode_error(which, flips, cut, truncate):
    data = bytearray(VALID[which])
    for pos, value in flips:
        data[pos % len(data)] = value
    if truncate:
        data = data[: cut % len(data)]
    _decode_or_decode_error(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(range(len(VALID))), st.integers(6, 400), st.sampled_from([b"\xff", b"\x7f"]))
def test_huge_sizes_in_any_field_are_refused_before_allocating(which, pos, fill):
    data = bytearray(VALID[which])
    pos = pos % len(data)
    data[pos : pos + 8] = fill * min(8, len(data) - pos)  # a huge little-endian integer
    _decode_or_decode_error(bytes(data))


@pytest.mark.parametrize("data", VALID[::2])
def test_valid_payloads_decode_and_trailing_bytes_do_not(data):
    assert decode(data, max_numel=MAX_NUMEL).shape == (24, 17)
    with pytest.raises(DecodeError, match="trailing"):
        decode(data + b"\0", max_numel=MAX_NUMEL)


@pytest.mark.parametrize(
    ("mutate", "says"),
    [
        (lambda d: b"XX" + d[2:], "bad magic"),
        (lambda d: d[:2] + b"\x09" + d[3:], "unsupported format version 9"),
        (lambda d: d[:3] + b"\xee" + d[4:], "unknown codec id 238"),
        (lambda d: d[:4] + b"\x07" + d[5:], "unknown dtype code 7"),
        (lambda d: d[:5] + b"\x09" + d[6:], "ndim 9 exceeds"),
        (lambda d: d[:14] + struct.pack("<Q", 10**12) + d[22:], "over max_numel=4096"),
        (lambda d: d[:-1], "truncated"),
    ],
)
def test_each_header_field_is_checked_with_a_reason(mutate, says):
    data = get_codec("int8").encode(torch.ones(100))
    with pytest.raises(DecodeError, match=says):
        decode(mutate(data), max_numel=MAX_NUMEL)


def test_non_finite_scales_are_refused():
    data = bytearray(get_codec("int8").encode(torch.ones(100)))
    data[14 + 8 + 5 : 14 + 8 + 9] = struct.pack("<f", float("inf"))
    with pytest.raises(DecodeError, match="scales contain"):
        decode(bytes(data), max_numel=MAX_NUMEL)


def test_allowed_limits_the_codecs_accepted():
    data = get_codec("sign").encode(torch.ones(10))
    with pytest.raises(DecodeError, match="unknown codec id 9"):
        decode(data, max_numel=10, allowed=("none",))


def test_decode_places_the_result_on_the_requested_device():
    data = get_codec("int8").encode(torch.ones(10))
    assert decode(memoryview(data), max_numel=10, device=torch.device("cpu")).device.type == "cpu"


def test_encode_refuses_integer_tensors_and_bad_seeds():
    with pytest.raises(TypeError, match="expected a float16"):
        get_codec("none").encode(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="seed=-1"):
        get_codec("none").encode(torch.ones(3), seed=-1)


FIXED_SIZE = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:block=3,stochastic",
    "int4:block=5",
    "qsgd:levels=3",
    "qsgd:levels=20,bucket=7",
    "sign",
    "randk:0.2+bf16",
    "powersgd:rank=2",
    "powersgd:rank=2+int8",
]


@pytest.mark.parametrize("spec", FIXED_SIZE)
@pytest.mark.parametrize("shape", [(1,), (7,), (24, 17), (5, 4, 3), (0,)])
def test_expected_nbytes_is_exact_for_fixed_size_codecs(spec, shape):
    codec = get_codec(spec)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert len(codec.encode(x)) == codec.expected_nbytes(x.numel(), shape=shape)
