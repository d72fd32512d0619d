# Differential privacy of a node's training ([privacy]), through Opacus: per-sample gradient
# clipping and Gaussian noise (its GradSampleModule hooks and DPOptimizer) and its accountant.
# Invariants: only this module imports opacus, and only when [privacy] is set (the optional
# `geotrain[privacy]` extra); the model keeps its own parameter names (the hooks sit on its
# layers, nothing is renamed), so private and plain peers exchange and checkpoint alike; epsilon
# is the accountant's, never computed here; once the spent epsilon reaches the budget no
# gradient of this node's data is taken again: its steps become mixing-only (no batch is read,
# the step counter advances so that exchanges go on at the same pace) and it says so once.
#
# Guarantee and its limits: (epsilon, delta)-DP of each training sample of this node against
# anyone who sees every model this node sends, by post-processing (mixing peers' models in does
# not spend budget). The accountant assumes Poisson sampling at rate batch_size / shard_size;
# the tasks' batches are shuffled fixed-size batches, the usual approximation (Opacus' own
# default data loader makes the same one unless asked for Poisson sampling).
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._tasks import batch_samples

if TYPE_CHECKING:
    from ._trainer import Trainer

ACCOUNTANTS = ("rdp", "prv")
# private steps recorded ahead in the node's privacy ledger at a time: a node killed (SIGKILL, a
# power cut) restarts with at most this many steps more counted than it took, never fewer (its
# checkpoint alone forgot every step after it, while the models those steps made had been sent)
LEDGER_AHEAD_STEPS = 20


class PrivacyError(ValueError):
    """[privacy] cannot be applied to this model or task; the message says why (Opacus's own
    words for a model it cannot handle)."""


@dataclass(frozen=True)
class PrivacyStatistics:
    epsilon_spent: float
    epsilon_budget: float
    delta: float
    noise_multiplier: float
    private_steps: int
    exhausted: bool


class PrivateTraining:
    """Opacus on a Trainer's model and optimizer: what `Trainer.train_step` uses when set.

    Args:
        model: the trainer's module (hooks are added to its layers).
        optimizer: the trainer's optimizer (wrapped; the original keeps its state for
            checkpoints).
        epsilon, delta: the budget.
        max_grad_norm: each sample's gradient is clipped to this L2 norm.
        noise_multiplier: the noise's std over max_grad_norm; None: the one that spends exactly
            `epsilon` in `planned_steps` steps (Opacus' get_noise_multiplier).
        planned_steps: for that computation (training.max_steps).
        sample_rate: batch_size / shard_size.
        batch_size: the expected batch size (the noise is scaled by it).
        accountant: "rdp" or "prv".

    Raises:
        PrivacyError: Opacus cannot handle the model (its error), or a setting is impossible.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, epsilon: float,
        delta: float, max_grad_norm: float, noise_multiplier: float | None, planned_steps: int,
        sample_rate: float, batch_size: int, accountant: str = "rdp",
    ) -> None:  # fmt: skip
        from opacus import GradSampleModule
        from opacus.accountants import create_accountant
        from opacus.accountants.utils import get_noise_multiplier
        from opacus.optimizers import DPOptimizer
        from opacus.validators import ModuleValidator

        if not 0 < sample_rate <= 1:
            raise PrivacyError(f"sample rate {sample_rate}: expected 0 < batch / shard size <= 1")
        try:
            ModuleValidator.validate(model, strict=True)
        except Exception as exc:  # opacus.validators.errors.UnsupportedModuleError
            raise PrivacyError(f"Opacus cannot make this model private: {exc}") from exc
        derived = noise_multiplier is None  # (re-derived for what is left: see replan)
        if noise_multiplier is None:
            if planned_steps < 1:
                raise PrivacyError("no noise multiplier and no planned steps to derive it from")
            try:
                noise_multiplier = get_noise_multiplier(
                    target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                    steps=planned_steps, accountant=accountant,
                )  # fmt: skip
            except ValueError as exc:  # ("The privacy budget is too low.", naming nothing)
                raise PrivacyError(
                    f"epsilon = {epsilon:g}: no noise multiplier spends it in {planned_steps} "
                    f"steps at delta {delta:g} (Opacus: {exc}); raise privacy.epsilon, or set "
                    "privacy.noise_multiplier") from None
        self.epsilon_budget, self.delta = epsilon, delta
        self.derived = derived
        self.noise_multiplier, self.sample_rate = float(noise_multiplier), sample_rate
        self.hooks = GradSampleModule(model)  # per-sample gradients of the module's own layers
        self.optimizer = DPOptimizer(
            optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=batch_size,
        )  # fmt: skip
        self.accountant = create_accountant(accountant)
        self._rdp: Any = None  # opacus' RDP analysis, for the rdp accountant (its fast path)
        if type(self.accountant).__name__ == "RDPAccountant":
            from opacus.accountants.analysis import rdp as rdp_analysis

            self._rdp, self._orders = rdp_analysis, list(self.accountant.DEFAULT_ALPHAS)
        self._rdp_steps: dict[tuple[float, float], np.ndarray] = {}
        self.steps = 0
        self.exhausted = False
        self.budget_raised = False
        # seconds a private step took (a running mean; kept in the ledger): what a mixing-only
        # step waits once the budget is spent, also after a restart that took none
        self.step_s: float | None = None
        # the node's ledger (a durable write of state(), or None): steps are recorded in it
        # before they are taken; `recorded` is the accountant step count it covers
        self.ledger: Callable[[dict], None] | None = None
        self.recorded = 0
        self._planned = planned_steps
        self._spent: tuple[int, float] = (0, 0.0)  # (accounted steps, epsilon) of the last query
        self._allowed = self._steps_allowed()  # private steps the budget allows from here

    def _epsilon_after(self, more: int, noise: float | None = None) -> float:
        """Epsilon the accountant gives for its history plus `more` steps at this mechanism (or
        at noise multiplier `noise`)."""
        noise = self.noise_multiplier if noise is None else noise
        if self._rdp is not None:  # the RDP accountant's own figures, without its slow part
            return self._rdp_epsilon_after(more, noise)
        probe = type(self.accountant)()
        probe.history = [*self.accountant.history]
        if more:
            probe.history.append((noise, self.sample_rate, more))
        return probe.get_epsilon(self.delta) if probe.history else 0.0

    def _rdp_epsilon_after(self, more: int, noise: float) -> float:
        """What RDPAccountant.get_epsilon gives for the history plus `more` steps, in
        microseconds instead of 20-250 ms a query: a step's Renyi divergence at each order is
        computed once (opacus' compute_rdp is that times the steps), so the binary search over
        the steps allowed takes milliseconds, not seconds, at every start and restore."""
        analysis, history = self._rdp, self.accountant.history
        if not history and not more:
            return 0.0
        rdp = sum((k * self._rdp_of(n, q) for n, q, k in history), np.zeros(len(self._orders)))
        rdp = rdp + more * self._rdp_of(noise, self.sample_rate)
        eps, _ = analysis.get_privacy_spent(orders=self._orders, rdp=rdp, delta=self.delta)
        return float(eps)

    def _rdp_of(self, noise_multiplier: float, sample_rate: float) -> np.ndarray:
        """One step's Renyi divergence at each order for this mechanism (computed once each:
        0.1-0.5 s for the fractional orders)."""
        key = (noise_multiplier, sample_rate)
        if key not in self._rdp_steps:
            self._rdp_steps[key] = np.asarray(self._rdp.compute_rdp(
                q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=self._orders))
        return self._rdp_steps[key]

    def _steps_allowed(self) -> int:
        """The most further steps whose epsilon stays within the budget: epsilon only grows
        with the steps, so an exponential then a binary search (a few dozen accountant queries,
        once, instead of one per step: a query costs 20-250 ms, a small model's step a few)."""
        def within(k: int) -> bool:
            try:
                return self._epsilon_after(k) <= self.epsilon_budget
            except (ValueError, OverflowError, RuntimeError):  # an accountant out of its range
                return False

        lo, hi = 0, max(1, self._planned)
        if within(hi):
            lo, hi = hi, 2 * hi
            while within(hi) and hi < 1 << 40:
                lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if within(mid) else (lo, mid)
        return lo if within(lo) else 0

    def epsilon(self) -> float:
        """Epsilon spent so far at this delta (the accountant's figure, asked once per step
        count)."""
        taken = sum(k for _, _, k in self.accountant.history)
        if self._spent[0] != taken:
            self._spent = (taken, self._epsilon_after(0))
        return self._spent[1]

    def would_exceed(self) -> bool:
        """Whether one more private step would spend more than the budget (then none is taken)."""
        if not self.exhausted and self._allowed <= 0:
            self.exhausted = True
        return self.exhausted

    def record_ahead(self) -> None:
        """Before a private step: make sure the ledger counts it, recording up to
        LEDGER_AHEAD_STEPS steps ahead (never past the budget) in one durable write.

        Raises:
            OSError: the ledger cannot be written; the step must not be taken.
        """
        taken = self._accounted()
        if self.ledger is None or self.recorded > taken:
            return
        ahead = max(1, min(LEDGER_AHEAD_STEPS, self._allowed))
        self.ledger(self.state(ahead=ahead))
        self.recorded = taken + ahead

    def settle(self) -> None:
        """Record the steps taken exactly (a clean stop): what was counted ahead is given back."""
        if self.ledger is not None:
            self.ledger(self.state())
            self.recorded = self._accounted()

    def _accounted(self) -> int:
        return sum(int(k) for _, _, k in self.accountant.history)

    def observe_step(self, seconds: float) -> None:
        """A private step took `seconds` (its whole time: compute, noise, pinned pacing)."""
        if math.isfinite(seconds) and seconds > 0:
            self.step_s = seconds if self.step_s is None else 0.9 * self.step_s + 0.1 * seconds

    def stepped(self) -> None:
        """Account for one private step just taken."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self.steps += 1
        self._allowed -= 1

    def state(self, *, ahead: int = 0) -> dict:
        """The accountant's history, JSON-able, for a checkpoint or the ledger: a restarted node
        goes on spending the same budget instead of starting a new one. `ahead`: count that
        many more steps at this mechanism (recorded before they are taken)."""
        history = [[float(n), float(q), int(k)] for n, q, k in self.accountant.history]
        if ahead:
            history.append([self.noise_multiplier, self.sample_rate, int(ahead)])
        return {"history": history, "steps": self.steps + ahead, "exhausted": self.exhausted,
                "step_s": self.step_s, "budget": self.epsilon_budget}

    @staticmethod
    def steps_in(state: Any) -> int:
        """The accountant steps a state() counts.

        Raises:
            ValueError: not what state() writes (a ledger file damaged or edited).
        """
        return sum(k for _, _, k in _history(state))

    def load_state(self, state: dict) -> None:
        """Restore what `state` returned (from a checkpoint). A budget spent stays spent unless
        privacy.epsilon was raised since (the operator's decision: the spend goes on counting
        from the ledger's; a ledger that does not say its budget keeps it spent)."""
        self.accountant.history = _history(state)
        self.steps = int(state.get("steps", 0))
        self._spent = (0, 0.0)
        self._allowed = self._steps_allowed()
        step_s = state.get("step_s")
        if isinstance(step_s, int | float) and math.isfinite(step_s) and 0 < step_s <= 3600:
            self.step_s = float(step_s)
        spent, budget = bool(state.get("exhausted", False)), state.get("budget")
        raised = (spent and isinstance(budget, int | float) and not isinstance(budget, bool)
                  and self.epsilon_budget > budget)  # fmt: skip
        self.exhausted, self.budget_raised = spent and not raised, raised
        self.recorded = max(self.recorded, self._accounted())

    def replan(self, steps_left: int) -> tuple[float, float] | None:
        """With a derived noise (privacy.noise_multiplier unset) and steps already spent: the
        noise for the `steps_left` steps the node will still take (training.max_steps less its
        step), in place of the one derived at start for the whole budget over all of them.
        The last phase's noise is kept when what is left of the budget pays for those steps at
        it; a larger one is found when not (returned as (the last noise, the new one)); when not
        even one more step fits at the last noise, the budget is spent (exhausted). Returns
        None when the noise is the last one. Blocking (each noise tried costs an accountant
        computation, 0.1-0.5 s): run it in a worker thread.

        A restart with a larger training.max_steps spread the whole budget again over all the
        steps, ignoring the spend: 7.99 of 8 spent in 3,000 steps, then 1,000,000 asked for,
        gave noise 15.5 where it had been 1.10, and the swarm's models went to chance."""
        history = self.accountant.history
        if not self.derived or not history or steps_left <= 0 or self.exhausted:
            return None
        last = float(history[-1][0])

        def fits(sigma: float, steps: int = steps_left) -> bool:
            try:
                return self._epsilon_after(steps, sigma) <= self.epsilon_budget
            except (ValueError, OverflowError, RuntimeError, MemoryError):  # out of its range
                return False

        def use(sigma: float) -> None:
            if sigma != self.noise_multiplier:  # (load_state counted the steps at the other)
                self.noise_multiplier = self.optimizer.noise_multiplier = sigma
                self._allowed = self._steps_allowed()

        if fits(last):
            use(last)
            return None
        if not fits(last, 1):  # not one more step at the noise it had: spent
            use(last)
            self.exhausted = True
            return None
        lo, hi = last, 2 * last
        while not fits(hi) and hi < 1e6:
            lo, hi = hi, 2 * hi
        if not fits(hi):
            use(last)
            self.exhausted = True
            return None
        while hi / lo > 1.01:  # geometric bisection: the least noise that fits, to 1%
            mid = (lo * hi) ** 0.5
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        use(hi)
        return last, hi

    def statistics(self) -> PrivacyStatistics:
        return PrivacyStatistics(self.epsilon(), self.epsilon_budget, self.delta,
                                 self.noise_multiplier, self.steps, self.exhausted)  # fmt: skip


def _history(state: Any) -> list[tuple[float, float, int]]:
    """An accountant history from state(): (noise multiplier, sample rate, steps) entries.

    Raises:
        ValueError: anything else.
    """
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError("expected {'history': [[noise_multiplier, sample_rate, steps], ...]}")
    steps, exhausted = state.get("steps", 0), state.get("exhausted", False)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps {steps!r}: expected a whole number >= 0")
    if not isinstance(exhausted, bool):
        raise ValueError(f"exhausted {exhausted!r}: expected true or false")
    out = []
    for entry in history:
        if not (isinstance(entry, list | tuple) and len(entry) == 3
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in entry)
                and entry[0] >= 0 and 0 < entry[1] <= 1 and entry[2] >= 0
                and float(entry[2]).is_integer()):  # fmt: skip
            raise ValueError(f"history entry {entry!r}: expected [noise_multiplier >= 0, "
                             "0 < sample_rate <= 1, whole steps >= 0]")  # fmt: skip
        out.append((float(entry[0]), float(entry[1]), int(entry[2])))
    return out


def make_private(
    trainer: Trainer, *, epsilon: float, delta: float = 1e-5, max_grad_norm: float = 1.0,
    noise_multiplier: float | None = None, planned_steps: int = 0, accountant: str = "rdp",
    sample_rate: float | None = None,
) -> PrivateTraining:  # fmt: skip
    """Make `trainer`'s steps differentially private (in place) and return the mechanism.

    The sample rate is the task's batch size over its shard size (Task.train_size), unless
    given.

    Raises:
        PrivacyError: Opacus cannot handle the model; the task does not say its shard size and
            no sample_rate is given; accumulate > 1; or no noise multiplier can be derived.
        ImportError: opacus is not installed (pip install 'geotrain[privacy]').
    """
    if trainer.accumulate != 1:
        raise PrivacyError("training.accumulate > 1 is not supported with [privacy]")
    batch = next(trainer.task.batches)
    batch_size = _batch_size(batch)
    trainer.task.batches = _prepend(batch, trainer.task.batches)
    if sample_rate is None:
        size = getattr(trainer.task, "train_size", None)
        if not size:
            raise PrivacyError("the task does not state its shard size (Task.train_size): set "
                               "privacy.sample_rate (batch size / training samples)")  # fmt: skip
        sample_rate = min(1.0, batch_size / size)
    private = PrivateTraining(
        trainer.model, trainer.optimizer, epsilon=epsilon, delta=delta,
        max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
        planned_steps=planned_steps, sample_rate=sample_rate, batch_size=batch_size,
        accountant=accountant,
    )  # fmt: skip
    _check_per_sample_gradients(trainer, batch, batch_size)
    trainer.private = private
    return private


def _check_per_sample_gradients(trainer: Trainer, batch: Any, batch_size: int) -> None:
    """One forward and backward pass on the first batch (nothing stepped, nothing spent: the
    gradients are dropped): every trained parameter must get one gradient per sample of the
    batch, or Opacus fails at the first step with a stacking error. A model that folds the
    batch into another dimension before a layer (x.view(B * T, d) into a Linear) is refused here
    with the parameters' names instead.

    Raises:
        PrivacyError: some parameters get no per-sample gradient, or one of another batch size.
    """
    model = trainer.model
    try:
        trainer.task.loss(model, batch).backward()
        wrong = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            sample = getattr(param, "grad_sample", None)
            if sample is None or sample.shape[0] != batch_size:
                wrong.append(f"{name} ({'none' if sample is None else sample.shape[0]})")
    finally:
        for param in model.parameters():
            param.grad = None
            if hasattr(param, "grad_sample"):
                param.grad_sample = None
    if wrong:
        raise PrivacyError(
            f"Opacus cannot take per-sample gradients of this model: a batch of {batch_size} "
            f"gave these parameters another number of per-sample gradients: "
            f"{', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''} (the model must keep "
            "the batch as the first dimension into every layer)"
        )


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise PrivacyError("[privacy] needs batches whose first tensor is (batch, ...)")
    return batch_samples(batch)


def _prepend(first: Any, rest):
    yield first
    yield from rest


def mixing_only_step(trainer: Trainer, started: float, said: list[bool], log: Any) -> float:
    """What a step is once the budget is spent: no batch, no gradient; wait about as long as a
    private step took (so exchanges keep their pace; the ledger keeps that time, so a node
    restarted spent keeps it too: it measured its own waits, and went at 19 steps/s where its
    steps had gone at 10) and say so once. Returns the seconds waited."""
    if not said[0]:
        said[0] = True
        stats = trainer.private.statistics()  # type: ignore[union-attr]
        log.warning("privacy_budget_spent", epsilon=round(stats.epsilon_spent, 4),
                    budget=stats.epsilon_budget, delta=stats.delta, steps=stats.private_steps,
                    detail="no more training on this node's data; it keeps mixing")  # fmt: skip
    interval = trainer.private.step_s or trainer.step_interval_s() or 0.01  # type: ignore[union-attr]
    wait = min(1.0, interval) if math.isfinite(interval) else 0.01
    time.sleep(wait)
    return time.perf_counter() - started
