"""The bounded reader: every short read is a DecodeError naming what was cut."""

import struct

import pytest
import torch

from geotrain import compress
from geotrain.compress import DecodeError
from geotrain.compress._wire import Header, Reader, header_nbytes, pack_header, read_header


def test_a_header_round_trips():
    header = Header(codec_id=3, dtype=torch.bfloat16, shape=(2, 3, 4), seed=2**64 - 1)
    data = pack_header(header)
    assert len(data) == header_nbytes(3)
    assert read_header(Reader(data), max_numel=24, codec_ids={3}) == header


def test_short_reads_name_the_field():
    reader = Reader(b"\x01\x02")
    with pytest.raises(DecodeError, match="truncated gap list: needs 4 bytes, 2 left"):
        reader.take(4, "gap list")
    assert reader.unpack("H", "x") == (0x0201,)
    reader.finish("x")


def test_non_buffers_are_refused():
    with pytest.raises(DecodeError, match="not a contiguous bytes-like"):
        Reader("text")  # type: ignore[arg-type]


def test_tensor_reads_are_copies():
    data = bytearray(b"\x00\x00\x80\x3f")
    t = Reader(data).tensor(1, torch.float32, "v", "cpu")
    data[3] = 0
    assert t.tolist() == [1.0]


def test_a_huge_dimension_beside_a_zero_one_is_a_decode_error():
    # (0, 2**63) has no elements, so the element budget alone would let it through to reshape.
    good = compress.get_codec("none").encode(torch.zeros(0, 3))
    idx = good.index(struct.pack("<QQ", 0, 3))
    bad = good[:idx] + struct.pack("<QQ", 0, 2**63) + good[idx + 16 :]
    with pytest.raises(compress.DecodeError, match="dimension"):
        compress.decode(bad, max_numel=10)
    named = compress.encode_named([("w", torch.zeros(0, 3))], compress.get_codec("none"))
    i = named.index(struct.pack("<QQ", 0, 3))
    with pytest.raises(compress.DecodeError):
        compress.decode_named(
            named[:i] + struct.pack("<QQ", 0, 2**63) + named[i + 16 :], max_numel=10
        )


def test_decode_named_refuses_codecs_not_agreed():
    payload = compress.encode_named(
        [("w", torch.ones(8, 8))], compress.get_codec("powersgd:rank=2")
    )
    with pytest.raises(compress.DecodeError):
        compress.decode_named(payload, max_numel=100, allowed=("int8",))
    assert compress.codec_family(compress.get_codec("topk:0.01+int8")) == ("topk", "int8")
