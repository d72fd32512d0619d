# Invariants: a sparse payload carries k, the indices (or, for randk, only the seed they derive
# from) and the k values as a nested dense payload of an allowed value codec; decoded indices are
# checked to be strictly increasing and < numel before use. topk keeps exactly the `count` largest
# magnitudes (ties aside) with count within `tol` of the requested k.
"""Sparsifiers: `topk` (sampled threshold, exact fallback) and `randk` (seeded subset)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import torch

from ._base import Codec, dataclass, decode, decode_error, field_error, register
from ._bits import pack_bits, unpack_bits
from ._cast import NoneCodec
from ._errors import DecodeError
from ._rice import best_rice_parameter, expected_rice_nbytes, rice_decode, rice_encode, rice_nbytes
from ._wire import Header, Reader, as_buffer

VALUE_CODECS = ("none", "fp16", "bf16", "int8", "int4", "int2", "sign")
_SIGMAS = 2.5  # confidence of the sampled threshold, in standard deviations of the count
_MIN_HITS = 500  # expected sample elements above the threshold, at least
_CHUNK = 1 << 18
_SHORT_GAPS = 255  # escaped gaps (index mode 2): a gap of at least this is a long one


def _check_fraction(cls, fraction) -> None:
    if not isinstance(fraction, float | int) or not 0 < fraction <= 1:
        raise field_error(cls, "fraction", fraction, "a number in (0, 1]")


def _check_inner(cls, inner) -> None:
    if not isinstance(inner, Codec) or inner.name not in VALUE_CODECS:
        raise field_error(cls, "inner", inner, f"a value codec, one of {VALUE_CODECS}")


def _values_part(values: torch.Tensor, inner: Codec, seed: int) -> list:
    payload = inner.encode(values, seed=seed)
    return [len(payload).to_bytes(8, "little"), payload]


def _read_values(reader: Reader, count: int, device, what: str) -> torch.Tensor:
    (length,) = reader.unpack("Q", f"{what} values length")
    values = decode(
        reader.take(length, f"{what} values"), max_numel=count, device=device, allowed=VALUE_CODECS
    )
    if tuple(values.shape) != (count,):
        raise DecodeError(f"{what} values have shape {tuple(values.shape)}, expected ({count},)")
    return values.float()


def _width(max_gap: int) -> int:
    return next(w for w in (1, 2, 4, 8) if max_gap < 256**w)


@register
@dataclass
class TopK(Codec):
    """Keep the k = round(fraction * n) largest magnitudes, within +-`tol` of k.

    The threshold is estimated from a seeded random sample of |x| (Deep Gradient Compression's
    trick; for tensors where the sample would be half of it or more, from all of |x|, exactly).
    If it selects more than k * (1 + tol), an exact top-k over those candidates fixes it; if
    fewer than k * (1 - tol), a lower threshold gives a superset first (and torch.topk over the
    whole tensor is the last resort). Indices travel as gaps of the smallest fitting width, as
    escaped gaps (a byte each, the long ones listed apart), as Golomb-Rice coded gaps or as a
    bitmap, whichever is smallest; values through `inner` (down to 2 bits: int2, or 1: sign).
    Tensors too small to gain from sparsity are sent dense with `inner`. NaN values are not
    refused here (the value codec may).
    """

    fraction: float = 0.01
    tol: float = 0.1
    inner: Codec = dataclasses.field(default_factory=NoneCodec)
    name: ClassVar[str] = "topk"
    sparse: ClassVar[bool] = True
    codec_id: ClassVar[int] = 6
    params: ClassVar[dict[str, type]] = {"fraction": float, "tol": float}

    def __post_init__(self) -> None:
        _check_fraction(type(self), self.fraction)
        if not isinstance(self.tol, float | int) or not 0 <= self.tol < 1:
            raise field_error(type(self), "tol", self.tol, "a number in [0, 1)")
        _check_inner(type(self), self.inner)

    def k_for(self, numel: int) -> int:
        """The requested number of kept elements for a tensor of `numel`."""
        return min(numel, max(1, round(self.fraction * numel)))

    def fallback_for(self, shape) -> Codec | None:
        n = math.prod(shape)
        if n == 0 or self._body_nbytes(n, shape) >= self.inner._body_nbytes(n, (n,)):
            return self.inner
        return None

    def select(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """Sorted int64 indices of the kept elements of 1-D `x`."""
        n, k = x.numel(), self.k_for(x.numel())
        # Sample enough that the count above the estimated threshold is within tol of k with
        # ~2.5 sigma confidence (relative error of a count ~ 1 / sqrt(expected hits)).
        hits = (_SIGMAS / self.tol) ** 2 if self.tol > 0 else math.inf
        m = min(n, math.ceil(max(_MIN_HITS, hits) / self.fraction))
        if 2 * m >= n:  # small tensor: the "sample" is all of it, the threshold exact
            m, sample = n, x.abs().float()
        else:
            gen = torch.Generator(device=x.device)
            gen.manual_seed(seed)
            picks = torch.randint(n, (m,), generator=gen, device=x.device)
            sample = x.index_select(0, picks).abs().float()

        def above_estimate(count: int) -> torch.Tensor:
            rank = min(m - 1, max(0, m - round(count * m / n)))  # 0-based, ascending
            return _at_least(x, _kth_smallest(sample, rank))

        lo, hi = math.floor(k * (1 - self.tol)), math.ceil(k * (1 + self.tol))
        idx = above_estimate(k)
        if idx.numel() < lo:  # threshold too high (rare): a lower one, to get a superset
            idx = above_estimate(2 * hi)
            if idx.numel() < k:
                return _exact_topk(x, k)
        if idx.numel() > hi:  # too many candidates: the exact top-k among them
            best = torch.topk(x.index_select(0, idx).abs(), k, sorted=False).indices
            return idx[best].sort().values
        return idx

    def _encode_body(self, x, shape, seed, state, name) -> list:
        n = x.numel()
        idx = self.select(x, seed)
        gaps = (torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1).cpu().numpy()
        k_bytes = idx.numel().to_bytes(8, "little")
        values = x.index_select(0, idx)
        return [k_bytes, *_index_part(gaps, n, idx, x.device),
                *_values_part(values, self.inner, seed)]  # fmt: skip

    def _body_nbytes(self, numel: int, shape) -> int:
        k = self.k_for(numel)
        # escaped gaps: the long ones of k positions spread evenly at random, in 4 bytes each
        escaped = 8 + k + math.ceil(k * (1 - k / numel) ** _SHORT_GAPS) * 4
        index = min(k * _width(8 * numel // k), (numel + 7) // 8, escaped,
                    expected_rice_nbytes(k, numel))  # fmt: skip
        return 10 + index + 8 + self.inner.expected_nbytes(k)

    @classmethod
    def _decode_body(cls, reader, header: Header, device, max_numel) -> torch.Tensor:
        n = header.numel
        k, mode, width = reader.unpack("QBB", "topk params")
        if k > n:
            raise decode_error("topk k", k, f"<= numel {n}")
        if mode == 0:
            idx = _read_gaps(reader, k, width, n)
        elif mode == 2:
            idx = _positions(_read_escaped_gaps(reader, k, width, n), n)
        elif mode == 3:
            idx = _positions(rice_decode(reader, k, width, n), n)
        elif mode == 1 and width == 0:
            packed = reader.tensor((n + 7) // 8, torch.uint8, "topk bitmap", "cpu")
            if n % 8 and int(packed[-1]) >> (n % 8):
                raise DecodeError("topk bitmap: padding bits are not zero")
            idx = _nonzero(unpack_bits(packed, n))
            if idx.numel() != k:
                raise DecodeError(f"topk bitmap has {idx.numel()} bits set, expected k={k}")
        else:
            raise DecodeError(f"topk index mode {mode} with width {width}: expected 0, 1/0, 2 or 3")
        values = _read_values(reader, k, device, "topk")
        out = torch.zeros(n, dtype=torch.float32, device=device)
        out.index_copy_(0, idx.to(device), values)
        return out


def _index_part(gaps: np.ndarray, n: int, idx: torch.Tensor, device) -> list:
    """The smallest of four index layouts for sorted positions (`gaps`: the zeros between
    them): gaps of one fixed width (mode 0); a bitmap (mode 1); escaped gaps (mode 2): a byte
    per gap, 255 marking a long one whose value follows in a list of one fixed width; Golomb-Rice
    coded gaps (mode 3, `width` is its parameter b). At 1% density a long gap (>= 255) is about
    8% of them: mode 2 takes ~1.3 bytes an index where mode 0 takes 2, and mode 3 ~1.0."""
    k = gaps.size
    width = _width(int(gaps.max()))
    long = gaps >= _SHORT_GAPS
    m = int(long.sum())
    long_width = _width(int(gaps[long].max())) if m else 1
    rice_b = best_rice_parameter(gaps)
    sizes = {0: k * width, 1: (n + 7) // 8, 2: 8 + k + m * long_width,
             3: rice_nbytes(gaps, rice_b)}  # fmt: skip
    mode = min(sizes, key=lambda mode: (sizes[mode], mode))
    if mode == 3:
        return [bytes([3, rice_b]), *rice_encode(gaps, rice_b)]
    if mode == 0:
        return [bytes([0, width]), memoryview(gaps.astype(f"<u{width}")).cast("B")]
    if mode == 1:
        mask = torch.zeros(n, dtype=torch.bool, device=device)
        mask[idx] = True
        return [bytes([1, 0]), as_buffer(pack_bits(mask))]
    short = np.minimum(gaps, _SHORT_GAPS).astype(np.uint8)
    return [bytes([2, long_width]), m.to_bytes(8, "little"), memoryview(short).cast("B"),
            memoryview(gaps[long].astype(f"<u{long_width}")).cast("B")]  # fmt: skip


def _read_escaped_gaps(reader: Reader, k: int, long_width: int, n: int) -> np.ndarray:
    if long_width not in (1, 2, 4, 8):
        raise decode_error("topk long gap width", long_width, "1, 2, 4 or 8")
    (m,) = reader.unpack("Q", "topk long gap count")
    if m > k:
        raise decode_error("topk long gap count", m, f"<= k {k}")
    short = reader.numpy(k, "<u1", "topk short gaps")
    long = reader.numpy(m, f"<u{long_width}", "topk long gaps")
    marked = short == _SHORT_GAPS
    if int(marked.sum()) != m:
        raise DecodeError(f"topk escaped gaps: {int(marked.sum())} marked long, {m} given")
    if m and (int(long.min()) < _SHORT_GAPS or int(long.max()) >= n):
        raise DecodeError(f"topk long gaps must lie in [{_SHORT_GAPS}, numel {n})")
    gaps = short.astype(np.int64)
    gaps[marked] = long.astype(np.int64)
    return gaps


def _exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def _kth_smallest(values: torch.Tensor, rank: int) -> float:
    """The `rank`-th smallest (0-based) of 1-D float32 `values`."""
    if values.device.type == "cpu":  # numpy's partition is ~3x faster than kthvalue here
        return float(np.partition(values.numpy(), rank)[rank])
    return float(values.kthvalue(rank + 1).values)


def _at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Sorted int64 indices where |x| >= threshold."""
    if x.device.type != "cpu":
        return at_least_torch(x, threshold)
    # CPU: numpy's abs/compare/nonzero are ~3x faster than torch's on one core; chunks keep the
    # two temporaries small and reused.
    size = min(x.numel(), _CHUNK)
    magnitude, mask = np.empty(size, np.float32), np.empty(size, np.bool_)
    parts = []
    for start in range(0, x.numel(), _CHUNK):
        chunk = x[start : start + _CHUNK]
        values = (chunk if chunk.dtype == torch.float32 else chunk.float()).numpy()
        m = mask[: values.size]
        np.greater_equal(np.abs(values, out=magnitude[: values.size]), threshold, out=m)
        parts.append(np.flatnonzero(m) + start)
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int64)


def at_least_torch(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Device-agnostic `_at_least` (torch ops only); used off the CPU."""
    return torch.nonzero(x.abs() >= threshold).squeeze(1)


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Indices of True in a 1-D bool tensor; numpy's is about 2x faster than torch's on CPU."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def _read_gaps(reader: Reader, k: int, width: int, n: int) -> torch.Tensor:
    if width not in (1, 2, 4, 8):
        raise decode_error("topk index width", width, "1, 2, 4 or 8")
    gaps = reader.numpy(k, f"<u{width}", "topk index gaps")
    if k and int(gaps.max()) >= n:
        raise DecodeError(f"topk index gap {int(gaps.max())} is out of range for numel {n}")
    return _positions(gaps.astype(np.int64), n)


def _positions(gaps: np.ndarray, n: int) -> torch.Tensor:
    """Sorted positions from the gaps between them (each < n, checked), checked against n."""
    idx = np.cumsum(gaps + 1) - 1
    if idx.size and idx[-1] >= n:
        raise DecodeError(f"topk index {int(idx[-1])} is out of range for numel {n}")
    return torch.from_numpy(idx)


def _splitmix64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs of splitmix64 seeded with `seed` (uint64, fully specified)."""
    z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z += np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def randk_indices(seed: int, k: int, n: int) -> np.ndarray:
    """A uniformly random k-subset of range(n), sorted; the same on every machine.

    The first k distinct values of the splitmix64 stream mod n (by symmetry a uniform subset);
    for k > n / 2, the complement of the first n - k, so the work stays O(n) for any k.
    """
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if 2 * k <= n:
        return np.sort(_first_distinct(seed, k, n))
    keep = np.ones(n, dtype=np.bool_)
    keep[_first_distinct(seed, n - k, n)] = False
    return np.flatnonzero(keep)


def _first_distinct(seed: int, k: int, n: int) -> np.ndarray:
    """The first k distinct values of the seeded stream mod n (k <= n / 2)."""
    count = math.ceil(-n * math.log1p(-k / n) * 1.05) + 64  # draws expected to give k distinct
    while True:
        draws = (_splitmix64(seed, count) % np.uint64(n)).astype(np.int64)
        distinct, first = np.unique(draws, return_index=True)
        if distinct.size >= k:
            return distinct[np.argsort(first)[:k]]
        count *= 2


@register
@dataclass
class RandK(Codec):
    """Random-k: a seeded uniform subset of k = round(fraction * n) elements; only values travel.

    Both sides derive the (sorted) indices from the payload's seed. Values are scaled by n / k,
    which makes the estimate unbiased; `unscaled` sends them as they are (biased but
    contractive: the variant to use under error feedback).
    """

    fraction: float = 0.01
    unscaled: bool = False
    inner: Codec = dataclasses.field(default_factory=NoneCodec)
    name: ClassVar[str] = "randk"
    sparse: ClassVar[bool] = True
    codec_id: ClassVar[int] = 7
    params: ClassVar[dict[str, type]] = {"fraction": float, "unscaled": bool}

    @property
    def contractive(self) -> bool:
        """Scaled by n / k (unbiased), what it keeps outweighs what it drops; unscaled, a
        contraction (when its inner codec is one)."""
        return self.unscaled and self.inner.contractive

    def __post_init__(self) -> None:
        _check_fraction(type(self), self.fraction)
        _check_inner(type(self), self.inner)

    def k_for(self, numel: int) -> int:
        """The number of values sent for a tensor of `numel` elements."""
        return min(numel, max(1, round(self.fraction * numel)))

    def _encode_body(self, x, shape, seed, state, name) -> list:
        n = x.numel()
        k = self.k_for(n) if n else 0
        idx = torch.from_numpy(randk_indices(seed, k, n)).to(x.device)
        head = k.to_bytes(8, "little") + bytes([int(self.unscaled)])
        return [head, *_values_part(x.index_select(0, idx), self.inner, seed)]

    def _body_nbytes(self, numel: int, shape) -> int:
        return 9 + 8 + self.inner.expected_nbytes(self.k_for(numel) if numel else 0)

    @classmethod
    def _decode_body(cls, reader, header: Header, device, max_numel) -> torch.Tensor:
        n = header.numel
        k, unscaled = reader.unpack("QB", "randk params")
        if k > n or unscaled > 1 or (n and not k):
            raise DecodeError(f"randk k={k}, unscaled={unscaled}: expected k in 1..{n}, 0 or 1")
        values = _read_values(reader, k, device, "randk")
        if not unscaled and k:
            values = values * (n / k)  # each index is kept with probability k / n
        out = torch.zeros(n, dtype=torch.float32, device=device)
        idx = torch.from_numpy(randk_indices(header.seed, k, n)).to(device)
        return out.index_copy_(0, idx, values)
