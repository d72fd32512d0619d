"""topk and randk: k within tolerance, exact selection, index encodings, unbiased randk."""

import math

import numpy as np
import pytest
import torch

from geotrain.compress import FP16, Int8, NoneCodec, RandK, TopK, decode
from geotrain.compress._sparse import _at_least, at_least_torch, randk_indices


def _x(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [50_000, 1_000_000])
def test_topk_keeps_the_largest_magnitudes_within_tolerance(n):
    x = _x(n)
    codec = TopK(fraction=0.01, tol=0.1)
    y = decode(codec.encode(x, seed=1), max_numel=n)
    kept = y != 0
    count = int(kept.sum())
    assert abs(count - codec.k_for(n)) <= 0.1 * codec.k_for(n)
    assert torch.equal(y[kept], x[kept])  # values sent exactly with the `none` value codec
    assert x[kept].abs().min() >= x[~kept].abs().max()  # the kept ones are the largest


def test_topk_on_a_small_tensor_is_exact():
    x = _x(2000)
    y = decode(TopK(fraction=0.05).encode(x), max_numel=2000)
    assert int((y != 0).sum()) == 100


def test_topk_uses_a_bitmap_when_dense_and_gaps_when_sparse():
    n = 100_000
    x = _x(n)
    sparse = TopK(fraction=0.01).encode(x)
    dense = TopK(fraction=0.5).encode(x)
    # gaps at 1% take about a byte each; at half the elements a bitmap (n / 8 bytes) is smallest
    assert _index_mode(sparse) == 3 and _index_mode(dense) == 1
    assert len(sparse) < 14 + 8 + 10 + 1.05 * 1100 + 8 + 22 + 4 * 1100
    k = int((decode(dense, max_numel=n) != 0).sum())
    assert len(dense) == 14 + 8 + 10 + n // 8 + 8 + 22 + 4 * k


def test_topk_values_compose_with_a_value_codec():
    x = _x(200_000)
    plain, q8, h = (TopK(0.01, inner=c).encode(x) for c in (NoneCodec(), Int8(), FP16()))
    assert len(q8) < len(h) < len(plain)
    y = decode(q8, max_numel=x.numel())
    kept = y != 0
    assert (y[kept] - x[kept]).abs().max() <= x.abs().max() / 127


def test_tiny_tensors_are_sent_dense():
    x = _x(10)
    data = TopK(0.01).encode(x)
    assert len(data) == NoneCodec().expected_nbytes(10)
    assert torch.equal(decode(data, max_numel=10), x)


def test_topk_handles_ties_and_zeros():
    x = torch.zeros(100_000)
    x[::7] = 1.0  # many equal magnitudes, far more than k
    y = decode(TopK(0.01).encode(x), max_numel=x.numel())
    assert abs(int((y != 0).sum()) - 1000) <= 100
    assert set(y.unique().tolist()) <= {0.0, 1.0}


def test_randk_indices_are_reproducible_distinct_and_in_range():
    a = randk_indices(seed=5, k=1000, n=50_000)
    assert np.array_equal(a, randk_indices(seed=5, k=1000, n=50_000))
    assert not np.array_equal(a, randk_indices(seed=6, k=1000, n=50_000))
    assert np.all(np.diff(a) > 0) and a[0] >= 0 and a[-1] < 50_000
    assert len(a) == 1000
    assert len(randk_indices(seed=1, k=900, n=1000)) == 900  # dense subsets too


def test_randk_subsets_are_uniform():
    for k in (5, 15):  # below and above n / 2 (the complement path)
        hits = np.zeros(20)
        for seed in range(4000):
            hits[randk_indices(seed, k, 20)] += 1
        # each index is in a subset with probability k/20: std of its count ~ 27.4
        assert np.all(np.abs(hits - 4000 * k / 20) < 5 * 27.4)


def test_randk_sends_no_indices():
    n = 100_000
    data = RandK(0.01).encode(_x(n))
    assert len(data) == 14 + 8 + 9 + 8 + 22 + 4 * 1000
    assert len(data) == RandK(0.01).expected_nbytes(n)


def test_randk_is_unbiased():
    x = _x(200, seed=2)
    codec = RandK(fraction=0.1)
    runs = torch.stack([decode(codec.encode(x, seed=s), max_numel=200) for s in range(3000)])
    p = 20 / 200
    # per element: value x/p with prob p, else 0 -> std of the mean = |x| sqrt((1-p)/p / 3000)
    bound = 5 * x.abs() * math.sqrt((1 - p) / p / 3000)
    assert torch.all((runs.mean(0) - x).abs() <= bound + 1e-6)


def test_unscaled_randk_sends_the_values_as_they_are():
    x = _x(1000)
    y = decode(RandK(0.1, unscaled=True).encode(x, seed=9), max_numel=1000)
    kept = y != 0
    assert torch.equal(y[kept], x[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_and_device_agnostic_selections_agree(dtype):
    x = _x(700_000).to(dtype)  # several chunks, a partial last one
    assert torch.equal(_at_least(x, 2.0), at_least_torch(x, 2.0))


def _index_mode(payload: bytes) -> int:
    return payload[14 + 8 * 1 + 8]  # header with ndim 1, then k:u64, then the mode byte


@pytest.mark.parametrize("n", [3000, 100_000, 1_000_000])
def test_sparse_indices_travel_as_rice_coded_gaps_near_their_entropy(n):
    x = _x(n, seed=3)
    codec = TopK(fraction=0.01)
    payload = codec.encode(x, seed=1)
    assert _index_mode(payload) == 3
    y = decode(payload, max_numel=n)
    kept = y != 0
    assert torch.equal(y[kept], x[kept]) and x[kept].abs().min() >= x[~kept].abs().max()
    k = int(kept.sum())
    # gaps at density p = k / n carry H(p) / p bits each (8.1 at 1%); fixed-width gaps take 16,
    # escaped bytes ~10.4; Rice coding is within a few percent of the bound
    p = k / n
    entropy_bytes = k * (-p * math.log2(p) - (1 - p) * math.log2(1 - p)) / p / 8
    index_bytes = len(payload) - 4 * k - (14 + 8 + 10 + 8 + 22 + 8)
    assert index_bytes <= 1.05 * entropy_bytes + 2
    assert len(payload) <= codec.expected_nbytes(n) * 1.05  # the estimate knows the layout


def _escaped(k: int, long_width: int, m: int, short: list[int], long: list[int]) -> bytes:
    from geotrain.compress._wire import MAGIC, VERSION

    header = MAGIC + bytes([VERSION, TopK.codec_id, 0, 1]) + (0).to_bytes(8, "little")
    body = k.to_bytes(8, "little") + bytes([2, long_width]) + m.to_bytes(8, "little")
    body += bytes(short) + b"".join(v.to_bytes(long_width, "little") for v in long)
    values = NoneCodec().encode(torch.ones(k))
    return header + (1000).to_bytes(8, "little") + body + len(values).to_bytes(8, "little") + values


def test_escaped_gaps_that_do_not_add_up_are_refused_with_a_reason():
    from geotrain.compress import DecodeError

    good = _escaped(3, 2, 1, [0, 255, 4], [300])
    assert torch.nonzero(decode(good, max_numel=1000)).flatten().tolist() == [0, 301, 306]
    for bad, says in [
        (_escaped(3, 2, 2, [0, 255, 4], [300, 300]), "2 given"),  # one marked, two given
        (_escaped(3, 2, 1, [0, 255, 4], [254]), "long gaps must lie"),  # not canonical
        (_escaped(3, 2, 1, [0, 255, 4], [1000]), "long gaps must lie"),  # past the end
        (_escaped(3, 2, 4, [0, 255, 4], [300]), "long gap count"),  # more long than k
        (_escaped(3, 3, 1, [0, 255, 4], [300]), "long gap width"),
        (_escaped(3, 2, 1, [254, 255, 254], [600]), "out of range"),  # sums past numel
    ]:
        with pytest.raises(DecodeError, match=says):
            decode(bad, max_numel=1000)
