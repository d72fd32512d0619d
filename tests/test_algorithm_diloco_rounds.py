"""diloco's round cadence and partner sit-outs as plain state machines: events in, decisions
out, no trio and no clock (every `now` is given)."""

from __future__ import annotations

import pytest

from geotrain.node.algorithms._diloco_rounds import (
    AUTO_ROUND_MARGIN,
    PACE_ROUNDS,
    RoundClock,
    RoundEnd,
    SitOuts,
)
from geotrain.node.algorithms.diloco import DilocoSettings


def ends(clock: RoundClock, steps: range, seconds: float = 1.0, rounds: int = 0,
         now: float = 0.0) -> dict[int, RoundEnd]:  # fmt: skip
    """Feed `steps` to the clock; the round ends it decided, by step (each then made)."""
    out = {}
    for step in steps:
        end = clock.step_done(step, seconds, rounds, now + step * seconds)
        if end is not None:
            out[step] = end
            clock.update_made(step)
    return out


def test_fixed_rounds_end_every_inner_steps():
    clock = RoundClock(DilocoSettings(inner_steps=5))
    found = ends(clock, range(1, 16))
    assert list(found) == [5, 10, 15]
    assert all(e == RoundEnd("steps", 5) for e in found.values())
    assert clock.latest_steps == 5 and clock.latest_round_ms == 5_000


def test_a_partners_whole_round_arriving_early_in_ours_ends_it_and_moves_the_phase():
    clock = RoundClock(DilocoSettings(inner_steps=10, catch_up=True))
    assert ends(clock, range(1, 3)) == {}
    clock.update_arrived("p", at_step=3, steps=10, their_round=1)  # we have made 0 rounds
    assert ends(clock, range(3, 4)) == {3: RoundEnd("caught_up", 3)}
    assert clock.catch_ups == 1 and clock.phase == 3
    clock.forget_arrivals(set())  # (its update was used in the outer step)
    assert list(ends(clock, range(4, 25))) == [13, 23]  # ten steps from the new phase


def test_no_catch_up_from_a_partner_behind_or_a_short_round_or_late_in_ours():
    for arrival in [(3, 10, 0),  # its round is not ahead of ours
                    (3, 4, 1),  # a short round of it
                    (7, 10, 1)]:  # past half of ours  # fmt: skip
        clock = RoundClock(DilocoSettings(inner_steps=10, catch_up=True))
        ends(clock, range(1, arrival[0]))
        clock.update_arrived("p", *arrival)
        assert arrival[0] not in ends(clock, range(arrival[0], arrival[0] + 1)), arrival
        assert clock.catch_ups == 0


def test_a_round_ends_by_time_once_its_steps_took_round_s_with_a_tenth_done():
    clock = RoundClock(DilocoSettings(inner_steps=20, round_s=10.0))
    assert clock.budget_s(now=0.0) == 10.0
    found = ends(clock, range(1, 21), seconds=4.0)  # the third step passes 10 s
    assert list(found) == [3, 6, 9, 12, 15, 18] and found[3] == RoundEnd("timed", 3)
    assert clock.timed_rounds == 6


def test_round_s_auto_takes_the_upper_median_of_fresh_paces_within_bounds():
    clock = RoundClock(DilocoSettings(inner_steps=10, round_s="auto"))
    assert clock.budget_s(now=0.0) == 0.0  # nothing heard: rounds end by steps only
    clock.saw_pace("a", steps=10, round_ms=10_000, now=0.0)  # 1 s a step
    clock.saw_pace("b", steps=10, round_ms=30_000, now=0.0)  # 3 s a step
    clock.saw_pace("c", steps=100, round_ms=1, now=0.0)  # 0.01 ms a step: below, not taken
    assert "c" not in clock.paces
    assert clock.budget_s(now=0.0) == pytest.approx(AUTO_ROUND_MARGIN * 10 * 3.0)
    # a's pace is forgotten after PACE_ROUNDS of its rounds, b's later
    assert clock.budget_s(now=PACE_ROUNDS * 10 * 1.0 + 1) == pytest.approx(45.0)
    assert clock.budget_s(now=PACE_ROUNDS * 10 * 3.0 + 1) == 0.0


def test_adaptive_rounds_keep_the_wait_a_fraction_of_compute_within_bounds():
    settings = DilocoSettings(inner_steps=4, comm_fraction=0.5, max_inner_steps=40)
    clock = RoundClock(settings)
    assert list(ends(clock, range(1, 5), seconds=0.1)) == [4]
    clock.round_ended(4, waited_s=1.0)  # 1 s wait at 0.1 s a step: 20 steps of compute
    assert clock.inner_steps == 20 and clock.next_round_at == 24
    assert list(ends(clock, range(5, 25), seconds=0.1)) == [24]
    clock.round_ended(24, waited_s=100.0)
    assert clock.inner_steps == 40  # (at most max_inner_steps)
    clock.round_ended(64, waited_s=0.0)
    assert clock.inner_steps == 4  # (at least inner_steps)


def test_a_restart_resumes_the_round_where_it_began():
    clock = RoundClock(DilocoSettings(inner_steps=10))
    clock.restore(17, {"round_end_step": 12, "phase": 2})
    assert (clock.round_end_step, clock.phase) == (12, 2)
    clock.restore(17, {})  # an older checkpoint: the last multiple of inner_steps
    assert (clock.round_end_step, clock.phase) == (10, 0)
    clock.restore(17, {"round_end_step": 12, "phase": 2}, afresh=True)
    assert clock.round_end_step == 17 and clock.meta() == {"round_end_step": 17, "phase": 2}


def test_partners_that_fail_sit_out_doubling_rounds_and_busy_ones_one():
    sits = SitOuts()
    peers = ["p1", "p2"]
    for expected_last in (2, 4, 8, 16, 32, 48):  # failed at rounds 1, 2, 4, 8, 16 and 32
        round_ = {2: 1, 4: 2, 8: 4, 16: 8, 32: 16, 48: 32}[expected_last]
        sits.failed("p1", round_)
        assert sits.rounds["p1"][0] == expected_last
    assert sits.available(peers, 40) == ["p2"]
    sits.answered("p1")
    assert sits.available(peers, 40) == peers
    sits.declined("p2", 5)
    assert sits.rounds["p2"] == (6, 0) and sits.available(peers, 6) == ["p1"]
    sits.failed("p1", 6)
    assert sits.available(peers, 6) == peers  # everyone sits out: nobody is left out
    sits.keep({"p2"})
    assert set(sits.rounds) == {"p2"}
