"""Bit and nibble packing: the CPU path and the device-agnostic torch path agree."""

import pytest
import torch

from geotrain.compress._bits import (
    pack_bits,
    pack_bits_torch,
    pack_nibbles,
    unpack_bits,
    unpack_bits_torch,
    unpack_nibbles,
)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 1003])
def test_bits_round_trip_and_both_packers_agree(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3
    packed = pack_bits(bits)
    assert packed.numel() == (n + 7) // 8
    assert torch.equal(packed, pack_bits_torch(bits))
    assert torch.equal(unpack_bits(packed, n), bits)
    assert torch.equal(unpack_bits_torch(packed, n), bits)


def test_bit_order_is_little():
    assert pack_bits(torch.tensor([True] + [False] * 7)).tolist() == [1]
    assert pack_bits(torch.tensor([False] * 7 + [True])).tolist() == [128]


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_nibbles_round_trip(n):
    codes = torch.randint(
        0, 16, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    packed = pack_nibbles(codes)
    assert packed.numel() == (n + 1) // 2
    assert torch.equal(unpack_nibbles(packed, n), codes)
