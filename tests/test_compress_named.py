"""Named payloads: a whole model in one payload, fallbacks inside, EF per name, budget."""

import pytest
import torch

from geotrain.compress import (
    CodecState,
    DecodeError,
    ErrorFeedback,
    decode_named,
    dense_named_payload,
    encode_named,
    expected_nbytes_named,
    get_codec,
)


def _model_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 4, 10)
    )
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


@pytest.mark.parametrize("spec", ["none", "int8", "powersgd:rank=2+fp16", "topk:0.1+int8", "sign"])
def test_a_model_round_trips_in_one_payload(spec):
    params = _model_params()
    codec = get_codec(spec)
    data = encode_named(params, codec, seed=7, state=CodecState())
    out = decode_named(data, max_numel=sum(p.numel() for _, p in params))
    assert [n for n, _ in out] == [n for n, _ in params]
    assert [t.shape for _, t in out] == [p.shape for _, p in params]
    if spec != "topk:0.1+int8":  # topk's index width depends on the data
        shapes = [(n, tuple(p.shape)) for n, p in params]
        assert len(data) == expected_nbytes_named(shapes, codec)
    if spec == "none":
        assert all(torch.equal(t, p) for (_, t), (_, p) in zip(out, params, strict=True))


def test_error_feedback_keeps_one_residual_per_name():
    params = _model_params()
    ef = ErrorFeedback(get_codec("sign"))
    data = encode_named(params, ef.codec, error_feedback=ef)
    out = dict(decode_named(data, max_numel=10**6))
    for name, p in params:
        assert torch.allclose(out[name] + ef.residual(name), p, atol=1e-6)


def test_the_element_budget_covers_all_tensors_together():
    data = encode_named([("a", torch.ones(60)), ("b", torch.ones(60))], get_codec("fp16"))
    assert len(decode_named(data, max_numel=120)) == 2
    with pytest.raises(DecodeError, match="tensor 'b'.*over max_numel=59"):
        decode_named(data, max_numel=119)


def test_duplicate_names_are_refused_on_both_sides():
    with pytest.raises(ValueError, match="unique"):
        encode_named([("a", torch.ones(2)), ("a", torch.ones(2))], get_codec("none"))
    one = encode_named([("a", torch.ones(2))], get_codec("none"))
    entry = one[7:]
    forged = one[:3] + (2).to_bytes(4, "little") + entry + entry
    with pytest.raises(DecodeError, match="appears twice"):
        decode_named(forged, max_numel=100)


def test_each_tensor_gets_its_own_seed():
    x = torch.randn(1000)
    data = dict(
        decode_named(encode_named([("a", x), ("b", x)], get_codec("randk:0.1")), max_numel=2000)
    )
    assert not torch.equal(data["a"] != 0, data["b"] != 0)


def test_a_payload_filled_in_place_is_byte_for_byte_what_encode_named_makes():
    tensors = [("w@0", torch.randn(10)), ("empty@0", torch.randn(0)),
               ("b@5", torch.randn(7).to(torch.bfloat16)),
               ("d", torch.randn(9, dtype=torch.float64))]  # fmt: skip
    payload, views = dense_named_payload([(n, t.numel(), t.dtype) for n, t in tensors], seed=11)
    for view, (_, t) in zip(views, tensors, strict=True):
        view.copy_(t.reshape(-1))
    assert bytes(payload) == encode_named(tensors, get_codec("none"), seed=11)
    out = decode_named(payload, max_numel=26)
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float64]
    assert [t.dtype for _, t in out] == dtypes
    with pytest.raises(ValueError, match="unique"):
        dense_named_payload([("a", 1, torch.float32), ("a", 2, torch.float32)])


def test_a_borrowed_decode_shares_a_writable_buffer_and_copies_a_read_only_one():
    params = _model_params()
    data = encode_named(params, get_codec("none"))
    numel = sum(p.numel() for _, p in params)
    mutable = bytearray(data)
    borrowed = decode_named(mutable, max_numel=numel, borrow=True)
    copied = decode_named(data, max_numel=numel, borrow=True)  # bytes: read-only, so a copy
    plain = decode_named(bytearray(data), max_numel=numel)
    assert all(torch.equal(a, p) for (_, a), (_, p) in zip(borrowed, params, strict=True))
    mutable[:] = bytes(len(mutable))  # the borrowed tensors see the buffer's new contents
    assert all(not t.any() for _, t in borrowed)
    assert all(torch.equal(a, p) for (_, a), (_, p) in zip(copied, params, strict=True))
    for _, t in copied + plain:
        t.add_(1.0)  # writable, and nobody else's memory
    assert bytes(data) == encode_named(params, get_codec("none"))
