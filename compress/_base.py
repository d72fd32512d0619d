# Invariants: a codec object is an immutable, validated config (frozen dataclass) with a canonical
# `spec`; `encode` never mutates its input and returns exactly the bytes that go on the wire; every
# payload starts with the shared header, so `decode` needs no out-of-band knowledge. Stateful
# codecs keep state only in a caller-owned CodecState.
"""Codec base class, the codec-id table, and the top-level `decode`."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ._errors import DecodeError
from ._wire import DTYPE_CODES, Header, Reader, header_nbytes, pack_header, read_header

_CODECS: dict[int, type[Codec]] = {}
_ALLOWED_IDS: dict[tuple[str, ...] | None, frozenset[int]] = {}  # see _codec_ids


class CodecState:
    """Caller-owned state of stateful codecs (PowerSGD warm starts), keyed by tensor name.

    Save it with `state_dict()` and restore it with `load_state_dict()` for checkpoints.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor | None:
        return self._tensors.get(name)

    def set(self, name: str, value: torch.Tensor) -> None:
        self._tensors[name] = value

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in state.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"CodecState entry {name!r}: expected a float tensor, got {t!r}")
        self._tensors = {name: t.clone() for name, t in state.items()}

    def reset(self) -> None:
        self._tensors.clear()


class Codec:
    """Base class of all codecs. Subclasses are frozen dataclasses registered with `register`."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    # Parameters accepted in a spec, in positional order: field name -> parser.
    params: ClassVar[dict[str, type]] = {}
    inner_allowed: ClassVar[tuple[str, ...]] = ()

    # Whether it sends only some of a tensor's values (the rest decode as 0.0): a receiver that
    # averages whole models must leave the values that were not sent as they are, not move them
    # toward zero. Quantizers and low-rank codecs carry (an approximation of) every value.
    sparse: ClassVar[bool] = False

    @property
    def contractive(self) -> bool:
        """Whether what the codec drops never exceeds what it compresses (||C(x) - x|| <= ||x||,
        in expectation for a random one), as error feedback and averaging whole models need.
        Unbiased codecs that scale up what they keep (qsgd, randk) are not; a codec with an inner
        one is when both are."""
        inner = getattr(self, "inner", None)
        return inner is None or inner.contractive

    @property
    def spec(self) -> str:
        """Canonical spec string; `get_codec(c.spec) == c`."""
        parts = []
        for field in self.params:
            value = getattr(self, field)
            if isinstance(value, bool):
                if value:
                    parts.append(field)
            else:
                parts.append(
                    f"{field}={value!r}" if isinstance(value, float) else f"{field}={value}"
                )
        text = self.name + (":" + ",".join(parts) if parts else "")
        inner = getattr(self, "inner", None)
        return text + ("+" + inner.spec if inner is not None else "")

    def encode(
        self,
        t: torch.Tensor,
        *,
        seed: int = 0,
        state: CodecState | None = None,
        name: str = "",
    ) -> bytes:
        """Encode one tensor into a self-describing payload.

        Args:
            t: a floating-point tensor on any device; it is not modified.
            seed: seeds all randomness (stochastic rounding, sampling); carried in the payload.
            state: warm-start state of stateful codecs; ignored by the others.
            name: key of this tensor in `state`.

        Returns:
            The exact bytes to send; `len()` of them is the wire size.
        """
        return b"".join(self.encode_parts(t, seed=seed, state=state, name=name))

    def encode_parts(
        self,
        t: torch.Tensor,
        *,
        seed: int = 0,
        state: CodecState | None = None,
        name: str = "",
    ) -> list[bytes | memoryview]:
        """`encode`'s payload as the pieces that make it, not yet joined: a caller that puts the
        payload into a bigger one joins once (the pieces may view `t`'s memory: join them before
        `t` changes)."""
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPE_CODES:
            raise TypeError(f"expected a float16/bfloat16/float32/float64 tensor, got {t!r:.80}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed}: expected 0 <= seed < 2**64")
        fallback = self.fallback_for(tuple(t.shape))
        if fallback is not None:
            return fallback.encode_parts(t, seed=seed, state=state, name=name)
        x = t.detach().reshape(-1)
        header = pack_header(Header(self.codec_id, t.dtype, tuple(t.shape), seed))
        return [header, *self._encode_body(x, tuple(t.shape), seed, state, name)]

    def fallback_for(self, shape: tuple[int, ...]) -> Codec | None:
        """The codec used instead of this one for a tensor of `shape`, or None."""
        return None

    def expected_nbytes(self, numel: int, *, shape: tuple[int, ...] | None = None) -> int:
        """Bytes `encode` produces for a tensor of `numel` elements (of `shape` if given).

        Exact for fixed-size codecs; an estimate for topk (index width depends on the data).
        Without `shape`, a 1-D tensor is assumed.
        """
        shape = (numel,) if shape is None else tuple(shape)
        fallback = self.fallback_for(shape)
        if fallback is not None:
            return fallback.expected_nbytes(numel, shape=shape)
        return header_nbytes(len(shape)) + self._body_nbytes(numel, shape)

    def _encode_body(
        self,
        x: torch.Tensor,
        shape: tuple[int, ...],
        seed: int,
        state: CodecState | None,
        name: str,
    ) -> list:
        raise NotImplementedError

    def _body_nbytes(self, numel: int, shape: tuple[int, ...]) -> int:
        raise NotImplementedError

    @classmethod
    def _decode_body(
        cls, reader: Reader, header: Header, device: torch.device | str, max_numel: int
    ) -> torch.Tensor:
        """Decode the body into a flat float tensor of `header.numel` elements on `device`."""
        raise NotImplementedError


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec class decodable by its id."""
    if cls.codec_id in _CODECS:
        raise RuntimeError(f"codec id {cls.codec_id} registered twice")
    _CODECS[cls.codec_id] = cls
    _ALLOWED_IDS.clear()
    return cls


def codec_classes() -> dict[str, type[Codec]]:
    """All registered codec classes by name."""
    return {cls.name: cls for cls in _CODECS.values()}


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_numel: int,
    device: torch.device | str = "cpu",
    allowed: tuple[str, ...] | None = None,
    borrow: bool = False,
) -> torch.Tensor:
    """Decode one payload made by `Codec.encode`.

    Args:
        data: untrusted bytes.
        max_numel: the most elements the caller accepts; checked before allocating.
        device: where the result lives.
        allowed: codec names accepted (None: all).
        borrow: the result may share memory with `data` when `data` is writable (uncompressed
            values on the CPU): the caller owns that buffer and leaves it as it is.

    Returns:
        A tensor with the encoded shape and dtype on `device`.

    Raises:
        DecodeError: for any malformed, truncated, inconsistent or over-budget input.
    """
    if max_numel < 0:
        raise ValueError(f"max_numel={max_numel}: expected >= 0")
    reader = Reader(data, borrow=borrow)
    header = read_header(reader, max_numel, _codec_ids(allowed))
    cls = _CODECS[header.codec_id]
    flat = cls._decode_body(reader, header, device, max_numel)
    reader.finish(f"{cls.name} payload")
    if flat.numel() != header.numel:  # a codec bug, not bad input
        raise AssertionError(f"{cls.name} decoded {flat.numel()} of {header.numel} elements")
    if flat.dtype != header.dtype:
        flat = flat.to(header.dtype)
    return flat.reshape(header.shape)


def _codec_ids(allowed: tuple[str, ...] | None) -> frozenset[int]:
    """The ids of the codecs named in `allowed` (None: all), remembered per `allowed`."""
    key = None if allowed is None else tuple(allowed)
    ids = _ALLOWED_IDS.get(key)
    if ids is None:
        ids = _ALLOWED_IDS[key] = frozenset(
            i for i, c in _CODECS.items() if key is None or c.name in key)
    return ids


def field_error(cls: type, field: str, value: object, expected: str) -> ValueError:
    """A config error naming the codec, field, value and what was expected."""
    return ValueError(f"{cls.__name__}.{field}={value!r}: expected {expected}")


def decode_error(what: str, value: object, expected: str) -> DecodeError:
    return DecodeError(f"{what}={value!r}: expected {expected}")


# Every codec is a frozen (immutable, hashable) dataclass: `@dataclass` below means this.
dataclass = dataclasses.dataclass(frozen=True)
