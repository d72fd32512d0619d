# Robust mixing rules: what bounds a Byzantine neighbour's pull on this node's model. Invariants:
# pure tensor arithmetic on the tensors handed in, no I/O, no clock, no randomness; a rule that
# mixes changes `live` in place and only there; the clipping radius depends only on distances
# observed before (and including) the update it bounds, never on that update's direction.
#
# Assumptions and limits (docs/explanation/security.md repeats them):
# - "clip" (self-centred clipping, ClippedGossip, He, Karimireddy & Jaggi 2022): every
#   neighbour's difference x_j - x_i is scaled down to at most tau before it is mixed. tau is
#   ROBUST_SCALE (1/2) x the ROBUST_QUANTILE quantile (the lower quartile) of the raw (unclipped)
#   distances of the last ROBUST_WINDOW updates this node saw, the current one included. While
#   fewer than three quarters of the updates a node sees come from Byzantine peers that send far
#   models, that quantile is an honest peer's distance, so one bad update moves the node by at
#   most a short honest update's length; Byzantine peers that send near models only make tau
#   smaller (slower agreement, never a bigger pull). A difference longer than ROBUST_FADE tau
#   moves the node by tau x ROBUST_FADE tau / distance only (a redescending rule, not in
#   ClippedGossip): a peer that keeps sending a model far off in one direction does not drag
#   the node a whole tau that way at every exchange. An honest peer that far is pulled in by
#   its own radius (a restarted one's starts at half its first distance; one cut off for long
#   catches up once its window holds mostly long distances, as with plain clipping), while
#   ours moves toward it slowly. It does not stop an attacker that stays
#   inside that radius (ALIE is built to) from nudging every exchange, nor a large majority of
#   Byzantine neighbours, nor a poisoned model that looks like an honest one (label flipping is
#   only diluted). The first update a node ever sees is its own reference
#   (tau = half its distance); `gossip.clip`, when set, caps tau from the start.
# - "trim": coordinate-wise trimmed mean over the node's own model and its neighbours' in a
#   synchronous round: in every coordinate the `b` largest and `b` smallest values are dropped,
#   b = floor(TRIM_FRACTION x (neighbours + 1)) >= 1. It tolerates up to b Byzantine neighbours
#   in a round; with fewer than TRIM_MIN_NEIGHBOURS neighbours answering there is nothing to trim
#   and the round falls back to clipping.
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

import torch

from ._averaging import SLICE, add_difference, distance

Params = Mapping[str, torch.Tensor]

ROBUST_RULES = ("none", "clip", "trim")
ROBUST_WINDOW = 32  # distances remembered: enough for a stable quartile, few enough to follow the
#                     swarm as it converges (distances shrink by orders of magnitude)
ROBUST_QUANTILE = 0.25  # the lower quartile: honest while < 3/4 of the distances are inflated;
#                        with twice the median 2 sign-flipping peers of 8 drag honest digits
#                        peers to a quarter of their accuracy, the lower quartile keeps it
#                        (python -m geotrain.testbed.bench_byzantine)
ROBUST_SCALE = 0.5  # tau is half that distance: with label-skewed shards (Dirichlet 0.5) honest
#                    distances spread wide, and at 1.0 two IPM peers of 8 dragged honest peers
#                    to 10% accuracy (81% at 0.5); IID shards lose nothing either way
ROBUST_FADE = 4.0  # in units of tau (twice the lower quartile): a difference longer than this
#                  pulls less the longer it is (tau x ROBUST_FADE tau / distance) instead of
#                  a whole tau: plain clipping lets two sign-flipping or IPM peers of 8 pull
#                  every exchange by tau toward where they point, steadily, and costs honest
#                  charlm peers a few points of their no-attack accuracy; honest distances
#                  (under twice the quartile, mostly) are clipped plainly
#                  (python -m geotrain.testbed.bench_byzantine)
TRIM_FRACTION = 0.4  # of the values in each coordinate dropped at each end (at least one): 4
#                     values drop 1 at each end, 5 (dpsgd's default degree 4) drop 2, leaving the
#                     median, so two like-minded attackers in one round are both dropped
TRIM_MIN_NEIGHBOURS = 3  # own model + 3 neighbours: drop 1 at each end, average the middle 2


@dataclass(frozen=True)
class RobustStatistics:
    """What robust mixing did on this node (shown in status with the algorithm's counters)."""

    robust_mixed: int  # updates (or rounds) mixed under a robust rule
    robust_clipped: int  # updates whose difference was longer than tau and scaled down
    robust_trimmed_rounds: int  # dpsgd rounds mixed by trimmed mean
    robust_trim_fallbacks: int  # rounds with too few neighbours for trim, clipped instead
    robust_faded: int  # updates farther than ROBUST_FADE tau, whose pull faded with distance
    # the latest clipping radius (0.0 before any)
    robust_tau: float = field(metadata={"gauge": True})


class ClipRadius:
    """The adaptive clipping radius tau of one node, with its counters.

    Args:
        rule: "none" (no clipping; `radius` returns `cap`), "clip" or "trim" (trim's fallback
            clips too).
        cap: a fixed upper bound on tau (`gossip.clip`), or None.
        window, quantile, scale, fade: see the module comment (ROBUST_*).

    Raises:
        ValueError: an unknown rule, or window < 1, quantile outside [0, 1], scale <= 0,
            cap <= 0, fade < 1.
    """

    def __init__(
        self,
        rule: str = "clip",
        *,
        cap: float | None = None,
        window: int = ROBUST_WINDOW,
        quantile: float = ROBUST_QUANTILE,
        scale: float = ROBUST_SCALE,
        fade: float = ROBUST_FADE,
    ) -> None:
        if rule not in ROBUST_RULES:
            raise ValueError(f"rule={rule!r}: expected one of {ROBUST_RULES}")
        if (window < 1 or not 0.0 <= quantile <= 1.0 or scale <= 0 or fade < 1
                or (cap is not None and cap <= 0)):  # fmt: skip
            raise ValueError(f"window={window}, quantile={quantile}, scale={scale}, cap={cap}, "
                             f"fade={fade}")  # fmt: skip
        self.rule, self.cap = rule, cap
        self.quantile, self.scale, self.fade = quantile, scale, fade
        self._seen: deque[float] = deque(maxlen=window)
        self.mixed = self.clipped = self.trimmed_rounds = self.trim_fallbacks = self.faded = 0
        self.tau = 0.0

    @property
    def active(self) -> bool:
        return self.rule != "none"

    def radius(self, distance: float) -> float | None:
        """Record one update's raw distance ||x_j - x_i|| and return the radius to clip it to
        (None: no bound). Counts the update as clipped when distance > radius.

        Non-finite distances are not recorded (such an update is rejected before it is mixed).
        """
        if not self.active:
            return self.cap
        if math.isfinite(distance):
            self._seen.append(distance)
        ordered = sorted(self._seen)
        if not ordered:
            return self.cap if self.cap is not None else 0.0
        position = self.quantile * (len(ordered) - 1)
        low = int(math.floor(position))
        high = min(low + 1, len(ordered) - 1)
        middle = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
        tau = self.scale * middle
        if self.cap is not None:
            tau = min(tau, self.cap)
        self.tau = tau
        self.mixed += 1
        self.clipped += distance > tau
        return tau

    def factor(self, distance: float) -> float:
        """Record one update's raw distance (as `radius`) and return the factor its difference
        is mixed with: clipped to tau; under a robust rule, faded beyond `fade` tau (see
        clip_scale); without one, clipped to `cap` only (gossip.clip)."""
        tau = self.radius(distance)
        fade = self.fade if self.active else None
        if fade is not None and tau is not None and distance > fade * tau:
            self.faded += 1
        return clip_scale(distance, tau, fade)

    def statistics(self) -> RobustStatistics:
        return RobustStatistics(self.mixed, self.clipped, self.trimmed_rounds,
                                self.trim_fallbacks, self.faded, self.tau)  # fmt: skip


def clip_scale(distance: float, tau: float | None, fade: float | None = None) -> float:
    """The factor that brings a difference of length `distance` within `tau` (1.0 when it is).

    With `fade`, a difference longer than fade x tau is brought within tau x (fade tau /
    distance) instead: the farther it is, the less it pulls (a redescending rule: a model
    sent from far away moves us by at most fade tau^2 / distance)."""
    if tau is None or distance <= tau or distance <= 0:
        return 1.0
    scale = tau / distance
    if fade is not None and distance > fade * tau:
        scale *= fade * tau / distance
    return scale


def clipped_neighbourhood_mix(
    live: MutableMapping[str, torch.Tensor],
    sent: Params,
    remotes: Mapping[str, Params],
    weights: Mapping[str, float],
    radius: ClipRadius,
) -> float:
    """D-PSGD's mixing step with self-centred clipping, in place:
    live += sum_j w_ij * clip_tau(x_j - sent).

    Returns:
        The largest raw L2 distance ||x_j - sent|| among the neighbours (0.0 with none).
    """
    largest = 0.0
    for peer, remote in remotes.items():  # (a slice at a time: no model-sized temporary)
        gap = distance(remote, sent)
        largest = max(largest, gap)
        scale = radius.factor(gap)
        for name, tensor in live.items():
            add_difference(tensor, remote[name], sent[name], weights[peer] * scale)
    return largest


def trim_count(values: int) -> int:
    """How many values trimmed mean drops at each end of `values` per coordinate (0: too few)."""
    if values < TRIM_MIN_NEIGHBOURS + 1:
        return 0
    return max(1, int(TRIM_FRACTION * values))


def trimmed_mean_mix(
    live: MutableMapping[str, torch.Tensor], sent: Params, remotes: Mapping[str, Params]
) -> int:
    """Coordinate-wise trimmed mean of `sent` and every remote model, in place:
    live += trimmed_mean(sent, x_1..x_k) - sent (the progress made since `sent` is kept).

    Works a slice of SLICE elements at a time: the stack of k + 1 values is (k + 1, SLICE).

    Returns:
        b, the number of values dropped at each end of every coordinate.

    Raises:
        ValueError: too few remotes to trim (see trim_count).
    """
    models = [sent, *remotes.values()]
    b = trim_count(len(models))
    if b == 0:
        raise ValueError(f"{len(remotes)} neighbours: trimmed mean needs {TRIM_MIN_NEIGHBOURS}")
    with torch.no_grad():
        for name, tensor in live.items():
            flat = tensor.view(-1)
            mine = sent[name].reshape(-1)
            others = [m[name].reshape(-1) for m in models]
            for start in range(0, flat.numel(), SLICE):
                stop = min(start + SLICE, flat.numel())
                stack = torch.stack([o[start:stop].to(flat.dtype) for o in others])  # (k+1, s)
                ordered, _ = torch.sort(stack, dim=0)
                middle = ordered[b : len(models) - b].mean(dim=0)
                flat[start:stop] += middle - mine[start:stop]
    return b


def robust_scales(gaps: list[Callable[[], float]], rule: str, radius: ClipRadius) -> list[float]:
    """robust_average's factors s_j, one per other update, when it does not trim: 1 with rule
    "none" (the distances are not worked out), else the clip factor of each distance
    ||x_j - own|| (`gaps` work them out) at the radius (trim's fallback counted in `radius`)."""
    if rule == "none":
        return [1.0] * len(gaps)
    if rule == "trim" and gaps:
        radius.trim_fallbacks += 1
    scales = []
    for gap_of in gaps:
        gap = gap_of()
        scales.append(radius.factor(gap))
    return scales


def robust_average(
    own: Params, others: list[Params], rule: str, radius: ClipRadius, out: Params | None = None
) -> Params:
    """The mean of `own` and `others` (DiLoCo's pseudo-gradients) under robust rule `rule`:
    "none" a plain mean; "clip" each other's difference to `own` clipped to the radius first
    (self-centred: x_j' = own + clip_tau(x_j - own)); "trim" a coordinate-wise trimmed mean when
    there are enough values (trim_count), clipping otherwise (counted in `radius`).

    Args:
        out: where to write the mean (no new model-sized tensors): may be one of `others`,
            which is then overwritten; None: new tensors. Not used by a trimmed mean.

    Returns:
        The mean per name (`out` when given); `own` is never changed.
    """
    if rule == "trim" and trim_count(len(others) + 1):
        radius.trimmed_rounds += 1
        radius.mixed += 1
        total = {n: t.detach().clone() for n, t in own.items()}
        trimmed_mean_mix(total, own, dict(enumerate(others)))  # type: ignore[arg-type]
        return total
    # mean = own + sum_j s_j (x_j - own) / (k + 1), s_j the clip factor (1 without clipping),
    # worked out a slice at a time after every factor is known
    scales = robust_scales([(lambda o=o: distance(o, own)) for o in others], rule, radius)
    result = out if out is not None else {n: torch.empty_like(t) for n, t in own.items()}
    share = 1.0 / (len(others) + 1)
    with torch.no_grad():
        for n, mine in own.items():
            target, base = result[n].view(-1), mine.detach().reshape(-1)
            sources = [other[n].detach().reshape(-1) for other in others]
            for start in range(0, base.numel(), SLICE):
                stop = start + SLICE
                part = base[start:stop].to(target.dtype)  # (a copy: target may alias a source)
                acc = part.clone()
                for source, scale in zip(sources, scales, strict=True):
                    acc.add_(source[start:stop].to(target.dtype) - part, alpha=scale * share)
                target[start:stop].copy_(acc)
    return result
