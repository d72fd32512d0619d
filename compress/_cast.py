# Invariants: cast codecs send every element, in a fixed number of bytes each; the payload size
# depends only on numel and ndim. Values out of float16 range become +-inf (as torch casts them).
"""Dense codecs: `none` (float32), `fp16`, `bf16`."""

from __future__ import annotations

from typing import ClassVar

import torch

from ._base import Codec, dataclass, register
from ._wire import Header, Reader, as_buffer


class _Cast(Codec):
    wire_dtype: ClassVar[torch.dtype]

    def _encode_body(self, x, shape, seed, state, name) -> list:
        return [as_buffer(x.to(self.wire_dtype))]

    def _body_nbytes(self, numel: int, shape: tuple[int, ...]) -> int:
        return numel * torch.empty((), dtype=self.wire_dtype).element_size()

    @classmethod
    def _decode_body(cls, reader: Reader, header: Header, device, max_numel) -> torch.Tensor:
        # bfloat16 has no numpy dtype: its bytes travel as int16 and are reinterpreted.
        carrier = torch.int16 if cls.wire_dtype == torch.bfloat16 else cls.wire_dtype
        t = reader.tensor(header.numel, carrier, f"{cls.name} values", device)
        return t.view(cls.wire_dtype)


@register
@dataclass
class NoneCodec(_Cast):
    """No compression: float32 values (4 bytes per element)."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0
    wire_dtype: ClassVar[torch.dtype] = torch.float32


@register
@dataclass
class FP16(_Cast):
    """IEEE half precision (2 bytes per element)."""

    name: ClassVar[str] = "fp16"
    codec_id: ClassVar[int] = 1
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@register
@dataclass
class BF16(_Cast):
    """bfloat16 (2 bytes per element, float32's range)."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 2
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
