"""PowerSGD: low-rank matrices recovered, warm start improves, fallback for other tensors."""

import torch

from geotrain.compress import FP16, CodecState, PowerSGD, decode


def _low_rank(rows, cols, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


def _err(x, y):
    return float((x - y).norm() / x.norm())


def test_a_matrix_of_the_codec_rank_is_recovered():
    x = _low_rank(64, 96, 4)
    y = decode(PowerSGD(rank=4).encode(x), max_numel=x.numel())
    assert _err(x, y) < 1e-4


def test_warm_start_improves_a_full_rank_matrix_over_steps():
    g = torch.Generator().manual_seed(1)
    x = _low_rank(80, 60, 3, seed=2) + 0.3 * torch.randn(80, 60, generator=g)
    codec, state = PowerSGD(rank=2), CodecState()
    errors = [
        _err(x, decode(codec.encode(x, state=state, name="w"), max_numel=4800)) for _ in range(5)
    ]
    assert errors[-1] < errors[0]
    assert state.get("w").shape == (60, 2)


def test_state_can_be_saved_restored_and_reset():
    x = _low_rank(40, 30, 2) + 0.1
    codec, state = PowerSGD(rank=2), CodecState()
    codec.encode(x, state=state, name="w")
    saved = state.state_dict()
    a = codec.encode(x, state=state, name="w")
    restored = CodecState()
    restored.load_state_dict(saved)
    assert codec.encode(x, state=restored, name="w") == a
    state.reset()
    assert state.get("w") is None


def test_size_is_exact_and_four_d_tensors_are_viewed_as_matrices():
    x = torch.randn(32, 16, 3, 3)
    codec = PowerSGD(rank=4)
    data = codec.encode(x)
    assert len(data) == codec.expected_nbytes(x.numel(), shape=x.shape)
    assert len(data) == 14 + 32 + 2 + 4 * 4 * (32 + 144)
    assert decode(data, max_numel=x.numel()).shape == x.shape


def test_vectors_and_small_matrices_use_the_fallback():
    codec = PowerSGD(rank=4, inner=FP16())
    for x in (torch.randn(100), torch.randn(6, 6)):
        data = codec.encode(x)
        assert data == FP16().encode(x)
        assert len(data) == codec.expected_nbytes(x.numel(), shape=x.shape)
