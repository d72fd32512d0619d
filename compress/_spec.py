# Invariants: get_codec(c.spec) == c for every codec c; a bad spec raises ValueError naming the
# whole spec, the bad part and what was expected, never another exception.
"""Codec specs: `name[:arg,key=value,flag,...][+inner-spec]`.

Grammar, by example:
    none | fp16 | bf16 | sign
    int8                      int8:block=256,stochastic     int4:block=64     int2:block=512
    qsgd:levels=16            qsgd:levels=4,bucket=1024
    topk:0.01                 topk:0.01+int8                topk:fraction=0.01,tol=0.05+fp16
    topk:0.02+int2            topk:0.02+sign                (SparseLoCo-class: 2 or 1 bit values)
    randk:0.01                randk:0.01,unscaled+fp16
    powersgd:rank=4           powersgd:rank=4+fp16          (the codec after '+' is the fallback)

The first argument may be given without its key (`topk:0.01`); boolean parameters are set by
naming them (`stochastic`). After `+` comes the inner codec: the value codec of topk/randk
(none, fp16, bf16, int8, int4, int2 or sign), or PowerSGD's codec for tensors it does not
low-rank code.
"""

from __future__ import annotations

import dataclasses
import math

from ._base import Codec, codec_classes

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def codec_names() -> list[str]:
    """Names of all codecs `get_codec` accepts."""
    return sorted(codec_classes())


def get_codec(spec: str) -> Codec:
    """Build the codec a spec names (see the module docstring for the grammar).

    Raises:
        ValueError: naming the spec, the bad part and what was expected.
    """
    if not isinstance(spec, str):
        raise ValueError(f"codec spec {spec!r}: expected a string")
    head, plus, rest = spec.strip().partition("+")
    name, colon, args = head.partition(":")
    name = name.strip()
    classes = codec_classes()
    if name not in classes:
        raise ValueError(
            f"codec spec {spec!r}: unknown codec {name!r}, expected one of {codec_names()}"
        )
    cls = classes[name]
    kwargs = _parse_args(spec, cls, args.split(",") if colon else [])
    if plus:
        if "inner" not in {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"codec spec {spec!r}: {name} takes no '+{rest}' inner codec")
        try:
            kwargs["inner"] = get_codec(rest)
        except ValueError as exc:
            raise ValueError(f"codec spec {spec!r}: inner codec: {exc}") from None
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"codec spec {spec!r}: {exc}") from None


def _parse_args(spec: str, cls: type[Codec], args: list[str]) -> dict:
    kwargs: dict = {}
    for position, raw in enumerate(args):
        arg = raw.strip()
        if "=" in arg:
            key, value = (s.strip() for s in arg.split("=", 1))
        elif cls.params.get(arg) is bool:
            key, value = arg, "true"
        elif position == 0 and cls.params:
            key, value = next(iter(cls.params)), arg
        else:
            raise ValueError(
                f"codec spec {spec!r}: argument {arg!r} of {cls.name}: expected "
                f"key=value with key in {sorted(cls.params)}"
            )
        if key not in cls.params:
            raise ValueError(
                f"codec spec {spec!r}: unknown parameter {key!r} of {cls.name}, "
                f"expected one of {sorted(cls.params)}"
            )
        if key in kwargs:
            raise ValueError(f"codec spec {spec!r}: parameter {key!r} given twice")
        kwargs[key] = _parse_value(spec, key, value, cls.params[key])
    return kwargs


def _parse_value(spec: str, key: str, value: str, kind: type) -> object:
    text = value.lower()
    if kind is bool and text in _TRUE | _FALSE:
        return text in _TRUE
    try:
        if kind is int:
            return int(value)
        if kind is float and math.isfinite(float(value)):
            return float(value)
    except ValueError:
        pass
    raise ValueError(f"codec spec {spec!r}: {key}={value!r}: expected a {kind.__name__}")
