# Invariants: each element decodes to its own sign times one of its block's two magnitudes, and
# each magnitude is the mean of the |x| coded with it (a centroid), so ||decode(encode(x)) - x||
# <= ||x|| for every block (the codec is a contraction, as error feedback needs). Magnitudes on
# the wire are float32, finite and >= 0 (checked on decode); padding bits are zero.
"""`int2`: 2 bits an element, a sign and a choice between two magnitudes per block.

Made for the values top-k keeps (`topk:0.02+int2`): they are all large, so a level at zero
(which uniform 2-bit grids spend a code on) would be wasted; two centroid magnitudes per block
fit their spread instead (one Lloyd step from a split at the block's mean magnitude).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ._base import Codec, dataclass, decode_error, field_error, register
from ._bits import pack_bits, unpack_bits
from ._errors import DecodeError
from ._wire import as_buffer, check_finite_scales

_MAX_BLOCK = 1 << 24


def _centroids(mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of magnitudes (rows, width): (low, high) centroids (rows,) and the high mask."""
    split = mag.mean(dim=1, keepdim=True)
    for _ in range(2):  # the mean split, then one Lloyd step: the midpoint of the centroids
        high = mag > split
        n_high = high.sum(dim=1)
        sum_high = torch.where(high, mag, 0.0).sum(dim=1)
        hi = sum_high / n_high.clamp(min=1)
        lo = (mag.sum(dim=1) - sum_high) / (mag.shape[1] - n_high).clamp(min=1)
        split = ((lo + hi) / 2).unsqueeze(1)
    return lo, hi, high


@register
@dataclass
class Int2(Codec):
    """2-bit codes: a sign bit and a magnitude bit choosing the block's low or high centroid.

    Wire: block:u32 | (low, high):f32 * n_blocks | 2 bits an element (bit 2i: negative, bit
    2i+1: high), 4 elements a byte. At the default block of 512: 2.125 bits an element.
    """

    block: int = 512
    name: ClassVar[str] = "int2"
    codec_id: ClassVar[int] = 10
    params: ClassVar[dict[str, type]] = {"block": int}

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or not 1 <= self.block <= _MAX_BLOCK:
            raise field_error(type(self), "block", self.block, f"an integer in 1..{_MAX_BLOCK}")

    def _encode_body(self, x, shape, seed, state, name) -> list:
        n = x.numel()
        values = x.float()
        if not bool(torch.isfinite(values).all()):
            raise ValueError("cannot int2-encode a tensor holding NaN or infinite values")
        full = n // self.block
        rows = [values[: full * self.block].view(full, self.block)] if full else []
        if n % self.block:
            rows.append(values[full * self.block :].view(1, -1))
        levels, highs = [], []
        for part in rows:
            lo, hi, high = _centroids(part.abs())
            levels.append(torch.stack([lo, hi], dim=1))  # (rows, 2)
            highs.append(high.reshape(-1))
        level_t = torch.cat(levels) if levels else values.new_empty(0, 2)
        high_t = torch.cat(highs) if highs else values.new_empty(0, dtype=torch.bool)
        codes = torch.stack([values < 0, high_t], dim=1).reshape(-1)  # (2n,) sign, high
        return [self.block.to_bytes(4, "little"), as_buffer(level_t), as_buffer(pack_bits(codes))]

    def _body_nbytes(self, numel: int, shape) -> int:
        return 4 + 8 * math.ceil(numel / self.block) + (2 * numel + 7) // 8

    @classmethod
    def _decode_body(cls, reader, header, device, max_numel) -> torch.Tensor:
        n = header.numel
        (block,) = reader.unpack("I", "int2 block")
        if not 1 <= block <= _MAX_BLOCK:
            raise decode_error("int2 block", block, f"1..{_MAX_BLOCK}")
        blocks = math.ceil(n / block)
        levels = reader.tensor(2 * blocks, torch.float32, "int2 magnitudes", device)
        check_finite_scales(levels, "int2 magnitudes")
        packed = reader.tensor((2 * n + 7) // 8, torch.uint8, "int2 codes", device)
        if (2 * n) % 8 and int(packed[-1]) >> ((2 * n) % 8):
            raise DecodeError("int2 codes: padding bits after the last element are not zero")
        codes = unpack_bits(packed, 2 * n).view(n, 2)
        level = levels.view(blocks, 2).repeat_interleave(block, dim=0)[:n]  # (n, 2)
        magnitude = torch.where(codes[:, 1], level[:, 1], level[:, 0])
        return torch.where(codes[:, 0], -magnitude, magnitude)
