# Invariants: only tensors with >= 2 dims whose rank-r factors are smaller than the tensor itself
# are low-rank coded (viewed as (shape[0], rest)); all others go to `inner`. The warm-start factor
# Q lives in a caller-owned CodecState under the tensor's name, never in the codec.
"""PowerSGD: rank-r approximation by one power iteration with warm start (Vogels et al. 2019)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ._base import Codec, CodecState, dataclass, decode_error, field_error, register
from ._cast import NoneCodec
from ._wire import Header, as_buffer

_MAX_RANK = 1024


@register
@dataclass
class PowerSGD(Codec):
    """Send P (rows x r) and Q (cols x r) with M ~= P @ Q.T; P is orthonormalized (QR).

    With a CodecState, Q from the previous call on the same name starts the power iteration
    (warm start), which makes one iteration per step enough. Without it, Q starts from a seeded
    Gaussian. Other tensors (1-D, or too small to gain) are encoded with `inner`.
    """

    rank: int = 4
    inner: Codec = dataclasses.field(default_factory=NoneCodec)
    name: ClassVar[str] = "powersgd"
    codec_id: ClassVar[int] = 8
    params: ClassVar[dict[str, type]] = {"rank": int}

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or not 1 <= self.rank <= _MAX_RANK:
            raise field_error(type(self), "rank", self.rank, f"an integer in 1..{_MAX_RANK}")
        if not isinstance(self.inner, Codec) or isinstance(self.inner, PowerSGD):
            raise field_error(type(self), "inner", self.inner, "a codec other than powersgd")

    def fallback_for(self, shape) -> Codec | None:
        if len(shape) < 2 or shape[0] == 0:
            return self.inner
        rows = shape[0]
        cols = math.prod(shape) // rows
        if self.rank * (rows + cols) >= rows * cols:
            return self.inner
        return None

    def _encode_body(self, x, shape, seed, state: CodecState | None, name: str) -> list:
        rows = shape[0]
        m = x.float().view(rows, -1)  # (rows, cols)
        q = state.get(name) if state is not None else None
        if q is None or q.shape != (m.shape[1], self.rank) or q.device != m.device:
            gen = torch.Generator(device=m.device)
            gen.manual_seed(seed)
            q = torch.randn(m.shape[1], self.rank, generator=gen, device=m.device)
        p = torch.linalg.qr(m @ q).Q  # (rows, r), orthonormal columns
        q = m.T @ p  # (cols, r)
        if not bool(torch.isfinite(q).all()):
            raise ValueError("cannot PowerSGD-encode a tensor holding NaN or infinite values")
        if state is not None:
            state.set(name, q)
        return [self.rank.to_bytes(2, "little"), as_buffer(p), as_buffer(q)]

    def _body_nbytes(self, numel: int, shape) -> int:
        rows = shape[0]
        return 2 + 4 * self.rank * (rows + numel // rows)

    @classmethod
    def _decode_body(cls, reader, header: Header, device, max_numel) -> torch.Tensor:
        if len(header.shape) < 2 or header.shape[0] == 0:
            raise decode_error("powersgd shape", header.shape, "2+ dims, rows > 0")
        rows = header.shape[0]
        cols = header.numel // rows
        (rank,) = reader.unpack("H", "powersgd rank")
        if not 1 <= rank <= min(rows, cols, _MAX_RANK):
            raise decode_error("powersgd rank", rank, f"1..{min(rows, cols, _MAX_RANK)}")
        p = reader.tensor(rows * rank, torch.float32, "powersgd P", device).view(rows, rank)
        q = reader.tensor(cols * rank, torch.float32, "powersgd Q", device).view(cols, rank)
        return (p @ q.T).reshape(-1)
