"""none / fp16 / bf16: exact sizes, round-trip error bounds, dtype and shape kept."""

import pytest
import torch

from geotrain.compress import BF16, FP16, NoneCodec, decode

CASES = [(NoneCodec(), 4, 0.0), (FP16(), 2, 2**-11), (BF16(), 2, 2**-8)]


@pytest.mark.parametrize(("codec", "bytes_per", "rel"), CASES, ids=lambda c: getattr(c, "spec", ""))
def test_round_trip_is_within_the_format_precision(codec, bytes_per, rel):
    x = torch.randn(37, 11, generator=torch.Generator().manual_seed(0))
    data = codec.encode(x)
    y = decode(data, max_numel=x.numel())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.all((y - x).abs() <= rel * x.abs())
    assert len(data) == codec.expected_nbytes(x.numel(), shape=x.shape)
    assert len(data) - codec.expected_nbytes(0, shape=(0, 0)) == bytes_per * x.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_the_input_dtype_comes_back(dtype):
    x = torch.arange(10, dtype=dtype)
    y = decode(NoneCodec().encode(x), max_numel=10)
    assert y.dtype == dtype
    assert torch.equal(y, x)


def test_scalars_and_empty_tensors_round_trip():
    for x in (torch.tensor(3.5), torch.zeros(0), torch.zeros(4, 0)):
        y = decode(FP16().encode(x), max_numel=10)
        assert y.shape == x.shape and torch.equal(y, x)


def test_ratio_of_fp16_is_two_for_large_tensors():
    x = torch.ones(100_000)
    assert 4 * x.numel() / len(FP16().encode(x)) == pytest.approx(2.0, rel=1e-3)
