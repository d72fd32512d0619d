# The tensor rules and decisions of the synchronous and compressed algorithms (dpsgd, choco,
# diloco, selsync). Invariants: pure tensor arithmetic on the tensors handed in, no I/O, no clock
# and no randomness; every rule that mixes changes `live` in place and only there; every weight
# row built here sums to one (a neighbour left out gives its weight back to the node itself).
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, MutableMapping

import torch

from ._averaging import SLICE, add_difference, distance
from ._robust import ClipRadius

Params = Mapping[str, torch.Tensor]


def metropolis_hastings_weights(
    degree: int, neighbour_degrees: Mapping[str, int]
) -> tuple[float, dict[str, float]]:
    """Metropolis–Hastings gossip weights of one node: w_ij = 1 / (1 + max(d_i, d_j)).

    The weights of the neighbours that answered are kept as they are and the rest of the row goes
    to the node itself, so a neighbour that missed a round's deadline is renormalised away
    (its share stays with us) and the row still sums to one. With every neighbour present and
    symmetric neighbourhoods the matrix is symmetric and doubly stochastic (the average is kept).

    Args:
        degree: how many neighbours this node asked in this round (d_i >= 0).
        neighbour_degrees: the degree each answering neighbour reported for its own round.

    Returns:
        (self weight, {neighbour: weight}).
    """
    if degree < 0 or any(d < 0 for d in neighbour_degrees.values()):
        raise ValueError(f"degrees must be >= 0: {degree}, {dict(neighbour_degrees)}")
    weights = {p: 1.0 / (1.0 + max(degree, d)) for p, d in neighbour_degrees.items()}
    return 1.0 - sum(weights.values()), weights


def neighbourhood_mix(
    live: MutableMapping[str, torch.Tensor],
    sent: Params,
    remotes: Mapping[str, Params],
    weights: Mapping[str, float],
) -> float:
    """D-PSGD's mixing step, in place: live += sum_j w_ij * (x_j - sent).

    `sent` is this node's model at the round boundary (what its neighbours received), so any
    progress made since then is kept, as in pairwise_mix.

    Returns:
        The largest L2 distance ||x_j - sent|| among the neighbours (0.0 with none).
    """
    largest = 0.0
    for peer, remote in remotes.items():  # (a slice at a time: no model-sized temporary)
        largest = max(largest, distance(remote, sent))
        for name, tensor in live.items():
            add_difference(tensor, remote[name], sent[name], weights[peer])
    return largest


def choco_difference(live: Params, estimate: Params) -> dict[str, torch.Tensor]:
    """What CHOCO-SGD compresses and sends: x - x_hat (our model minus our public estimate)."""
    return {n: live[n] - estimate[n] for n in live}


def choco_update_estimate(estimate: MutableMapping[str, torch.Tensor], q: Params) -> None:
    """x_hat += q, in place: both ends of a link apply the same q, so their copies stay equal."""
    with torch.no_grad():
        for name, tensor in estimate.items():
            tensor.add_(q[name].to(tensor.dtype))


def choco_consensus(
    live: MutableMapping[str, torch.Tensor],
    own_estimate: Params,
    peer_estimate: Params,
    *,
    gamma: float,
    weight: float = 0.5,
    radius: ClipRadius | None = None,
) -> float:
    """CHOCO-SGD's consensus step for one neighbour, in place: x += gamma * w * (x_hat_j - x_hat_i).

    Args:
        radius: robust mixing (gossip.robust): the estimates' difference is clipped to its tau
            (the estimates themselves are not: both ends of the link must keep equal copies).

    Returns:
        ||x_hat_j - x_hat_i||, the distance between the two public estimates (before clipping).
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma={gamma}: expected 0 < gamma <= 1")
    gap = distance(peer_estimate, own_estimate)  # (a slice at a time: no model-sized temporary)
    scale = 1.0 if radius is None else radius.factor(gap)
    for name, tensor in live.items():
        add_difference(tensor, peer_estimate[name], own_estimate[name], gamma * weight * scale)
    return gap


def pseudo_gradient(start: Params, live: Params) -> dict[str, torch.Tensor]:
    """DiLoCo's outer gradient: the round's starting parameters minus the parameters now."""
    return {n: start[n] - live[n] for n in start}


def average(deltas: Iterable[Params]) -> dict[str, torch.Tensor]:
    """The element-wise mean of equally named tensor sets (at least one)."""
    deltas = list(deltas)
    if not deltas:
        raise ValueError("average: nothing to average")
    out = {n: t.detach().clone() for n, t in deltas[0].items()}  # (no stack of every input)
    with torch.no_grad():
        for other in deltas[1:]:
            for n, t in out.items():
                t.add_(other[n])
        for t in out.values():
            t.div_(len(deltas))
    return out


class NesterovOuter:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on pseudo-gradients.

    buf = momentum * buf + g;  start -= lr * (g + momentum * buf);  the model restarts from start.

    Args:
        lr: the outer learning rate (DiLoCo uses 0.7).
        momentum: the Nesterov momentum (DiLoCo uses 0.9).
        dtype: what the momentum buffers are held in (None: each parameter's own dtype). The
            arithmetic is the parameters' (a narrower buffer is widened slice by slice and
            only stored narrower): bfloat16 halves a float32 model's outer state and rounds
            each buffer value to 8 bits of mantissa at each step.
    """

    def __init__(self, lr: float, momentum: float, dtype: torch.dtype | None = None) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"lr={lr}, momentum={momentum}: expected lr > 0, 0 <= momentum < 1")
        self.lr = lr
        self.momentum = momentum
        self.dtype = dtype
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self, start: MutableMapping[str, torch.Tensor], gradient: Params) -> None:
        """Apply one outer step to `start` in place."""
        self.begin(start)
        for name, g in gradient.items():
            self.add(start, name, g)

    # A step streamed: the gradient enters linearly, so with buf' = momentum * buf + g,
    # start' = start - lr * momentum^2 * buf - lr * (1 + momentum) * g: `begin` applies the buf
    # terms, then `add` each part of g as it comes (a weighted sum of updates, one slice of one
    # update at a time: the gradient is never held whole). begin + add of every name = step.
    def begin(self, start: MutableMapping[str, torch.Tensor]) -> None:
        """Start an outer step: start -= lr * momentum^2 * buf; buf *= momentum (zeros at
        first). Then `add` the gradient: an element never added counts as a zero gradient."""
        with torch.no_grad():
            for name, tensor in start.items():
                buf = self.buffers.get(name)
                if buf is None:
                    self.buffers[name] = torch.zeros_like(tensor, dtype=self.dtype)
                    continue
                flat, flat_buf = tensor.view(-1), buf.view(-1)
                for i in range(0, flat.numel(), SLICE):  # (a narrower buffer is widened a
                    part = flat_buf[i : i + SLICE]  # slice at a time: torch on the CPU would
                    # widen it whole for a mixed-dtype op, a model-sized temporary)
                    flat[i : i + SLICE].sub_(part.to(flat.dtype), alpha=self.lr * self.momentum**2)
                    part.mul_(self.momentum)

    def add(self, start: MutableMapping[str, torch.Tensor], name: str, values: torch.Tensor,
            weight: float = 1.0, offset: int = 0) -> None:  # fmt: skip
        """Add weight * values to the begun step's gradient, at elements offset.. of tensor
        `name` (flattened): buf += w * values; start -= lr * (1 + momentum) * w * values."""
        target = start[name]
        n = values.numel()
        rate = self.lr * (1 + self.momentum) * weight
        flat, flat_buf = target.view(-1), self.buffers[name].view(-1)
        flat_values = values.detach().reshape(-1)  # (once: a copy if it is not contiguous)
        with torch.no_grad():
            for i in range(0, n, SLICE):  # (slices: as in begin)
                v = flat_values[i : i + SLICE].to(target.dtype)
                at = slice(offset + i, offset + i + v.numel())
                flat_buf[at].add_(v, alpha=weight)
                flat[at].sub_(v, alpha=rate)


def fresh_deltas(
    own_round: int,
    offered: Mapping[str, int],
    used: Mapping[str, int],
    *,
    max_staleness: int,
) -> list[str]:
    """Which peers' pseudo-gradients a DiLoCo outer step of round `own_round` may use.

    A peer's pseudo-gradient of round r is used when r >= own_round - max_staleness and no
    pseudo-gradient of that peer of round r or later was used before (each is used at most once).

    Args:
        offered: peer -> the round of the pseudo-gradient at hand from it.
        used: peer -> the round of its pseudo-gradient this node used last.

    Returns:
        The peers to use, sorted.
    """
    return sorted(
        peer
        for peer, r in offered.items()
        if r >= own_round - max_staleness and r > used.get(peer, -1)
    )


class RoundAttendance:
    """Which neighbours a dpsgd round waits for: one that missed rounds is skipped for a while.

    After its k-th consecutive miss a neighbour is not asked for min(2**k, max_skip) rounds, so a
    straggler costs the others one deadline now and then instead of one every round; an answer
    resets it.

    A miss is forgiven instead while the neighbour is catching up: it told us its round lately
    (`heard`: its own round requests, its replies) and, at the pace it has been going, reaches the
    round we asked for within `catch_up_s`. Waiting for it is then what keeps the rounds together;
    skipping it would let a node that started first (or a peer that was paused) train alone, ever
    further ahead, since rounds without neighbours cost nothing. At most `max_forgiven` misses are
    forgiven between two answers, so a neighbour we hear from but never get an answer from (a
    one-way link, or one that lies about its round) is skipped like any other.
    Pure bookkeeping: rounds and times are numbers handed in.
    """

    def __init__(
        self, max_skip: int = 32, *, catch_up_s: float = 5.0, max_forgiven: int = 8
    ) -> None:
        if max_skip < 1:
            raise ValueError(f"max_skip={max_skip}: expected >= 1")
        if catch_up_s < 0 or max_forgiven < 0:
            raise ValueError(
                f"catch_up_s={catch_up_s}, max_forgiven={max_forgiven}: expected >= 0"
            )
        self.max_skip = max_skip
        self.catch_up_s = catch_up_s
        self.max_forgiven = max_forgiven
        self.forgiven = 0  # misses forgiven so far (a statistic)
        self._misses: dict[str, int] = {}
        self._skip_until: dict[str, int] = {}
        self._forgiven_since_answer: dict[str, int] = {}
        self._heard: dict[str, deque[tuple[float, int]]] = {}

    def eligible(self, peers: Iterable[str], round_: int) -> list[str]:
        """The peers worth asking in round `round_`, in the order given."""
        return [p for p in peers if self._skip_until.get(p, -1) < round_]

    def heard(self, peer: str, round_: int, now: float) -> None:
        """`peer` was at round `round_` at time `now` (it asked us for that round, or answered)."""
        seen = self._heard.setdefault(peer, deque(maxlen=8))
        if seen and round_ < seen[-1][1]:  # it went back (restarted from a checkpoint): anew
            seen.clear()
        if not seen or round_ > seen[-1][1]:
            seen.append((now, round_))

    def catching_up(self, peer: str, round_: int, now: float) -> bool:
        """Whether `peer`, behind round `round_`, gets there within catch_up_s at its pace."""
        seen = self._heard.get(peer)
        if not seen or len(seen) < 2 or now - seen[-1][0] > self.catch_up_s:
            return False
        (t0, r0), (t1, r1) = seen[0], seen[-1]
        pace = (r1 - r0) / max(now - t0, 1e-9)  # rounds a second; falls while it is silent
        behind = round_ - (r1 + pace * (now - t1))
        return 0 < behind <= pace * self.catch_up_s

    def record(self, peer: str, round_: int, answered: bool, now: float | None = None) -> None:
        """The outcome of asking `peer` in round `round_` (`now` enables forgiving a catch-up)."""
        if answered:
            self._misses.pop(peer, None)
            self._skip_until.pop(peer, None)
            self._forgiven_since_answer.pop(peer, None)
            return
        forgiven = self._forgiven_since_answer.get(peer, 0)
        if (
            now is not None
            and forgiven < self.max_forgiven
            and self.catching_up(peer, round_, now)
        ):
            self._forgiven_since_answer[peer] = forgiven + 1
            self.forgiven += 1
            return
        misses = self._misses.get(peer, 0) + 1
        self._misses[peer] = misses
        self._skip_until[peer] = round_ + min(2**misses, self.max_skip)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the records of peers not in `keep` (dead or gone)."""
        keep = set(keep)
        for table in (self._misses, self._skip_until, self._forgiven_since_answer, self._heard):
            for peer in [p for p in table if p not in keep]:
                del table[peer]
