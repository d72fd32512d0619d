# Invariants: bit order is "little" (element 8*j + i is bit i of byte j) on every device, so a
# payload packed on a GPU unpacks on a CPU; padding bits are zero.
"""Pack booleans 8 per byte and 4-bit codes 2 per byte."""

from __future__ import annotations

import numpy as np
import torch

# Multiplying a word of eight 0/1 bytes by this gathers byte i into bit 56 + i.
_GATHER = 0x0102040810204080


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool tensor into ceil(n / 8) uint8 on the same device."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    return pack_bits_torch(bits)


def pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """Device-agnostic `pack_bits` (torch ops only); used off the CPU."""
    n = bits.numel()
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    words = bits.view(torch.uint8).view(torch.int64)  # (n / 8,) eight 0/1 bytes each
    return (((words * _GATHER) >> 56) & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `n` bits as a bool tensor on packed's device."""
    if packed.device.type == "cpu":
        bits = np.unpackbits(packed.numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bits_torch(packed, n)


def unpack_bits_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Device-agnostic `unpack_bits` (torch ops only); used off the CPU."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(1) >> shifts) & 1  # (bytes, 8)
    return bits.reshape(-1)[:n].bool()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 1-D uint8 codes in [0, 15] two per byte (element 2j low nibble, 2j+1 high)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_nibbles`: the first `n` codes as uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
