# Invariants: every read is bounds-checked before it happens and raises DecodeError (never
# IndexError/struct.error); a tensor is only allocated after its byte length has been checked
# against the bytes actually present, so an allocation never exceeds len(data) plus what the
# caller's max_numel allows. All integers are little-endian.
"""Byte-level pieces of the wire format: header, bounded reader, tensor <-> bytes views.

Single-tensor payload, version 1 (all integers little-endian)::

    b"GT"  version:u8  codec_id:u8  dtype:u8  ndim:u8  seed:u64  shape:u64 * ndim
    codec parameters and body (layout per codec, see each codec's _encode_body):
      none/fp16/bf16  values (4 or 2 bytes each)
      int8/int4/qsgd  block:u32 flags:u8 | scales:f32 * ceil(n / block) | codes (1 byte or 1/2)
      sign            scale:f32 | bits (ceil(n / 8), bit i of byte j = element 8j + i, 1 = negative)
      int2            block:u32 | (low, high):f32 * ceil(n / block) | 2 bits each (negative, high)
      topk            k:u64 mode:u8 width:u8 | index | len:u64 values-payload, the index one of
                      mode 0: gaps (k * width); mode 1 (width 0): bitmap (ceil(n / 8));
                      mode 2: long:u64 | short gaps:u8 * k (255: long) | long gaps (long * width)
                      mode 3 (width: Rice parameter b): Golomb-Rice gaps, see _rice
      randk           draws:u64 unscaled:u8 | len:u64 values-payload (indices come from the seed)
      powersgd        rank:u16 | P:f32 * rows * rank | Q:f32 * cols * rank

`values-payload` is itself a single-tensor payload of a dense value codec. The decoded tensor has
the header's dtype and shape. Named payloads (several tensors) are described in `_named`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ._errors import DecodeError

MAGIC = b"GT"
VERSION = 1
MAX_NDIM = 8
# dtype code on the wire -> torch dtype. The decoded tensor is returned in this dtype.
DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.float64,
}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
_HEADER = struct.Struct("<2sBBBBQ")  # magic, version, codec id, dtype code, ndim, seed


@dataclass(frozen=True)
class Header:
    """The part of a single-tensor payload every codec shares."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    seed: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def header_nbytes(ndim: int) -> int:
    """Size in bytes of a header for a tensor with `ndim` dimensions."""
    return _HEADER.size + 8 * ndim


def pack_header(header: Header) -> bytes:
    """Serialize a header (the caller has validated its fields)."""
    code = DTYPE_CODES[header.dtype]
    head = _HEADER.pack(MAGIC, VERSION, header.codec_id, code, len(header.shape), header.seed)
    return head + struct.pack(f"<{len(header.shape)}Q", *header.shape)


class Reader:
    """Bounds-checked sequential reader over untrusted bytes."""

    def __init__(self, data: bytes | bytearray | memoryview, *, borrow: bool = False) -> None:
        """`borrow`: `tensor` may return views of `data`'s memory when it is writable (the
        caller owns that buffer and will not change it), instead of copies."""
        try:
            self._view = memoryview(data).cast("B")
        except TypeError as exc:
            raise DecodeError(f"payload is not a contiguous bytes-like object: {exc}") from None
        self._pos = 0
        self._borrow = borrow and not self._view.readonly

    @property
    def remaining(self) -> int:
        return len(self._view) - self._pos

    def take(self, n: int, what: str) -> memoryview:
        """Return the next `n` bytes, or raise DecodeError naming `what` was truncated."""
        if n < 0 or n > self.remaining:
            raise DecodeError(f"truncated {what}: needs {n} bytes, {self.remaining} left")
        view = self._view[self._pos : self._pos + n]
        self._pos += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple:
        """Read one struct `fmt` (little-endian is forced)."""
        st = _STRUCTS.get(fmt)
        if st is None:
            st = _STRUCTS[fmt] = struct.Struct("<" + fmt)
        return st.unpack(self.take(st.size, what))

    def finish(self, what: str) -> None:
        """Raise DecodeError if bytes are left over after `what`."""
        if self.remaining:
            raise DecodeError(f"{self.remaining} trailing bytes after {what}")

    def tensor(
        self, count: int, dtype: torch.dtype, what: str, device: torch.device | str
    ) -> torch.Tensor:
        """Read `count` elements of `dtype` into a tensor on `device`: a fresh one, or on the
        CPU a view of the payload when the reader borrows."""
        view = self.take(count * dtype.itemsize, what)
        if count == 0:
            return torch.empty(0, dtype=dtype, device=device)
        # torch needs a writable buffer: the payload's own when it may be borrowed, else a copy
        raw = view if self._borrow else bytearray(view)
        t = torch.frombuffer(raw, dtype=dtype)
        return t if torch.device(device).type == "cpu" else t.to(device)

    def numpy(self, count: int, dtype: str, what: str) -> np.ndarray:
        """Read `count` elements of numpy `dtype` (e.g. '<u2'); the array is read-only."""
        itemsize = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(count * itemsize, what), dtype=dtype)


_STRUCTS: dict[str, struct.Struct] = {}  # compiled formats (a model of many small tensors reads
# a few per tensor: building them afresh is a visible share of decoding it)


def read_header(reader: Reader, max_numel: int, codec_ids: set[int] | frozenset[int]) -> Header:
    """Parse and validate a single-tensor header."""
    magic, version, codec_id, code, ndim, seed = reader.unpack(_HEADER.format[1:], "header")
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DecodeError(f"unsupported format version {version}, expected {VERSION}")
    if codec_id not in codec_ids:
        raise DecodeError(f"unknown codec id {codec_id}")
    if code not in DTYPES:
        raise DecodeError(f"unknown dtype code {code}, expected one of {sorted(DTYPES)}")
    if ndim > MAX_NDIM:
        raise DecodeError(f"ndim {ndim} exceeds the maximum {MAX_NDIM}")
    shape = reader.unpack(f"{ndim}Q", "shape")
    limit = max(max_numel, 1)
    for dim in shape:  # each dimension too: (0, 2**63) has no elements yet cannot be reshaped to
        if dim > limit:
            raise DecodeError(f"shape {tuple(shape)}: dimension {dim} over max_numel={max_numel}")
    numel = math.prod(shape)
    if numel > max_numel:
        raise DecodeError(f"shape {tuple(shape)} has {numel} elements, over max_numel={max_numel}")
    return Header(codec_id, DTYPES[code], tuple(shape), seed)


def as_buffer(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a tensor's data (moved to CPU first if needed)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def check_finite_scales(scales: torch.Tensor | np.ndarray, what: str) -> None:
    """Raise DecodeError unless every scale is finite and non-negative."""
    if isinstance(scales, torch.Tensor) and scales.device.type == "cpu" and scales.numel() <= 64:
        scales = scales.numpy()  # a few scales: numpy's checks cost a fraction of torch's
    if isinstance(scales, torch.Tensor):
        ok = bool(torch.isfinite(scales).all() & (scales >= 0).all())
    else:
        ok = bool(np.isfinite(scales).all() and (scales >= 0).all())
    if not ok:
        raise DecodeError(f"{what} contain a negative, NaN or infinite value")
