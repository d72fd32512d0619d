# Byzantine peers, for the testbed only. Invariants: nothing in node/ imports this module and no
# node config key reaches it (a node's config refuses unknown sections and keys); an attack is
# switched on only by arming a trainer here, which the testbed's own entry point
# (testbed/_attacker.py) and the in-memory harness (testbed/_byzantine.py) do; an armed trainer
# still steps, evaluates and checkpoints as a Trainer, so the node's algorithms run unchanged and
# send what the attack forges.
#
# What each attack sends (x: the attacker's own model, trained on its own shard and never mixed
# with anyone's; x0: the swarm's common initial model; m, s: the per-coordinate mean and standard
# deviation of the models the attack observed, the honest swarm's as far as it can tell):
#   sign_flip   x0 - (x - x0): its own progress, reversed.
#   alie        m - z s, "a little is enough" (Baruch et al. 2019): z from the swarm size and the
#               number of attackers (z = Phi^-1((n - s') / n), s' = floor(n/2 + 1) - f), at least
#               ALIE_MIN_Z; small enough per coordinate to pass any distance check.
#   ipm         x0 - IPM_EPSILON (m - x0): inner-product manipulation (Xie et al. 2020), the
#               honest progress scaled and reversed.
#   label_flip  its honest model, trained on labels y -> classes - 1 - y (poisoned data); it
#               takes part in the protocol honestly, mixes included.
#   noise       x + N(0, (NOISE_SCALE rms(x))^2) per coordinate.
#   nan         NaN everywhere (validation must refuse it).
#   replay      x0: the oldest model there is, sent again and again.
# In a testbed process the attack observes only its own model (m = x, s from the spread of its
# last models): a realistic attacker that sees no one else's. The harness may feed it the honest
# models (an omniscient attacker, the literature's worst case).
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch

from geotrain.node import Trainer

from ._scenario import ATTACK_KINDS

ALIE_MIN_Z = 1.0  # the formula gives ~0.3 for 2 of 8: too meek to show anything in a gossip swarm
IPM_EPSILON = 0.5
NOISE_SCALE = 2.0  # noise of twice the model's own rms: the norm check (10x) still lets it in
OBSERVED = 8  # models the attack keeps for its mean and spread

Tensors = dict[str, torch.Tensor]


class AttackError(ValueError):
    """An attack cannot be set up as asked (unknown kind, a task it cannot poison)."""


def alie_z(n_peers: int, n_attackers: int) -> float:
    """ALIE's z for `n_attackers` of `n_peers` (at least ALIE_MIN_Z)."""
    supporters = math.floor(n_peers / 2 + 1) - n_attackers
    p = (n_peers - supporters) / n_peers
    z = statistics.NormalDist().inv_cdf(min(max(p, 1e-6), 1 - 1e-6))
    return max(z, ALIE_MIN_Z)


class Attack:
    """Forges the model an attacker sends.

    Args:
        kind: one of ATTACK_KINDS.
        initial: x0, the swarm's common initial model (copied).
        n_peers, n_attackers: for ALIE's z.
        seed: for the noise attack.

    Raises:
        AttackError: an unknown kind.
    """

    def __init__(
        self, kind: str, initial: Tensors, *, n_peers: int = 8, n_attackers: int = 2, seed: int = 0
    ) -> None:
        if kind not in ATTACK_KINDS:
            raise AttackError(f"attack {kind!r}: expected one of {ATTACK_KINDS}")
        self.kind = kind
        self.initial = {k: v.detach().clone() for k, v in initial.items()}
        self.z = alie_z(n_peers, n_attackers)
        self._observed: list[Tensors] = []
        self._gen = torch.Generator().manual_seed(seed)
        self.forged = 0

    @property
    def forges(self) -> bool:
        """Whether it changes what is sent (label_flip poisons data instead)."""
        return self.kind != "label_flip"

    def observe(self, models: list[Tensors]) -> None:
        """Models the attack may base its estimate of the honest swarm on (newest last)."""
        self._observed = [*self._observed, *models][-OBSERVED:]

    def _moments(self, own: Tensors) -> tuple[Tensors, Tensors]:
        seen = self._observed or [own]
        mean = {k: torch.stack([m[k] for m in seen]).mean(dim=0) for k in own}
        if len(seen) < 2:
            return mean, {k: torch.zeros_like(v) for k, v in own.items()}
        std = {k: torch.stack([m[k] for m in seen]).std(dim=0) for k in own}
        return mean, std

    def forge(self, own: Tensors) -> Tensors:
        """What to send instead of `own` (new tensors; `own` is not changed)."""
        self.forged += 1
        x0 = self.initial
        if self.kind == "sign_flip":
            return {k: 2 * x0[k] - v for k, v in own.items()}
        if self.kind == "alie":
            mean, std = self._moments(own)
            return {k: mean[k] - self.z * std[k] for k in own}
        if self.kind == "ipm":
            mean, _ = self._moments(own)
            return {k: x0[k] - IPM_EPSILON * (mean[k] - x0[k]) for k in own}
        if self.kind == "noise":
            out = {}
            for k, v in own.items():
                rms = float(v.pow(2).mean().sqrt()) if v.numel() else 0.0
                noise = torch.randn(v.shape, generator=self._gen).to(v.device, v.dtype)
                out[k] = v + NOISE_SCALE * max(rms, 1e-3) * noise
            return out
        if self.kind == "nan":
            return {k: torch.full_like(v, float("nan")) for k, v in own.items()}
        if self.kind == "replay":
            return {k: v.clone() for k, v in x0.items()}
        return {k: v.clone() for k, v in own.items()}  # label_flip: the honest model


def _labelled(batch: Any) -> tuple[Any, torch.Tensor]:
    if not (isinstance(batch, tuple | list) and len(batch) == 2
            and isinstance(batch[1], torch.Tensor) and not batch[1].is_floating_point()):
        raise AttackError("label_flip needs a classification task: batches of (x, int labels)")
    return batch[0], batch[1]


def flipped_labels(batches: Iterator[Any], classes: int | None,
                   model: torch.nn.Module | None = None) -> Iterator[Any]:  # fmt: skip
    """The batches with labels y -> classes - 1 - y (tuples (x, y) of integer labels; a
    sequence's labels too, as a language model's next bytes). `classes` None: the size of the
    model's last output dimension on the first batch (10 for digits, 256 for a byte-level LM).

    Raises:
        AttackError: (on the first batch) a batch that is not (x, integer labels), or labels the
            model's output cannot hold.
    """
    for batch in batches:
        x, y = _labelled(batch)
        if classes is None:
            with torch.no_grad():
                out = model(x) if model is not None else None
            if not isinstance(out, torch.Tensor) or out.dim() < 2:
                raise AttackError("label_flip: give the number of classes (the model's output "
                                  "is not a tensor of logits)")  # fmt: skip
            classes = int(out.shape[-1])
        if int(y.max()) >= classes or int(y.min()) < 0:
            raise AttackError(f"label_flip: labels outside 0..{classes - 1}")
        yield x, classes - 1 - y


class AttackedTrainer(Trainer):
    """A Trainer whose reads for sending (`update`, `read`, `snapshot`) see the forged model, and
    whose mixes (`apply`) are dropped (the attacker keeps its own model), unless the attack is
    label_flip (honest protocol on poisoned data). Made by `arm`, never constructed directly."""

    attack: Attack
    on_forge: Callable[[Tensors], None] | None

    def _forged(self) -> Tensors:
        own = Trainer.snapshot(self)
        if self.on_forge is not None:
            self.on_forge(own)
        return self.attack.forge(own)

    def update(self, fn):  # type: ignore[override]
        if not self.attack.forges:
            return Trainer.update(self, fn)
        with torch.no_grad():
            return fn(self._forged())

    def read(self, fn):  # type: ignore[override]
        if not self.attack.forges:
            return Trainer.read(self, fn)
        with torch.no_grad():
            return fn(self._forged())

    def apply(self, fn, *, changes: bool = True):  # type: ignore[override]
        if not self.attack.forges:
            return Trainer.apply(self, fn, changes=changes)
        with torch.no_grad():
            return fn(Trainer.snapshot(self))  # on a copy: the attacker's model stays its own

    def snapshot(self) -> Tensors:
        if not self.attack.forges:
            return Trainer.snapshot(self)
        return self._forged()


def arm(
    trainer: Trainer, attack: Attack, *, classes: int | None = None, observe_own: bool = True
) -> AttackedTrainer:
    """Turn `trainer` into an attacker's (in place; returns it).

    Args:
        trainer: a node's trainer, its model at the swarm's initial state or later.
        attack: what to forge.
        classes: for label_flip, the number of classes (None: the model's output says).
        observe_own: feed the attack the attacker's own model before each forge (a testbed
            process: it sees no one else's). The harness passes False and feeds honest models.

    Raises:
        AttackError: label_flip on a task whose batches are not (x, integer labels) (raised at
            the first step).
    """
    trainer.__class__ = AttackedTrainer
    armed: AttackedTrainer = trainer  # type: ignore[assignment]
    armed.attack = attack
    armed.on_forge = (lambda own: attack.observe([own])) if observe_own else None
    if attack.kind == "label_flip":
        trainer.task.batches = flipped_labels(trainer.task.batches, classes, trainer.model)
    return armed
