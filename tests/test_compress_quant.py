"""int8 / int4 / qsgd / sign: error bounds, exact sizes, unbiasedness, determinism."""

import math

import pytest
import torch

from geotrain.compress import QSGD, Int4, Int8, Sign, decode


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", [1, 7, 256, 4096])
def test_int8_error_is_at_most_half_a_step_per_block(block):
    x = _x(1000)  # 1000 is no multiple of 7 or 256: the tail block is exercised
    y = decode(Int8(block=block).encode(x), max_numel=1000)
    for start in range(0, 1000, block):
        xs, ys = x[start : start + block], y[start : start + block]
        step = xs.abs().max() / 127
        assert (ys - xs).abs().max() <= step / 2 + 1e-6


def test_int8_stochastic_error_is_below_one_step_and_unbiased():
    x = _x(256)
    codec = Int8(block=256, stochastic=True)
    runs = torch.stack([decode(codec.encode(x, seed=s), max_numel=256) for s in range(400)])
    step = x.abs().max() / 127
    assert (runs - x).abs().max() <= step * 1.0001
    # mean over 400 runs: std of the error <= step / (2 * 20); allow 5 sigma per element
    assert (runs.mean(0) - x).abs().max() <= 5 * step / 40


def test_stochastic_rounding_is_reproducible_from_the_seed():
    x = _x(5000)
    codec = Int8(stochastic=True)
    assert codec.encode(x, seed=3) == codec.encode(x, seed=3)
    assert codec.encode(x, seed=3) != codec.encode(x, seed=4)


def test_int4_packs_two_codes_per_byte_and_bounds_the_error():
    x = _x(1001)
    codec = Int4(block=64)
    data = codec.encode(x)
    assert len(data) == codec.expected_nbytes(1001)
    assert len(data) == 14 + 8 + 5 + 4 * math.ceil(1001 / 64) + 501
    y = decode(data, max_numel=1001)
    for start in range(0, 1001, 64):
        xs, ys = x[start : start + 64], y[start : start + 64]
        assert (ys - xs).abs().max() <= xs.abs().max() / 7 / 2 + 1e-6


def test_int8_ratio_follows_from_the_format():
    n = 1 << 20
    data = Int8(block=256).encode(torch.ones(n))
    assert len(data) == 14 + 8 + 5 + 4 * (n // 256) + n
    assert 4 * n / len(data) == pytest.approx(4 / (1 + 4 / 256), rel=1e-3)


def test_zero_blocks_decode_to_zero():
    x = torch.zeros(300)
    x[290] = 1.0
    assert torch.equal(decode(Int8(block=256).encode(x), max_numel=300), x)


@pytest.mark.parametrize("levels", [2, 16])
def test_qsgd_is_unbiased(levels):
    x = _x(64, seed=1)
    codec = QSGD(levels=levels, bucket=64)
    runs = torch.stack([decode(codec.encode(x, seed=s), max_numel=64) for s in range(2000)])
    step = float(torch.linalg.vector_norm(x)) / levels
    # each element's error is bounded by one step, so its mean over 2000 runs has
    # std <= step / (2 * sqrt(2000)); 5 sigma
    assert (runs.mean(0) - x).abs().max() <= 5 * step / (2 * math.sqrt(2000))
    assert (runs - x).abs().max() <= step * 1.0001


def test_qsgd_with_few_levels_packs_codes():
    assert QSGD(levels=7).expected_nbytes(1000) < QSGD(levels=8).expected_nbytes(1000)
    x = _x(1000)
    assert len(QSGD(levels=7).encode(x)) == QSGD(levels=7).expected_nbytes(1000)


def test_sign_sends_one_bit_per_element_and_the_mean_magnitude():
    x = _x(1003)
    data = Sign().encode(x)
    assert len(data) == 14 + 8 + 4 + 126
    y = decode(data, max_numel=1003)
    scale = x.abs().mean()
    assert torch.allclose(y.abs(), scale.expand(1003))
    assert torch.equal(y < 0, x < 0)


def test_quantizers_refuse_non_finite_input():
    x = torch.tensor([1.0, float("nan")])
    for codec in (Int8(), Int4(), QSGD(), Sign()):
        with pytest.raises(ValueError, match="NaN or infinite"):
            codec.encode(x)


@pytest.mark.parametrize("codec", [Int8(), Int4(), QSGD(), Sign()], ids=lambda c: c.spec)
def test_half_precision_inputs_work(codec):
    x = _x(500).to(torch.bfloat16)
    y = decode(codec.encode(x), max_numel=500)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


@pytest.mark.parametrize(
    "codec", [Int8(), Int8(block=7), Int4(), Int4(block=5)], ids=lambda c: c.spec
)
@pytest.mark.parametrize("n", [1, 2, 6, 64, 333, 4096])
def test_small_tensors_take_numpy_and_give_the_bytes_and_values_of_the_torch_path(
    codec, n, monkeypatch
):
    """Small CPU tensors are quantized and dequantized with numpy (a model of hundreds of them
    spent most of an exchange in torch's per-call cost): the bytes and the decoded values must
    be exactly the torch path's, so peers that take either path agree."""
    from geotrain.compress import _quant

    x = _x(n, seed=n) * 3
    x[: n // 3] = 0.0  # an all-zero block, one of -0.0, and rows of one sign only
    x[: n // 6] = -0.0
    x[n // 3 : n // 2] = -x[n // 3 : n // 2].abs() - 0.5
    # values from bf16 put .5 ties where an exact levels / norm and torch's differ by an ulp
    x[n // 2 :] = x[n // 2 :].to(torch.bfloat16).float()
    if n >= 2:
        x[-2:] = torch.tensor([1.0546875, 0.52734375])  # int8 codes 127, 64 (not 63)
    small_bytes = codec.encode(x)
    small_values = decode(bytearray(small_bytes), max_numel=n)
    monkeypatch.setattr(_quant, "SMALL_NUMEL", 0)
    torch_bytes = codec.encode(x)
    assert small_bytes == torch_bytes
    assert torch.equal(decode(bytearray(torch_bytes), max_numel=n), small_values)
    bound = x.abs().max() / (127 if codec.name == "int8" else 7) / 2 + 1e-6
    assert (small_values - x).abs().max() <= bound


def test_small_tensors_refuse_non_finite_input_and_bad_scales():
    """The numpy path keeps the checks: NaN or inf is refused when encoding, and a payload whose
    scale is negative or NaN is refused when decoding."""
    from geotrain.compress import DecodeError

    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or infinite"):
            Int8().encode(torch.tensor([1.0, bad, 2.0]))
    data = bytearray(Int8().encode(_x(10)))
    scale_at = 14 + 8 + 5
    for bad_scale in (-1.0, float("nan")):
        data[scale_at : scale_at + 4] = torch.tensor([bad_scale]).numpy().tobytes()
        with pytest.raises(DecodeError, match="negative, NaN or infinite"):
            decode(data, max_numel=10)
