# Invariants: quantized codes are symmetric around zero and a block's scale maps its code range
# back to values, so decode(encode(x)) differs from x by at most scale/2 per element (scale with
# stochastic rounding); stochastic rounding is unbiased and seeded by the payload seed. Scales on
# the wire are float32, finite and >= 0 (checked on decode). Encoding works in chunks so that
# temporaries stay small and are reused (big fresh allocations cost page faults).
"""Quantizers: `int8`, `int4` (blockwise absmax), `qsgd` (unbiased, L2 buckets), `sign`."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from ._base import Codec, dataclass, decode_error, field_error, register
from ._bits import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles
from ._errors import DecodeError
from ._wire import Reader, as_buffer, check_finite_scales

_CHUNK = 1 << 18  # elements per encode step; 1 MiB of float32 temporaries
_MAX_BLOCK = 1 << 24
# Up to this many elements, a CPU tensor is quantized (round-to-nearest) and dequantized with
# numpy on the payload's own buffers: the same float32 operations, so the same bytes, without
# torch's per-call cost, which dominated for models of hundreds of small tensors (LayerNorms,
# biases, small layers: 600 such tensors took 4-5x as long as codec none)
SMALL_NUMEL = 1 << 12


def quantize_blocks(
    x: torch.Tensor, block: int, levels: int, *, seed: int | None, l2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (1-D) per block of `block` elements to integer codes in [-levels, levels].

    Args:
        x: values, any float dtype and device.
        block: elements per scale.
        levels: largest code magnitude.
        seed: seed of stochastic rounding, or None for round-to-nearest.
        l2: scale blocks by their L2 norm (QSGD) instead of their absmax.

    Returns:
        (scales (n_blocks,) float32, codes (n,) int8); value ~= code * scale.
    """
    n = x.numel()
    full = n // block
    scales = torch.empty(math.ceil(n / block), dtype=torch.float32, device=x.device)
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=x.device)
        gen.manual_seed(seed)
    rows = max(1, _CHUNK // block)
    spans = [(r, min(full, r + rows), block) for r in range(0, full, rows)]
    if n % block:
        spans.append((full, full + 1, n - full * block))
    # scratch reused by every chunk: (values, noise) float32, at most one chunk each
    size = max(((r1 - r0) * width for r0, r1, width in spans), default=0)
    work = torch.empty(2 if gen is not None else 1, size, dtype=torch.float32, device=x.device)
    for r0, r1, width in spans:
        lo, hi = r0 * block, r0 * block + (r1 - r0) * width
        shape = (r1 - r0, width)
        _quantize_rows(
            x[lo:hi].view(shape),
            scales[r0:r1],
            codes[lo:hi].view(shape),
            work[:, : hi - lo].view(-1, *shape),
            levels,
            gen,
            l2,
        )
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("cannot quantize a tensor holding NaN or infinite values")
    return scales, codes


def _quantize_rows(xs, scale_out, code_out, work, levels, gen, l2) -> None:
    xs = xs.float()  # (rows, width)
    if l2:
        norm = torch.linalg.vector_norm(xs, 2, dim=1)
    else:  # absmax; two plain reductions beat vector_norm(inf) and abs().amax() on CPU
        norm = torch.maximum(xs.amax(dim=1), xs.amin(dim=1).neg_())
    norm.add_(0.0)  # -0.0 becomes 0.0: an all-zero block's scale is the same bytes on any path
    torch.div(norm, levels, out=scale_out)
    # levels x (1 / norm), spelled out: `levels / norm` is that inside torch, and the numpy path
    # below must round the same way (an exact division differs by an ulp at .5 ties)
    inv = torch.where(norm > 0, norm.reciprocal() * levels, 0.0)
    y = torch.mul(xs, inv[:, None], out=work[0])  # in [-levels, levels] up to rounding
    if gen is not None:
        y.add_(torch.rand(y.shape, generator=gen, device=y.device, out=work[1])).floor_()
        y.clamp_(-levels, levels)  # floor(levels + 1 ulp + u) could reach levels + 1
    else:
        y.round_()  # |y| <= levels * (1 + 1 ulp) rounds to at most levels: no clamp needed
    code_out.copy_(y)


def _quantize_small(a: np.ndarray, block: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """`quantize_blocks(seed=None)` of a small 1-D float32 array, in numpy (same results)."""
    n = a.size
    full = n // block
    parts = [a[: full * block].reshape(full, block)] if full else []
    if n % block:
        parts.append(a[full * block :].reshape(1, -1))
    scales = np.empty(full + (n % block > 0), dtype=np.float32)
    codes = np.empty(n, dtype=np.int8)
    at = row = 0
    for rows in parts:
        norm = np.maximum(rows.max(axis=1), -rows.min(axis=1)) + np.float32(0)  # as below
        np.divide(norm, np.float32(levels), out=scales[row : row + len(norm)])
        row += len(norm)
        with np.errstate(all="ignore"):  # subnormal norms overflow 1 / norm as torch's do
            inv = np.reciprocal(norm, out=np.zeros_like(norm), where=norm > 0)
            inv *= np.float32(levels)
            y = np.rint(rows * inv[:, None])
            codes[at : at + y.size] = y.reshape(-1)
        at += y.size
    if not np.isfinite(scales).all():
        raise ValueError("cannot quantize a tensor holding NaN or infinite values")
    return scales, codes


def dequantize_blocks(scales: torch.Tensor, codes: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `quantize_blocks`: float32 values, shape of `codes`."""
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    _dequantize_into(out, scales, codes, block, torch.mul)
    return out


def _dequantize_small(scales: np.ndarray, codes: np.ndarray, block: int) -> np.ndarray:
    """`dequantize_blocks` of small numpy arrays (same results)."""
    out = np.empty(codes.size, dtype=np.float32)
    with np.errstate(over="ignore"):  # a huge scale gives inf as torch's path does, silently
        _dequantize_into(out, scales, codes, block, np.multiply)
    return out


def _dequantize_into(out, scales, codes, block: int, multiply) -> None:
    """out = codes x their block's scale, for 1-D torch tensors (torch.mul) or numpy arrays
    (np.multiply): one multiply over the full blocks, one over the short last block."""
    n = codes.shape[0]
    full = n // block
    if full:
        multiply(codes[: full * block].reshape(full, block), scales[:full, None],
                 out=out[: full * block].reshape(full, block))  # fmt: skip
    if n % block:
        multiply(codes[full * block :], scales[full], out=out[full * block :])


def _pack_nibbles_small(codes: np.ndarray) -> np.ndarray:
    """`pack_nibbles` of int8 codes in [-8, 7] shifted to [0, 15], in numpy."""
    shifted = (codes + np.int8(8)).view(np.uint8)
    if shifted.size % 2:
        shifted = np.concatenate([shifted, np.zeros(1, np.uint8)])
    pairs = shifted.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


class _Blockwise(Codec):
    """Shared wire layout: params (block u32, flags u8), scales f32 * n_blocks, codes."""

    packed: ClassVar[bool]  # two 4-bit codes per byte instead of one int8 per byte

    def _levels(self) -> int:
        raise NotImplementedError

    def _rounding_seed(self, seed: int) -> int | None:
        return seed if self.stochastic else None

    def _flags(self) -> int:
        return int(self.stochastic)

    def _encode_body(self, x, shape, seed, state, name) -> list:
        params = self.block.to_bytes(4, "little") + self._flags().to_bytes(1, "little")
        rounding, l2 = self._rounding_seed(seed), self.name == "qsgd"
        if rounding is None and not l2 and x.numel() <= SMALL_NUMEL and x.device.type == "cpu":
            scales_np, codes_np = _quantize_small(x.detach().float().numpy(), self.block,
                                                  self._levels())  # fmt: skip
            if self._is_packed():
                codes_np = _pack_nibbles_small(codes_np)
            return [params, memoryview(scales_np).cast("B"), memoryview(codes_np).cast("B")]
        scales, codes = quantize_blocks(x, self.block, self._levels(), seed=rounding, l2=l2)
        if self._is_packed():
            codes = pack_nibbles((codes + 8).view(torch.uint8))
        return [params, as_buffer(scales), as_buffer(codes)]

    def _is_packed(self) -> bool:
        return self.packed

    def _body_nbytes(self, numel: int, shape) -> int:
        code_bytes = (numel + 1) // 2 if self._is_packed() else numel
        return 5 + 4 * math.ceil(numel / self.block) + code_bytes

    @classmethod
    def _read_params(cls, reader: Reader) -> tuple[int, int]:
        block, flags = reader.unpack("IB", f"{cls.name} params")
        if not 1 <= block <= _MAX_BLOCK:
            raise decode_error(f"{cls.name} block", block, f"1..{_MAX_BLOCK}")
        return block, flags

    @classmethod
    def _decode_codes(cls, reader, header, device, block, packed) -> torch.Tensor:
        n = header.numel
        if n <= SMALL_NUMEL and torch.device(device).type == "cpu":
            scales_np = reader.numpy(math.ceil(n / block), "<f4", f"{cls.name} scales")
            check_finite_scales(scales_np, f"{cls.name} scales")
            if packed:
                raw = reader.numpy((n + 1) // 2, "u1", f"{cls.name} codes")
                codes_np = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)[:n].view(np.int8)
                codes_np = codes_np - np.int8(8)
            else:
                codes_np = reader.numpy(n, "i1", f"{cls.name} codes")
            return torch.from_numpy(_dequantize_small(scales_np, codes_np, block))
        scales = reader.tensor(math.ceil(n / block), torch.float32, f"{cls.name} scales", device)
        check_finite_scales(scales, f"{cls.name} scales")
        if packed:
            raw = reader.tensor((n + 1) // 2, torch.uint8, f"{cls.name} codes", device)
            codes = unpack_nibbles(raw, n).to(torch.int8) - 8
        else:
            codes = reader.tensor(n, torch.int8, f"{cls.name} codes", device)
        return dequantize_blocks(scales, codes, block)


def _check_block(cls, block) -> None:
    if not isinstance(block, int) or not 1 <= block <= _MAX_BLOCK:
        raise field_error(cls, "block", block, f"an integer in 1..{_MAX_BLOCK}")


@register
@dataclass
class Int8(_Blockwise):
    """8-bit codes in [-127, 127], one float32 absmax scale per `block` elements.

    Deterministic round-to-nearest by default; `stochastic` rounds up with probability equal to
    the fractional part (unbiased).
    """

    block: int = 256
    stochastic: bool = False
    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3
    params: ClassVar[dict[str, type]] = {"block": int, "stochastic": bool}
    packed: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_block(type(self), self.block)

    def _levels(self) -> int:
        return 127

    @classmethod
    def _decode_body(cls, reader, header, device, max_numel) -> torch.Tensor:
        block, flags = cls._read_params(reader)
        if flags > 1:
            raise decode_error("int8 flags", flags, "0 or 1")
        return cls._decode_codes(reader, header, device, block, packed=False)


@register
@dataclass
class Int4(_Blockwise):
    """4-bit codes in [-7, 7] packed two per byte, one float32 absmax scale per block."""

    block: int = 64
    stochastic: bool = False
    name: ClassVar[str] = "int4"
    codec_id: ClassVar[int] = 4
    params: ClassVar[dict[str, type]] = {"block": int, "stochastic": bool}
    packed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_block(type(self), self.block)

    def _levels(self) -> int:
        return 7

    @classmethod
    def _decode_body(cls, reader, header, device, max_numel) -> torch.Tensor:
        block, flags = cls._read_params(reader)
        if flags > 1:
            raise decode_error("int4 flags", flags, "0 or 1")
        return cls._decode_codes(reader, header, device, block, packed=True)


@register
@dataclass
class QSGD(_Blockwise):
    """QSGD: s-level stochastic quantization of |x| / ||bucket||_2; unbiased.

    Codes are signed levels in [-s, s]: packed two per byte when s <= 7, else one int8 each.
    """

    levels: int = 16
    bucket: int = 512
    contractive: ClassVar[bool] = False  # (its noise grows past the values with few levels)
    name: ClassVar[str] = "qsgd"
    codec_id: ClassVar[int] = 5
    params: ClassVar[dict[str, type]] = {"levels": int, "bucket": int}
    packed: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.levels, int) or not 1 <= self.levels <= 127:
            raise field_error(type(self), "levels", self.levels, "an integer in 1..127")
        if not isinstance(self.bucket, int) or not 1 <= self.bucket <= _MAX_BLOCK:
            raise field_error(type(self), "bucket", self.bucket, f"an integer in 1..{_MAX_BLOCK}")

    @property
    def block(self) -> int:
        return self.bucket

    def _levels(self) -> int:
        return self.levels

    def _rounding_seed(self, seed: int) -> int | None:
        return seed

    def _flags(self) -> int:
        return self.levels

    def _is_packed(self) -> bool:
        return self.levels <= 7

    @classmethod
    def _decode_body(cls, reader, header, device, max_numel) -> torch.Tensor:
        bucket, levels = cls._read_params(reader)
        if not 1 <= levels <= 127:
            raise decode_error("qsgd levels", levels, "1..127")
        return cls._decode_codes(reader, header, device, bucket, packed=levels <= 7)


@register
@dataclass
class Sign(Codec):
    """Scaled sign (EF-signSGD): mean |x| as one float32, then 1 bit per element (1 = negative)."""

    name: ClassVar[str] = "sign"
    codec_id: ClassVar[int] = 9

    def _encode_body(self, x, shape, seed, state, name) -> list:
        n = x.numel()
        scale = torch.linalg.vector_norm(x, 1, dtype=torch.float32) / max(n, 1)
        if not bool(torch.isfinite(scale)):
            raise ValueError("cannot sign-encode a tensor holding NaN or infinite values")
        return [as_buffer(scale.reshape(1)), as_buffer(pack_bits(x < 0))]

    def _body_nbytes(self, numel: int, shape) -> int:
        return 4 + (numel + 7) // 8

    @classmethod
    def _decode_body(cls, reader, header, device, max_numel) -> torch.Tensor:
        n = header.numel
        scale = reader.tensor(1, torch.float32, "sign scale", device)
        check_finite_scales(scale, "sign scale")
        packed = reader.tensor((n + 7) // 8, torch.uint8, "sign bits", device)
        if n % 8 and int(packed[-1]) >> (n % 8):
            raise DecodeError("sign bits: padding bits after the last element are not zero")
        negative = unpack_bits(packed, n).view(torch.uint8)
        return negative.to(torch.float32).mul_(-2 * scale).add_(scale)  # 0 -> +s, 1 -> -s
