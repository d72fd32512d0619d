# Invariants: rice_encode/rice_decode are inverses for any non-negative int64 gaps; the decoder
# checks every length and padding bit before trusting it, allocates at most 8 bools per byte
# actually present (plus 64 per gap for the remainders, k being bounded by the caller), and raises
# DecodeError naming the field for any malformed stream.
"""Golomb-Rice coding of the gaps between sorted positions, vectorised with numpy.

A gap g with parameter b is its quotient q = g >> b in unary (q one-bits, then a zero) and its
remainder g & (2^b - 1) in b bits. For gaps drawn at density p (geometric), the best b costs
within ~0.03 bits of the gaps' entropy: at p = 2%, ~7.1 bits a gap against 8.2 for escaped
bytes. The two parts travel as two streams (all quotients, then all remainders), so both sides
work on whole arrays instead of bit by bit:

    quotient stream length:u64 | unary quotients, bit order little, zero-padded to a byte |
    remainders: b bits each, bit order little, zero-padded to a byte
"""

from __future__ import annotations

import math

import numpy as np

from ._errors import DecodeError
from ._wire import Reader

MAX_B = 62  # a remainder fits an int64 with room for the quotient's bits


def rice_cost_bits(gaps: np.ndarray, b: int) -> int:
    """Bits of both streams (before byte padding) for `gaps` with parameter `b`."""
    return int(gaps.size) * (b + 1) + int(np.sum(gaps >> b, dtype=np.int64))


def best_rice_parameter(gaps: np.ndarray) -> int:
    """The b in a window around log2(mean gap) that codes `gaps` in the fewest bits."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    centre = int(math.log2(mean * math.log(2))) if mean * math.log(2) >= 1 else 0
    candidates = range(max(0, centre - 2), min(MAX_B, centre + 3) + 1)
    return min(candidates, key=lambda b: (rice_cost_bits(gaps, b), b))


def rice_nbytes(gaps: np.ndarray, b: int) -> int:
    """Bytes `rice_encode(gaps, b)` returns (the length field included)."""
    k = int(gaps.size)
    unary = k + int(np.sum(gaps >> b, dtype=np.int64))
    return 8 + (unary + 7) // 8 + (k * b + 7) // 8


def expected_rice_nbytes(k: int, n: int) -> int:
    """An estimate of `rice_nbytes` for k positions spread at random over n."""
    if k == 0:
        return 8
    mean = max(0.0, (n - k) / k)
    b = int(math.log2(mean * math.log(2))) if mean * math.log(2) >= 1 else 0
    return 8 + math.ceil((k + (n - k) / 2**b) / 8) + math.ceil(k * b / 8)


def rice_encode(gaps: np.ndarray, b: int) -> list:
    """The two streams of non-negative int64 `gaps` with parameter `b`, as byte pieces."""
    if not 0 <= b <= MAX_B:
        raise ValueError(f"rice parameter b={b}: expected 0..{MAX_B}")
    gaps = np.asarray(gaps, dtype=np.int64)
    quotients = gaps >> b
    total = int(gaps.size + quotients.sum(dtype=np.int64))
    bits = np.ones(total, dtype=np.bool_)
    bits[np.cumsum(quotients + 1) - 1] = False  # each quotient's terminating zero
    unary = np.packbits(bits, bitorder="little")  # pads with zeros
    parts = [len(unary).to_bytes(8, "little"), memoryview(unary).cast("B")]
    if b:
        remainders = (gaps & ((1 << b) - 1)).astype("<u8")
        # (k, 64) bits of each remainder, lowest first; its first b travel
        per_gap = np.unpackbits(remainders.view(np.uint8).reshape(-1, 8), axis=1,
                                bitorder="little")  # fmt: skip
        parts.append(memoryview(np.packbits(per_gap[:, :b].reshape(-1), bitorder="little")))
    return parts


def rice_decode(reader: Reader, k: int, b: int, n: int) -> np.ndarray:
    """Read `k` gaps coded with parameter `b`; each must be < n (positions in range(n)).

    Raises:
        DecodeError: for a bad parameter or length, too few or too many quotients, non-zero
            padding, or a gap out of range.
    """
    if not 0 <= b <= MAX_B:
        raise DecodeError(f"topk rice parameter b={b}: expected 0..{MAX_B}")
    (length,) = reader.unpack("Q", "topk rice quotient length")
    # the quotients of gaps summing below n take at most k + n / 2^b bits
    most = (k + (n >> b) + 7) // 8
    if length > most:
        raise DecodeError(f"topk rice quotient length={length}: expected <= {most} bytes")
    raw = reader.numpy(length, "u1", "topk rice quotients")
    bits = np.unpackbits(raw, bitorder="little")
    zeros = np.flatnonzero(bits == 0)
    if zeros.size < k:
        raise DecodeError(f"topk rice quotients: {zeros.size} terminators, expected k={k}")
    used = int(zeros[k - 1]) + 1 if k else 0
    if (used + 7) // 8 != length or bits[used:].any():
        raise DecodeError(
            f"topk rice quotients: {length} bytes for {used} bits, or padding bits not zero"
        )
    quotients = np.diff(zeros[:k], prepend=-1) - 1
    if k and int(quotients.max()) > (n - 1) >> b:  # checked before shifting: no overflow
        raise DecodeError(
            f"topk rice quotient {int(quotients.max())} is out of range for numel {n}"
        )
    gaps = quotients.astype(np.int64) << b
    if b:
        packed = reader.numpy((k * b + 7) // 8, "u1", "topk rice remainders")
        rem_bits = np.unpackbits(packed, bitorder="little")
        if rem_bits[k * b :].any():
            raise DecodeError("topk rice remainders: padding bits are not zero")
        per_gap = np.zeros((k, 64), dtype=np.uint8)
        per_gap[:, :b] = rem_bits[: k * b].reshape(k, b)
        gaps |= np.packbits(per_gap, axis=1, bitorder="little").view("<u8").reshape(k).astype(
            np.int64)  # fmt: skip
    if k and int(gaps.max()) >= n:
        raise DecodeError(f"topk rice gap {int(gaps.max())} is out of range for numel {n}")
    return gaps
