# diloco's round cadence and partner sit-outs, sans-I/O (h11's way): events in (a step taken,
# a partner's update arriving with its pace, a round end's wait, a partner's answer), decisions
# out (this step ends the round, and why; who sits out the next rounds). No trio, no clock, no
# logging: `now` and seconds are arguments, and Diloco does the I/O and says what happened.
# Invariants: a round ends at most once per step; fixed rounds end every inner_steps steps (at
# `phase` modulo inner_steps, which an early end moves); adaptive rounds stay within
# inner_steps..max_inner_steps; an early end (catch_up, round_s) needs a tenth of the round done.
from __future__ import annotations

import math
from dataclasses import dataclass

AUTO_ROUND_MARGIN = 1.5  # round_s "auto": rounds end by time after this x the swarm's usual round
MIN_STEP_S = 1e-4  # round_s "auto": a partner's seconds per step below this are not taken,
MAX_STEP_S = 86400.0  # nor above this
PACE_ROUNDS = 20  # round_s "auto": a partner's pace counts for this many of its rounds
MAX_SIT_OUT = 16  # rounds a partner that keeps failing sits out (1, 2, 4, 8, then this)


@dataclass(frozen=True)
class RoundEnd:
    """The step ends the outer round.

    Attributes:
        reason: "steps" (inner_steps, fixed or adaptive), "caught_up" (a faster partner's
            whole round came: take it now) or "timed" (round_s elapsed).
        inner_steps: the steps since the last round end.
    """

    reason: str
    inner_steps: int


class RoundClock:
    """When diloco's rounds end (DilocoSettings: inner_steps, comm_fraction, max_inner_steps,
    catch_up, round_s).

    Args:
        settings: the [gossip.diloco] table (a DilocoSettings).
    """

    def __init__(self, settings) -> None:
        self.settings = settings
        self.inner_steps = settings.inner_steps  # this round's (adaptive rounds change it)
        self.round_end_step = 0  # the trainer's step when the last round ended
        self.latest_steps = 0  # the inner steps our latest update took
        self.latest_round_ms = 0  # how long our latest update's inner steps took
        self.phase = 0  # fixed rounds end at steps = this modulo inner_steps (early ends move it)
        self.next_round_at: int | None = None  # the step that ends this round (adaptive)
        self.step_s: float | None = None  # seconds per step, a moving average (adaptive)
        self.timed_s, self.timed_steps = 0.0, 0  # this round's steps' seconds, and count
        # catch_up: peer -> (our step when its update came to the inbox, the steps it took, its
        # round)
        self.arrivals: dict[str, tuple[int, int, int]] = {}
        # round_s "auto": peer -> (seconds per inner step of its latest update used, when)
        self.paces: dict[str, tuple[float, float]] = {}
        self.catch_ups = 0  # rounds ended early to take a faster partner's update
        self.timed_rounds = 0  # rounds ended early by round_s

    # -- events -----------------------------------------------------------------------------
    def step_done(self, step: int, seconds: float, rounds: int, now: float) -> RoundEnd | None:
        """A step (the trainer's `step`, which took `seconds`) was taken, after `rounds` outer
        rounds of ours; a RoundEnd when it ends the round. Then latest_round_ms says how long
        the round's steps took (after a restart mid-round, those seen), for our update."""
        self.timed_s += max(0.0, seconds)
        self.timed_steps += 1
        end = self._ends(step, seconds, rounds, now)
        if end is None:
            return None
        steps = max(1, min(step - self.round_end_step, self.inner_steps))
        self.latest_round_ms = int(1000 * steps * self.timed_s / self.timed_steps)
        self.timed_s, self.timed_steps = 0.0, 0
        return end

    def update_made(self, step: int) -> None:
        """Our update of the round was made at the trainer's `step` (a loop of the user's own
        may have stepped past the step that ended the round)."""
        # (clamped: the first round after a restart counts from step 0)
        self.latest_steps = max(1, min(step - self.round_end_step, self.inner_steps))
        self.round_end_step = step

    def round_ended(self, step: int, waited_s: float) -> None:
        """The round end at `step` took `waited_s`: adaptive rounds set the next one's inner
        steps so that the wait stays comm_fraction of the round's compute."""
        cfg = self.settings
        if not cfg.comm_fraction or not self.step_s:
            return
        wanted = math.ceil(waited_s / (cfg.comm_fraction * self.step_s) * (1 - 1e-9))  # (float)
        self.inner_steps = max(cfg.inner_steps, min(cfg.max_inner_steps, wanted))
        self.next_round_at = step + self.inner_steps

    def update_arrived(self, peer: str, at_step: int, steps: int, their_round: int) -> None:
        """`peer`'s update of `their_round`, `steps` inner steps long (0: not said), reached
        the inbox at our step `at_step` (catch_up)."""
        self.arrivals[peer] = (at_step, steps, their_round)

    def forget_arrivals(self, keep: set[str] | dict) -> None:
        """After an outer step: only the updates still in the inbox (`keep`) count."""
        self.arrivals = {p: a for p, a in self.arrivals.items() if p in keep}

    def saw_pace(self, peer: str, steps: int, round_ms: int, now: float) -> None:
        """round_s "auto": `peer`'s update we took had `steps` inner steps that took `round_ms`
        (0: not said). Its claimed steps count at most a whole round of its longest kind;
        paces outside MIN_STEP_S..MAX_STEP_S are not taken."""
        cfg = self.settings
        if cfg.round_s != "auto" or steps <= 0 or round_ms <= 0:
            return
        pace = round_ms / 1000 / min(steps, max(cfg.inner_steps, cfg.max_inner_steps))
        if MIN_STEP_S <= pace <= MAX_STEP_S:
            self.paces[peer] = (pace, now)

    def restore(self, step: int, meta: dict, *, afresh: bool = False) -> None:
        """From a checkpoint's meta (see `meta`) at the trainer's `step`: where this round
        began (an older checkpoint: the last multiple of inner_steps), so the first round after
        a restart weighs and catches up as it would have; `afresh`: the round starts at `step`
        (the checkpoint's round start was dropped)."""
        h = self.settings.inner_steps
        self.round_end_step = step if afresh else int(meta.get("round_end_step", step - step % h))
        self.phase = int(meta.get("phase", 0)) % h

    def meta(self) -> dict:
        return {"round_end_step": self.round_end_step, "phase": self.phase}

    # -- decisions --------------------------------------------------------------------------
    def budget_s(self, now: float) -> float:
        """The seconds after which a round ends by time (0: never): round_s, or with "auto"
        AUTO_ROUND_MARGIN x inner_steps x the (upper) median of partners' seconds per step,
        each from its latest update we used within PACE_ROUNDS of its rounds."""
        round_s = self.settings.round_s
        if round_s != "auto":
            return float(round_s)
        h = self.settings.inner_steps
        paces = sorted(pace for pace, at in self.paces.values()
                       if now - at <= PACE_ROUNDS * h * pace)  # fmt: skip
        if not paces:
            return 0.0
        return AUTO_ROUND_MARGIN * h * paces[len(paces) // 2]

    def _ends(self, step: int, seconds: float, rounds: int, now: float) -> RoundEnd | None:
        cfg = self.settings
        if not cfg.comm_fraction:
            ends = step % cfg.inner_steps == self.phase
        else:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
            if self.next_round_at is None:  # (also after a restart: the next multiple)
                self.next_round_at = step + (-step) % cfg.inner_steps
            ends = step >= self.next_round_at
        done = step - self.round_end_step
        if ends:
            return RoundEnd("steps", done)
        if self._catching_up(step, rounds):
            self.catch_ups += 1
            reason = "caught_up"
        elif self._timed_out(step, now):
            self.timed_rounds += 1
            reason = "timed"
        else:
            return None
        self.phase = step % cfg.inner_steps  # (fixed rounds: H steps from here on)
        return RoundEnd(reason, done)

    def _timed_out(self, step: int, now: float) -> bool:
        """round_s: whether this round's inner steps have taken round_s seconds (their own
        time, as partners' paces are timed: evaluations, checkpoints and waits between steps
        left out), with a tenth of them done."""
        round_s = self.budget_s(now)
        return (bool(round_s) and step - self.round_end_step >= max(1, self.inner_steps // 10)
                and self.timed_s >= round_s)  # fmt: skip

    def _catching_up(self, step: int, rounds: int) -> bool:
        """catch_up: whether a partner that has made more rounds than we have sent an update of
        a whole round while we were between a tenth and half of our round's inner steps: we
        are the slow one. (Without the rounds, a fast peer would take a slower peer's whole
        round, landing anywhere in its own, as a reason to end its rounds early.)"""
        if not self.settings.catch_up or not self.arrivals:
            return False
        h, begun = self.inner_steps, self.round_end_step
        low, high = max(1, h // 10), h // 2
        return any(low <= at - begun <= high and (steps or h) >= h and their > rounds
                   for at, steps, their in self.arrivals.values())  # fmt: skip


class SitOuts:
    """Partners that failed or declined sit out rounds: peer -> (the last round it sits out,
    failures in a row). Rounds, not seconds, since a round may last a minute."""

    def __init__(self) -> None:
        self.rounds: dict[str, tuple[int, int]] = {}

    def available(self, peers: list[str], round_: int) -> list[str]:
        """Those of `peers` that do not sit out `round_` (all of them if every one does)."""
        return [p for p in peers if self.rounds.get(p, (0, 0))[0] < round_] or peers

    def answered(self, peer: str) -> None:
        self.rounds.pop(peer, None)

    def declined(self, peer: str, round_: int) -> None:
        """Busy: it sits out the next round, no failure counted."""
        self.rounds[peer] = (round_ + 1, self.rounds.get(peer, (0, 0))[1])

    def failed(self, peer: str, round_: int) -> None:
        """Failed or rejected: it sits out 1, 2, 4, 8, then MAX_SIT_OUT rounds."""
        failures = self.rounds.get(peer, (0, 0))[1] + 1
        self.rounds[peer] = (round_ + min(2 ** (failures - 1), MAX_SIT_OUT), failures)

    def keep(self, live: set[str]) -> None:
        """Forget peers no longer live."""
        self.rounds = {p: s for p, s in self.rounds.items() if p in live}
