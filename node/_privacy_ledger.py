# [privacy] on a daemon node: Opacus on its trainer, and the ledger (state.dir/privacy.json) of
# the budget its data has spent. Invariants: a private step is recorded in the ledger before it
# is taken, so no kill forgets spent budget; a node whose ledger is there but unreadable does
# not start; a spend the ledger counts beyond the checkpoint's stays spent.
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from ._config import ConfigError, PrivacyConfig
from .state import write_atomically
from .training import LEDGER_AHEAD_STEPS, Trainer

log = structlog.get_logger()


class PrivacyLedger:
    """Makes a trainer private and keeps its spend in the ledger file.

    Args:
        config: the [privacy] table (nothing happens where it is off).
        max_steps: training.max_steps, the steps the budget is spread over.
        path: the ledger file (StateDir.privacy_ledger).
        state_dir_error: turns an OSError writing the ledger into the error the node stops with.
    """

    def __init__(self, config: PrivacyConfig, max_steps: int, path: Path,
                 state_dir_error: Callable[[OSError], Exception]) -> None:  # fmt: skip
        self.config = config
        self.max_steps = max_steps
        self.path = path
        self._state_dir_error = state_dir_error
        self._at_start: dict | None = None  # the ledger as it was at start

    def attach(self, trainer: Trainer) -> None:
        """Before the memory estimate (a worker thread): make `trainer` private and read the
        ledger.

        Raises:
            ConfigError: opacus is missing, the settings cannot be met, or the ledger is there
                but unreadable (the node does not start afresh on a budget it may have spent).
        """
        if not self.config.enabled:
            return
        self._make_private(trainer)
        self._at_start = self._read(trainer)

    def _make_private(self, trainer: Trainer) -> None:
        p = self.config
        from .training import PrivacyError, make_private

        try:
            private = make_private(
                trainer, epsilon=p.epsilon, delta=p.delta, max_grad_norm=p.max_grad_norm,
                noise_multiplier=p.noise_multiplier, planned_steps=self.max_steps,
                accountant=p.accountant, sample_rate=p.sample_rate,
            )  # fmt: skip
        except ImportError as exc:
            raise ConfigError(
                f"[privacy] needs opacus: pip install 'geotrain[privacy]' ({exc})"
            ) from exc
        except PrivacyError as exc:
            raise ConfigError(f"privacy: {exc}") from exc
        log.info("privacy_on", epsilon=p.epsilon, delta=p.delta, max_grad_norm=p.max_grad_norm,
                 noise_multiplier=round(private.noise_multiplier, 4),
                 sample_rate=round(private.sample_rate, 5), accountant=p.accountant)  # fmt: skip

    def _read(self, trainer: Trainer) -> dict | None:
        if trainer.private is None:
            return None
        try:
            state = json.loads(self.path.read_bytes())
            trainer.private.steps_in(state)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"state.dir: the privacy ledger {str(self.path)!r} cannot be read ({exc}): it "
                "records the budget this node's data has spent, so the node does not start "
                "without it; restore it, or remove it only if every model this node ever sent "
                "is gone too"
            ) from None
        return state

    async def resume(self, trainer: Trainer) -> None:
        """After the checkpoint's restore: take the ledger's spend, record every private step
        from here on, and replan the noise for what is left of the budget.

        Raises:
            ConfigError: the noise would more than double (see _replan).
        """
        if getattr(trainer, "private", None) is None:  # (off, or a loop of the user's own)
            return
        self._open(trainer)
        await self._replan(trainer)

    def _open(self, trainer: Trainer) -> None:
        """The ledger's spend wins where it counts more steps than the checkpoint (the node was
        killed after it); then every private step is written to the ledger before it is taken."""
        private, ledger, path = trainer.private, self._at_start, self.path
        assert private is not None
        if ledger is not None and private.steps_in(ledger) > private.steps_in(private.state()):
            before = private.epsilon()
            private.load_state(ledger)
            log.warning("privacy_ledger_ahead", epsilon_checkpoint=round(before, 4),
                        epsilon_spent=round(private.epsilon(), 4), ledger=str(path),
                        detail="the ledger counts more private steps than the checkpoint "
                        "(the node stopped without writing one after them): they stay spent; "
                        f"after a kill it counts up to {LEDGER_AHEAD_STEPS} steps more than were "
                        "taken")  # fmt: skip

        def write(state: dict) -> None:
            try:
                write_atomically(path, json.dumps(state).encode())
            except OSError as exc:  # no step is taken that the ledger does not count
                raise self._state_dir_error(exc) from None

        private.ledger = write

    async def _replan(self, trainer: Trainer) -> None:
        """A budget raised after it was spent is said; a derived noise is re-derived for what is
        left of the budget over the steps left of training.max_steps, and refused where it
        would drown the gradients.

        Raises:
            ConfigError: the noise would more than double (the budget left is too small for
                the steps asked): the node would train on noise, and its swarm would mix it in.
        """
        private, p = trainer.private, self.config
        assert private is not None
        left = self.max_steps - trainer.step
        # (accountant work: in a worker thread, both)
        change, spent = await trio.to_thread.run_sync(
            lambda: (private.replan(left), round(private.epsilon(), 4)))
        if private.budget_raised:
            log.warning("privacy_budget_raised", epsilon_spent=spent, budget=p.epsilon,
                        detail="the ledger's budget was spent; privacy.epsilon is larger now, so "
                        "training on this node's data goes on, its spend counted from the "
                        "ledger's")  # fmt: skip
        if change is None:
            return
        was, now = change
        if now > 2 * was:
            raise ConfigError(
                f"privacy: epsilon {spent:g} of {p.epsilon:g} is spent (the ledger), and "
                f"spreading the rest over the {left} steps left of training.max_steps "
                f"({self.max_steps}) needs noise {now:.3g} where it was {was:.3g}: more than "
                "twice the noise, the gradients drown in it, and the swarm mixes the result in. "
                "Raise privacy.epsilon (a new budget), lower training.max_steps, or set "
                "privacy.noise_multiplier to choose the noise yourself")  # fmt: skip
        log.warning("privacy_noise_replanned", noise_multiplier=round(now, 4),
                    was=round(was, 4), epsilon_spent=spent, budget=p.epsilon, steps_left=left,
                    detail="the noise that spends what is left of the budget over the steps "
                    "left of training.max_steps")  # fmt: skip

    @staticmethod
    async def settle(trainer: object) -> None:
        """At a clean stop: the steps counted ahead in the ledger are given back."""
        private = getattr(trainer, "private", None)
        if private is not None:
            await trio.to_thread.run_sync(private.settle)
