"""gossip/_sample: a model kept whole or as a strided sample, and the distance measured from it
(selsync's reference): exact when it fits, an unbiased estimate within a few percent beyond."""

from __future__ import annotations

import math
import random

import pytest
import torch

from geotrain.gossip import ModelSample


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 96, generator=g),  # 49,152
        "proj.weight": torch.randn(256, 768, generator=g),  # 196,608
        "proj.bias": torch.randn(256, generator=g),  # kept whole
        "norm": torch.ones(96),  # kept whole
    }


def _shapes(model):
    return {n: tuple(t.shape) for n, t in model.items()}


def _exact(live, ref) -> float:
    return math.sqrt(sum(float((live[n] - ref[n]).pow(2).sum()) for n in live))


def test_a_model_that_fits_is_kept_whole_and_measured_exactly():
    model = _model()
    sample = ModelSample(_shapes(model), budget=10**6, rng=random.Random(0))
    sample.take(model)
    assert sample.exact and sample.numel == sum(t.numel() for t in model.values())
    before = {n: t.clone() for n, t in model.items()}
    model["proj.weight"][3, 5] += 2.0
    model["norm"] += 0.5
    assert sample.distance(model) == pytest.approx(_exact(model, before), rel=1e-6)
    assert sample.relative_change(model) == pytest.approx(
        _exact(model, before) / math.sqrt(sum(float(t.pow(2).sum()) for t in model.values())))
    assert sample.relative_change({n: torch.zeros_like(t) for n, t in model.items()}) == math.inf


def test_a_sample_keeps_about_its_budget_and_estimates_a_spread_change_closely():
    model = _model()
    shapes = _shapes(model)
    before = {n: t.clone() for n, t in model.items()}
    g = torch.Generator().manual_seed(1)
    for t in model.values():  # a change spread over every value, as training makes
        t.add_(0.01 * torch.randn(t.shape, generator=g))
    exact = _exact(model, before)
    estimates = []
    for seed in range(20):
        sample = ModelSample(shapes, budget=10_000, rng=random.Random(seed))
        assert not sample.exact
        sample.take(before)
        assert sample.numel <= 10_000 + 256 + 96 + len(shapes)  # (small tensors whole)
        estimates.append(sample.distance(model))
    assert all(abs(e / exact - 1) < 0.05 for e in estimates), (exact, estimates)
    # unbiased in its square: the mean over offsets is closer still
    mean_sq = sum(e * e for e in estimates) / len(estimates)
    assert mean_sq == pytest.approx(exact**2, rel=0.01)


def test_a_change_confined_to_a_few_columns_is_seen_by_a_stride_that_crosses_them():
    # proj.weight rows are 768 long; a stride sharing a factor with 768 would visit only a few
    # columns of every row, and miss a change to the others for ever
    shapes = {"w": (4096, 768)}
    sample = ModelSample(shapes, budget=4096 * 768 // 24, rng=random.Random(0))
    offset, stride = sample.layout["w"]
    assert math.gcd(stride, 768) == 1 and stride >= 24
    live = {"w": torch.zeros(shapes["w"])}
    sample.take(live)
    seen = []
    for column in range(0, 768, 97):
        live["w"].zero_()
        live["w"][:, column] = 1.0
        seen.append(sample.distance(live) / math.sqrt(4096))
    assert all(0.8 < s < 1.2 for s in seen), seen


def test_the_sample_is_written_in_place_and_restored_from_state_or_from_a_whole_tensor():
    model = _model()
    shapes = _shapes(model)
    sample = ModelSample(shapes, budget=10_000, rng=random.Random(3))
    sample.take(model)
    buffers = {n: t.data_ptr() for n, t in sample.values.items()}
    sample.take({n: t + 1 for n, t in model.items()})
    assert {n: t.data_ptr() for n, t in sample.values.items()} == buffers  # no new copy
    values, layout = sample.state()
    saved = {n: t.clone() for n, t in values.items()}

    again = ModelSample(shapes, budget=10_000, rng=random.Random(3))
    again.take(model)
    assert sorted(again.load(saved, layout)) == sorted(shapes)
    assert again.distance({n: t + 1 for n, t in model.items()}) == pytest.approx(0.0, abs=1e-4)
    # a sample saved under another layout (other offsets) does not fit and is skipped
    other = ModelSample(shapes, budget=10_000, rng=random.Random(3))
    other.take(model)
    shifted = {n: [(o + 1) % s, s] if s > 1 else [o, s] for n, (o, s) in layout.items()}
    assert set(other.load(saved, shifted)) == {"proj.bias", "norm"}  # (whole in both)
    # an older checkpoint held the reference whole (in half precision): it is sampled
    assert sorted(other.load({n: (t + 1).half() for n, t in model.items()}, None)) == sorted(shapes)
    assert other.distance({n: t + 1 for n, t in model.items()}) < 1e-2 * _exact(
        {n: t + 1 for n, t in model.items()}, {n: torch.zeros_like(t) for n, t in model.items()})


def test_bad_budget():
    with pytest.raises(ValueError, match="budget"):
        ModelSample({"w": (2, 2)}, budget=0, rng=random.Random(0))
