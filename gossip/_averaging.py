# Averaging rules: how a node checks and mixes a model received from a peer. Invariants: pure
# tensor arithmetic, no I/O; a check that fails raises RejectedUpdate before anything is changed;
# mixing keeps the local progress made since the snapshot that was sent (AD-PSGD's
# x <- x + w * (x_peer - x_snapshot)), so training never has to pause for an exchange.
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ._errors import RemoteProtocolError

Params = Mapping[str, torch.Tensor]


class RejectedUpdate(RemoteProtocolError):
    """A peer's model or update failed a check. `reason` is a short code for counters.

    Codes: "names" (parameter names differ), "shape", "dtype", "nonfinite", "norm".
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


SLICE = 1 << 20  # elements per step of the reductions below: bounded temporaries at any size


def params_norm(params: Params) -> float:
    """The L2 norm of all tensors together (no temporary copy of a tensor is made)."""
    norms = (float(torch.linalg.vector_norm(t.detach())) for t in params.values())
    return math.sqrt(sum(n * n for n in norms))


def distance_squared(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||^2, a slice at a time: the difference is never held whole."""
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    total = 0.0
    for start in range(0, x.numel(), SLICE):
        part = x[start : start + SLICE] - y[start : start + SLICE]
        total += float(torch.linalg.vector_norm(part)) ** 2
    return total


def distance(remote: Params, local: Params) -> float:
    """||remote - local|| over every tensor, a slice at a time (no difference is held whole)."""
    return math.sqrt(sum(distance_squared(remote[n], local[n]) for n in local))


def add_difference(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """target += alpha * (a - b), in place, SLICE elements at a time: the temporaries are one
    slice, whatever the tensor's size. `target` may be `b` itself (each slice of b is read
    before that slice of target is written)."""
    flat = target.view(-1)
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    with torch.no_grad():
        for start in range(0, flat.numel(), SLICE):
            stop = start + SLICE
            part = x[start:stop].to(flat.dtype) - y[start:stop].to(flat.dtype)
            flat[start:stop].add_(part, alpha=alpha)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, from one min/max pass: NaN propagates into both, an
    infinity shows in one. No temporaries; on CPU ~10x faster than torch.isfinite(t).all(),
    which also made ~1.7x the tensor in temporaries (670 MB for a 100M-parameter tensor)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True  # integers and booleans have no NaN or inf
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return True
    lo, hi = torch.aminmax(flat)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_update(local: Params, remote: Params, *, max_norm_ratio: float) -> None:
    """Check a peer's tensors against ours before they are mixed in.

    Args:
        local: this node's tensors (the reference for names, shapes and scale).
        remote: what the peer sent, already decoded.
        max_norm_ratio: refuse when ||remote|| > max_norm_ratio * ||local|| + 1 (the +1 lets a
            near-zero local model, e.g. a zero pseudo-gradient, accept a normal update).

    Raises:
        RejectedUpdate: names, shapes or dtypes differ, a value is NaN/inf, or the norm is too big.
    """
    if set(local) != set(remote):
        missing, extra = sorted(set(local) - set(remote)), sorted(set(remote) - set(local))
        raise RejectedUpdate("names", f"the peer's tensors are not named as ours (missing "
                             f"{missing[:3]}, unexpected {extra[:3]}): another model")
    for name, mine in local.items():
        theirs = remote[name]
        if theirs.shape != mine.shape:
            raise RejectedUpdate("shape", f"the peer's {name} is {tuple(theirs.shape)}, ours "
                                 f"{tuple(mine.shape)}: another model")
        if not theirs.is_floating_point():
            raise RejectedUpdate("dtype", f"the peer's {name} is {theirs.dtype}, not floating "
                                 "point")
        if not all_finite(theirs):
            raise RejectedUpdate("nonfinite", f"the peer's {name} holds NaN or inf: its model "
                                 "diverged")
    check_norm_ratio(params_norm(remote), params_norm(local), max_norm_ratio=max_norm_ratio)


def check_norm_ratio(
    theirs_norm: float,
    mine_norm: float,
    *,
    max_norm_ratio: float,
    what: str = "model",
    against: str = "our model",
) -> None:
    """check_update's norm check on norms worked out already (an update checked as it streams).

    Args:
        what / against: what the norms are of, for the message: the peer's `what` (its model,
            its update) against `against` ("our model").

    Raises:
        RejectedUpdate: ||remote|| > max_norm_ratio * ||local|| + 1 ("norm"); the message says
            what was compared and the setting (gossip.max_norm_ratio) that governs it.
    """
    limit = max_norm_ratio * mine_norm + 1.0
    if theirs_norm > limit:
        raise RejectedUpdate(
            "norm", f"the peer's {what} has norm {theirs_norm:.3g}, above the {limit:.3g} allowed "
            f"(gossip.max_norm_ratio {max_norm_ratio:g} x the norm of {against}, {mine_norm:.3g}, "
            "+ 1): "
            "a diverged or hostile peer, or peers far apart (raise gossip.max_norm_ratio if they "
            "legitimately are)"
        )


def pairwise_mix(
    live: Params,
    snapshot: Params,
    remote: Params,
    *,
    weight: float = 0.5,
    clip: float | None = None,
) -> float:
    """Mix a peer's model into ours, in place: live += weight * clip(remote - snapshot).

    Args:
        live: this node's parameters now (changed in place; may have moved on since `snapshot`).
        snapshot: this node's parameters when the exchange started (what the peer received).
        remote: the peer's parameters (what it sent).
        weight: the peer's share; 0.5 is a plain pairwise average.
        clip: when set, the difference (remote - snapshot) is scaled down to at most this L2 norm,
            so a bad but finite peer moves us by a bounded amount (clipped gossip).

    Returns:
        The L2 norm of (remote - snapshot) before clipping: the two models' distance.
    """
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"weight={weight}: expected 0 < weight <= 1")
    gap = distance(remote, snapshot)  # (a slice at a time: no model-sized temporary)
    scale = weight
    if clip is not None and gap > clip:
        scale = weight * clip / gap
    for name, tensor in live.items():
        add_difference(tensor, remote[name], snapshot[name], scale)
    return gap
