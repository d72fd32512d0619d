"""The bounded reader: every short read is a DecodeError naming what was cut."""

import pytest
import torch

from compress import DecodeError
from compress._wire import Header, Reader, header_nbytes, pack_header, read_header


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
