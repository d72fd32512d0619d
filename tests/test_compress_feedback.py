"""ErrorFeedback: mass conservation, residual state save/restore/reset, per-name residuals."""

import pytest
import torch

from geotrain.compress import ErrorFeedback, decode, get_codec

LOSSY = [
    "int8",
    "int4",
    "sign",
    "qsgd:levels=4",
    "topk:0.05+int8",
    "randk:0.1,unscaled",
    "powersgd:rank=1",
]


@pytest.mark.parametrize("spec", LOSSY)
def test_what_was_sent_plus_the_residual_equals_what_went_in(spec):
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(get_codec(spec))
    fed = torch.zeros(40, 25, dtype=torch.float64)
    sent = torch.zeros(40, 25, dtype=torch.float64)
    for step in range(20):
        x = torch.randn(40, 25, generator=g)
        fed += x.double()
        sent += decode(ef.encode(x, name="w", seed=step), max_numel=1000).double()
    assert torch.allclose(sent + ef.residual("w").double(), fed, atol=1e-4)
    assert ef.residual_norm() > 0


def test_error_feedback_makes_topk_reach_every_coordinate():
    # a constant input: without EF top-k would only ever send the same few coordinates
    x = torch.linspace(1.0, 2.0, 1000)
    ef = ErrorFeedback(get_codec("topk:0.01"))
    total = torch.zeros(1000)
    for step in range(200):
        total += decode(ef.encode(x, seed=step), max_numel=1000)
    assert bool((total > 0).all())
    # what was not sent yet is the residual: bounded, so the sent total tracks 200 * x
    assert float((total - 200 * x).norm() / (200 * x).norm()) < 0.5
    plain = sum(
        decode(get_codec("topk:0.01").encode(x, seed=s), max_numel=1000) for s in range(200)
    )
    assert int((plain > 0).sum()) == 10  # without EF the same 10 coordinates, every time


def test_state_dict_restores_and_reset_forgets():
    ef = ErrorFeedback(get_codec("sign"))
    x = torch.randn(100, generator=torch.Generator().manual_seed(3))
    ef.encode(x, name="a")
    ef.encode(2 * x, name="b")
    saved = ef.state_dict()
    next_payload = ef.encode(x, name="a")
    other = ErrorFeedback(get_codec("sign"))
    other.load_state_dict(saved)
    assert other.encode(x, name="a") == next_payload
    assert set(saved) == {"a", "b"}
    ef.reset()
    assert ef.residual_norm() == 0.0 and ef.residual("a") is None


def test_a_residual_of_another_shape_is_refused():
    ef = ErrorFeedback(get_codec("int8"))
    ef.encode(torch.ones(4), name="w")
    with pytest.raises(ValueError, match="residual 'w' has shape"):
        ef.encode(torch.ones(5), name="w")


def test_a_lossless_codec_leaves_no_residual():
    ef = ErrorFeedback(get_codec("none"))
    ef.encode(torch.randn(50), name="w")
    assert ef.residual_norm() == 0.0


def test_half_precision_residuals_hold_half_the_memory_and_still_correct():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    full = ErrorFeedback(get_codec("int8"))
    half = ErrorFeedback(get_codec("int8"), dtype=torch.float16)
    sent_full = decode(full.encode(x, name="w"), max_numel=x.numel())
    sent_half = decode(half.encode(x, name="w"), max_numel=x.numel())
    assert torch.equal(sent_full, sent_half)  # the first message is the same
    assert half.residual("w").dtype == torch.float16
    assert half.residual("w").element_size() * 2 == full.residual("w").element_size()
    # what was sent plus the kept residual is what went in, up to the residual's own rounding
    torch.testing.assert_close(sent_half + half.residual("w").float(), x, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="dtype"):
        ErrorFeedback(get_codec("int8"), dtype=torch.int8)
