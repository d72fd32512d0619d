"""The testbed's final consensus distance: a figure for models that keep a constant that is not
finite (the charlm task's causal mask of -inf) and never a NaN in run.json."""

from __future__ import annotations

import json

import torch

from geotrain.node.training._builtin import CharTransformer
from geotrain.testbed._run import consensus_of_finite


def _peers(n: int) -> list[dict[str, torch.Tensor]]:
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        model = CharTransformer(context=16, d_model=16, layers=1, heads=2)
        models.append({f"model/{k}": v.clone() for k, v in model.state_dict().items()})
    return models


def test_a_causal_mask_of_minus_infinity_leaves_the_distance_finite():
    models = _peers(3)
    assert not bool(models[0]["model/causal"].isfinite().all())  # the mask the task keeps
    distance = consensus_of_finite(models)
    assert distance is not None and 0 < distance < 10
    json.dumps({"consensus_distance_final": distance}, allow_nan=False)
    same = [models[0], {k: v.clone() for k, v in models[0].items()}]
    assert consensus_of_finite(same) == 0.0


def test_a_diverged_peer_leaves_the_figure_unknown_not_nan():
    models = _peers(2)
    weight = next(k for k in models[1] if k.endswith("head.weight"))
    models[1][weight][0, 0] = float("nan")
    assert consensus_of_finite(models) is None
