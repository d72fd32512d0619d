"""Codec specs: the documented examples parse, canonical specs round-trip, bad specs say why."""

import pytest

from geotrain.compress import Int8, PowerSGD, TopK, codec_names, get_codec

EXAMPLES = [
    "none",
    "fp16",
    "bf16",
    "sign",
    "int8",
    "int8:block=256,stochastic",
    "int4:block=32",
    "qsgd:levels=16",
    "qsgd:levels=4,bucket=1024",
    "topk:0.01",
    "topk:0.01+int8",
    "topk:fraction=0.01,tol=0.05+fp16",
    "randk:0.01",
    "randk:0.01,unscaled+fp16",
    "powersgd:rank=4",
    "powersgd:rank=4+fp16",
    "powersgd:rank=2+topk:0.1+int8",
]


@pytest.mark.parametrize("spec", EXAMPLES)
def test_examples_parse_and_their_canonical_spec_round_trips(spec):
    codec = get_codec(spec)
    assert get_codec(codec.spec) == codec


def test_parameters_land_where_expected():
    assert get_codec("int8:block=128,stochastic") == Int8(block=128, stochastic=True)
    assert get_codec("topk:0.01+int8") == TopK(fraction=0.01, inner=Int8())
    assert get_codec("powersgd:rank=4").rank == 4
    assert isinstance(get_codec("powersgd:rank=4+topk:0.1").inner, TopK)
    assert isinstance(get_codec(" powersgd:rank=2 "), PowerSGD)


def test_codec_names_lists_every_codec():
    assert codec_names() == sorted(
        "none fp16 bf16 int8 int4 int2 qsgd topk randk powersgd sign".split()
    )


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("zip", "unknown codec 'zip'"),
        ("int8:block=0", "block=0: expected an integer in 1.."),
        ("int8:block=x", "block='x': expected a int"),
        ("int8:size=3", "unknown parameter 'size' of int8"),
        ("int8:block=2,block=4", "'block' given twice"),
        ("topk:1.5", "fraction=1.5: expected a number in (0, 1]"),
        ("topk:nan", "fraction='nan': expected a float"),
        ("topk:0.01+qsgd", "expected a value codec"),
        ("topk:0.01+zip", "inner codec: codec spec 'zip'"),
        ("sign:3", "argument '3' of sign"),
        ("fp16+int8", "fp16 takes no '+int8' inner codec"),
        ("powersgd:rank=4+powersgd", "expected a codec other than powersgd"),
    ],
)
def test_a_bad_spec_names_the_spec_and_the_problem(spec, says):
    with pytest.raises(ValueError) as info:
        get_codec(spec)
    assert f"codec spec {spec!r}" in str(info.value)
    assert says in str(info.value)
