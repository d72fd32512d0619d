# Invariants: a named payload is MAGIC, version, count, then per tensor (name length u16, UTF-8
# name, payload length u64, single-tensor payload); names are unique; decoding spends one
# max_numel budget over all tensors and checks every length before slicing.
"""One payload for many named tensors (a whole model's parameters or updates)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from ._base import Codec, CodecState, decode
from ._errors import DecodeError
from ._feedback import ErrorFeedback
from ._wire import Header, Reader, pack_header

MAGIC = b"GN"
VERSION = 1
_HEAD = struct.Struct("<2sBI")  # magic, version, count
_MIN_ENTRY = 2 + 8 + 14  # name length, payload length, smallest single-tensor payload
_GOLDEN = 0x9E3779B97F4A7C15


def tensor_seed(seed: int, index: int) -> int:
    """The seed used for the `index`-th tensor of a named payload made with `seed`."""
    return (seed + (index + 1) * _GOLDEN) % 2**64


def _check_unique(names: list[str], who: str) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: tensor names must be unique, got {names[:5]}")


def _entry_prefix(name: str, length: int, who: str) -> bytes:
    """What precedes a tensor's payload of `length` bytes: its name's length, name, length."""
    raw_name = name.encode("utf-8")
    if len(raw_name) > 0xFFFF:
        raise ValueError(f"{who}: name {name[:40]!r}... is over 65535 bytes")
    return struct.pack("<H", len(raw_name)) + raw_name + struct.pack("<Q", length)


def encode_named(
    tensors: Sequence[tuple[str, torch.Tensor]],
    codec: Codec,
    *,
    error_feedback: ErrorFeedback | None = None,
    seed: int = 0,
    state: CodecState | None = None,
) -> bytes:
    """Encode named tensors into one payload.

    Each tensor is coded by `codec` or by its fallback for that shape (e.g. PowerSGD on a bias).

    Args:
        tensors: (name, tensor) pairs; names must be unique.
        codec: the codec for all tensors.
        error_feedback: if given, residuals are added and kept per name.
        seed: base seed; each tensor gets `tensor_seed(seed, i)`.
        state: warm-start state of stateful codecs, keyed by name.

    Returns:
        The payload; `len()` of it is the wire size.
    """
    _check_unique([name for name, _ in tensors], "encode_named")
    parts = [_HEAD.pack(MAGIC, VERSION, len(tensors))]
    for i, (name, t) in enumerate(tensors):
        s = tensor_seed(seed, i)
        if error_feedback is not None:
            pieces: list = [error_feedback.encode(t, name=name, seed=s, codec=codec, state=state)]
        else:
            pieces = codec.encode_parts(t, seed=s, state=state, name=name)
        length = sum(memoryview(p).nbytes for p in pieces)
        parts += [_entry_prefix(name, length, "encode_named"), *pieces]
    return b"".join(parts)  # the one copy of the values


def dense_named_payload(
    entries: Sequence[tuple[str, int, torch.dtype]], *, seed: int = 0
) -> tuple[bytearray, list[torch.Tensor]]:
    """An uncompressed (codec `none`) named payload of 1-D tensors whose values are still to be
    written: the payload, and for each tensor a float32 view of its values inside it. Once every
    view is filled with tensor i's values, the payload is exactly what `encode_named` makes of
    those tensors with codec none and `seed`, so a caller can read a model straight into the
    message (one copy, where copying the tensors out and then encoding them made two).

    Args:
        entries: (name, number of elements, the tensor's dtype, which its header records).
    """
    from ._cast import NoneCodec  # noqa: PLC0415 (the codecs import this module's package)

    _check_unique([name for name, _, _ in entries], "dense_named_payload")
    heads = []
    for i, (name, numel, dtype) in enumerate(entries):
        header = pack_header(Header(NoneCodec.codec_id, dtype, (numel,), tensor_seed(seed, i)))
        heads.append(_entry_prefix(name, len(header) + 4 * numel, "dense_named_payload") + header)
    values = sum(4 * numel for _, numel, _ in entries)
    payload = bytearray(_HEAD.size + sum(len(h) for h in heads) + values)
    payload[: _HEAD.size] = _HEAD.pack(MAGIC, VERSION, len(entries))
    at, views = _HEAD.size, []
    for head, (_, numel, _) in zip(heads, entries, strict=True):
        payload[at : at + len(head)] = head
        at += len(head)
        views.append(torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=at)
                     if numel else torch.empty(0))  # fmt: skip
        at += 4 * numel
    return payload, views


def expected_nbytes_named(shapes: Sequence[tuple[str, tuple[int, ...]]], codec: Codec) -> int:
    """`len(encode_named(...))` for tensors of these names and shapes (estimate for topk)."""
    total = _HEAD.size
    for name, shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        total += 10 + len(name.encode("utf-8")) + codec.expected_nbytes(numel, shape=tuple(shape))
    return total


def decode_named(
    data: bytes | bytearray | memoryview,
    *,
    max_numel: int,
    device: torch.device | str = "cpu",
    allowed: tuple[str, ...] | None = None,
    borrow: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """Decode a payload made by `encode_named`.

    Args:
        data: untrusted bytes.
        max_numel: the most elements accepted over all tensors together.
        device: where the tensors are placed.
        allowed: codec names accepted for every tensor (None: all); see `codec_family`.
        borrow: tensors may share memory with `data` when it is writable (see `decode`).

    Raises:
        DecodeError: for any malformed, truncated, inconsistent or over-budget input.
    """
    reader = Reader(data)
    magic, version, count = reader.unpack(_HEAD.format[1:], "named header")
    if magic != MAGIC:
        raise DecodeError(f"bad named-payload magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DecodeError(f"unsupported named-payload version {version}, expected {VERSION}")
    if count * _MIN_ENTRY > reader.remaining:
        raise DecodeError(f"named payload claims {count} tensors in {reader.remaining} bytes")
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    budget = max_numel
    for i in range(count):
        (name_len,) = reader.unpack("H", f"name length of tensor {i}")
        try:
            name = str(reader.take(name_len, f"name of tensor {i}"), "utf-8")
        except UnicodeDecodeError:
            raise DecodeError(f"name of tensor {i} is not valid UTF-8") from None
        if name in seen:
            raise DecodeError(f"tensor name {name!r} appears twice")
        seen.add(name)
        (length,) = reader.unpack("Q", f"payload length of {name!r}")
        try:
            t = decode(
                reader.take(length, f"payload of {name!r}"),
                max_numel=budget,
                device=device,
                allowed=allowed,
                borrow=borrow,
            )
        except DecodeError as exc:
            raise DecodeError(f"tensor {name!r}: {exc}") from None
        budget -= t.numel()
        out.append((name, t))
    reader.finish("named payload")
    return out


def codec_family(codec: Codec) -> tuple[str, ...]:
    """The codec names a payload made with `codec` may hold: it and its fallbacks (`+inner`).

    A receiver that agreed on `codec` passes this as `decode_named(allowed=...)`, so a peer cannot
    make it decode a codec it never agreed to (e.g. an expensive low-rank one).
    """
    names = []
    current: Codec | None = codec
    while current is not None:
        names.append(current.name)
        current = getattr(current, "inner", None)
    return tuple(names)
