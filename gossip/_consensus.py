# How far apart the peers' models are: the one consensus-distance function of the project
# (simulator, testbed, tests and benchmarks). Invariant: pure arithmetic on what is handed in;
# torch is imported only when models are given as tensors.
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def consensus_distance(models: np.ndarray | Sequence[Mapping[str, Any]], *,
                       relative: bool = False) -> float:  # fmt: skip
    """Mean over peers of ||x_i - mean||^2, over ||mean||^2 when `relative`.

    Args:
        models: an array of shape (n_peers, dim), or one {name: tensor} per peer with the same
            names (flattened in name order, in float64).
        relative: divide by the squared norm of the mean model (scale-free; 0 means equal).

    Raises:
        ValueError: fewer than one model, or models of different names.
    """
    if isinstance(models, np.ndarray):
        x = models.astype(np.float64, copy=False)  # (n_peers, dim)
        spread = float(((x - x.mean(axis=0)) ** 2).sum(axis=1).mean())
        return spread / float((x.mean(axis=0) ** 2).sum()) if relative else spread
    if not models:
        raise ValueError("consensus_distance of no models")
    import torch

    names = sorted(models[0])
    if any(sorted(m) != names for m in models):
        raise ValueError("consensus_distance: the models have different parameter names")
    flat = torch.stack([torch.cat([m[n].flatten().double() for n in names]) for m in models])
    mean = flat.mean(dim=0)  # (dim,)
    spread = float(((flat - mean) ** 2).sum(dim=1).mean())
    return spread / float((mean**2).sum()) if relative else spread
