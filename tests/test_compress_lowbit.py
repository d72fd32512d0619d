"""SparseLoCo-class codecs: int2, top-k with 2- and 1-bit values, Rice gaps, error feedback."""

import math

import numpy as np
import pytest
import torch

from geotrain.compress import DecodeError, ErrorFeedback, Int2, NoneCodec, TopK, decode, get_codec
from geotrain.compress._rice import best_rice_parameter, rice_decode, rice_encode
from geotrain.compress._wire import MAGIC, VERSION, Reader


def _x(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_int2_keeps_signs_and_two_centroid_magnitudes_per_block():
    x = _x(10_000) * torch.linspace(0.1, 3.0, 10_000)
    y = decode(Int2(block=512).encode(x), max_numel=x.numel())
    assert torch.equal(torch.sign(y), torch.sign(x))
    for start in range(0, x.numel(), 512):
        block_x, block_y = x[start : start + 512].abs(), y[start : start + 512].abs()
        levels = torch.unique(block_y)
        assert levels.numel() <= 2
        for level in levels:  # each magnitude is the mean of what it stands for
            assert float(level) == pytest.approx(float(block_x[block_y == level].mean()), 1e-5)
    # a contraction (what error feedback needs), and a fair one: below half the norm
    assert (y - x).norm() < 0.5 * x.norm()


@pytest.mark.parametrize("n", [1, 7, 513, 4096])
def test_int2_takes_two_bits_an_element_and_a_pair_of_magnitudes_per_block(n):
    x = _x(n, seed=n)
    payload = Int2(block=512).encode(x)
    assert len(payload) == 14 + 8 + 4 + 8 * math.ceil(n / 512) + math.ceil(2 * n / 8)
    assert len(payload) == Int2(block=512).expected_nbytes(n)
    assert decode(payload, max_numel=n).shape == (n,)


def test_int2_refuses_what_it_cannot_code_and_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        Int2().encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="block"):
        get_codec("int2:block=0")
    payload = bytearray(Int2(block=4).encode(torch.tensor([1.0, -2.0, 3.0])))
    body = 14 + 8
    bad_block = payload[:body] + (0).to_bytes(4, "little") + payload[body + 4 :]
    with pytest.raises(DecodeError, match="int2 block"):
        decode(bytes(bad_block), max_numel=3)
    negative = bytearray(payload)
    negative[body + 4 : body + 8] = np.float32(-1.0).tobytes()
    with pytest.raises(DecodeError, match="magnitudes"):
        decode(bytes(negative), max_numel=3)
    padded = bytearray(payload)
    padded[-1] |= 0x80  # a bit past the third element's two
    with pytest.raises(DecodeError, match="padding"):
        decode(bytes(padded), max_numel=3)
    with pytest.raises(DecodeError, match="truncated"):
        decode(bytes(payload[:-1]), max_numel=3)


# bits on the wire per kept value at top-k 2% of 10^6 elements: the index ~7.1 bits (Rice-coded
# gaps; their entropy at 2% density is 7.07), the value 32 / 8 + 32/256 (int8's scales) /
# 4 + 32/64 / 2 + 64/512 (int2's two magnitudes per block) / 1 bit; a kept value per 50 params
VALUE_BITS = {"none": 32, "int8": 8.125, "int4": 4.5, "int2": 2.125, "sign": 1}


@pytest.mark.parametrize("inner", sorted(VALUE_BITS))
def test_topk_bits_per_parameter_on_the_wire_are_as_claimed(inner):
    n = 1_000_000
    x = _x(n, seed=5)
    codec = get_codec(f"topk:0.02+{inner}")
    payload = codec.encode(x, seed=2)
    y = decode(payload, max_numel=n)
    kept = y != 0
    k = int(kept.sum())
    assert abs(k - 20_000) <= 2000
    per_kept = 8 * len(payload) / k
    assert VALUE_BITS[inner] + 6.9 <= per_kept <= VALUE_BITS[inner] + 7.2
    assert 8 * len(payload) / n <= 0.0215 * (VALUE_BITS[inner] + 7.2)  # bits a parameter
    assert torch.equal(torch.sign(y[kept]), torch.sign(x[kept]))  # every value codec keeps signs
    assert x[kept].abs().min() >= x[~kept].abs().max()


@pytest.mark.parametrize("inner", ["int2", "sign", "int4"])
def test_error_feedback_carries_what_low_bit_values_drop(inner):
    codec = get_codec(f"topk:0.02+{inner}")
    ef = ErrorFeedback(codec)
    n, rounds = 50_000, 60
    direction = _x(n, seed=9)  # a steady direction under fresh noise, as updates have
    fed_total, sent_total, plain_total = (torch.zeros(n) for _ in range(3))
    for step in range(rounds):
        t = direction + 2 * _x(n, seed=100 + step)
        fed_total += t
        sent_total += decode(ef.encode(t, name="w", seed=step), max_numel=n)
        plain_total += decode(codec.encode(t, seed=step), max_numel=n)
        # mass conservation: everything fed in is either sent or held in the residual
        assert torch.allclose(sent_total + ef.residual("w"), fed_total, atol=1e-3)
    # what was sent with the residual carried follows the sum fed in far more closely than
    # the same codec without it (which only ever sends the largest 2% of each round)
    cosine = torch.nn.functional.cosine_similarity
    assert float(cosine(sent_total, fed_total, dim=0)) > 0.6
    miss_ef = 1 - float(cosine(sent_total, direction, dim=0))
    miss_plain = 1 - float(cosine(plain_total, direction, dim=0))
    assert miss_ef < 0.5 * miss_plain


def test_sparse_values_may_use_the_low_bit_codecs_and_only_value_codecs():
    for inner in ("int4", "int2", "sign"):
        assert get_codec(f"topk:0.02+{inner}").inner.name == inner
    with pytest.raises(ValueError, match="value codec"):
        get_codec("topk:0.02+qsgd")
    with pytest.raises(ValueError, match="value codec"):
        get_codec("topk:0.02+topk:0.5")


@pytest.mark.parametrize("b", [0, 1, 5, 13])
def test_rice_gaps_round_trip(b):
    gaps = np.random.default_rng(b).geometric(0.02, 5000).astype(np.int64) - 1
    gaps[::97] = 0
    gaps[5] = 123_456
    raw = b"".join(bytes(p) for p in rice_encode(gaps, b))
    reader = Reader(raw)
    assert np.array_equal(rice_decode(reader, gaps.size, b, int(gaps.sum()) + gaps.size), gaps)
    reader.finish("rice stream")


def test_the_rice_parameter_is_the_cheapest_near_the_mean_gap():
    gaps = np.random.default_rng(0).geometric(0.02, 20_000).astype(np.int64) - 1
    b = best_rice_parameter(gaps)
    assert b == 5  # mean gap 49: 2^5 ~ 49 x ln 2

    def cost(b):
        return gaps.size * (b + 1) + int((gaps >> b).sum())

    assert all(cost(b) <= cost(other) for other in range(0, 20))


def _rice_payload(k: int, n: int, b: int, unary: bytes, remainders: bytes,
                  length: int | None = None) -> bytes:  # fmt: skip
    header = MAGIC + bytes([VERSION, TopK.codec_id, 0, 1]) + (0).to_bytes(8, "little")
    body = k.to_bytes(8, "little") + bytes([3, b])
    body += (len(unary) if length is None else length).to_bytes(8, "little") + unary + remainders
    values = NoneCodec().encode(torch.ones(k))
    return header + n.to_bytes(8, "little") + body + len(values).to_bytes(8, "little") + values


def test_malformed_rice_gaps_are_refused_with_a_reason():
    # gaps 0, 5, 2 with b = 1: quotients 0, 2, 1 -> bits 0 | 1 1 0 | 1 0 ; remainders 0, 1, 0
    bits = [0, 1, 1, 0, 1, 0]
    unary = bytes([sum(bit << i for i, bit in enumerate(bits))])
    remainders = bytes([0b0000_0010])
    good = _rice_payload(3, 100, 1, unary, remainders)
    assert torch.nonzero(decode(good, max_numel=100)).flatten().tolist() == [0, 6, 9]
    for bad, says in [
        (_rice_payload(3, 100, 1, unary, remainders, length=2), "truncated|bytes for"),
        (_rice_payload(3, 100, 1, unary[:0], remainders), "terminators"),
        (_rice_payload(9, 100, 1, unary, remainders), "terminators"),  # too few for k
        (_rice_payload(3, 100, 1, bytes([unary[0] | 0x80]), remainders), "padding"),
        (_rice_payload(3, 100, 1, unary, bytes([0b1000_0010])), "padding"),
        (_rice_payload(3, 100, 63, unary, remainders), "rice parameter"),
        (_rice_payload(3, 8, 1, unary, remainders), "out of range"),  # positions past numel
        (_rice_payload(3, 100, 1, unary + b"\x00", remainders), "bytes for"),
        (_rice_payload(3, 100, 1, unary, remainders + b"\x00"), "trailing|values"),
        (_rice_payload(3, 100, 1, unary, remainders, length=10**15), "rice quotient length"),
    ]:
        with pytest.raises(DecodeError, match=says):
            decode(bad, max_numel=100)


def test_a_huge_claimed_rice_quotient_is_refused_before_it_is_shifted():
    # one gap whose unary quotient alone says more than numel allows
    bits = [1] * 40 + [0]
    unary = np.packbits(np.array(bits, dtype=np.uint8), bitorder="little").tobytes()
    with pytest.raises(DecodeError, match="out of range|rice quotient length"):
        decode(_rice_payload(1, 2**40, 40, unary, bytes(5)), max_numel=2**40)
