"""gossip/_pacing: the cadence of a node's exchanges, fixed or following the measured exchange
time and step time (gossip.comm_fraction); and the runtimes that use it, on a virtual clock with
a link that slows down and recovers."""

from __future__ import annotations

import pytest
import trio
from _runtimes import runtimes, settle

from geotrain.gossip import ExchangePacer
from geotrain.node.algorithms.choco import ChocoSettings
from geotrain.node.algorithms.selsync import SelsyncSettings
from geotrain.node.training import StepResult


def test_a_fixed_cadence_is_every_nth_step_whatever_was_measured():
    pacer = ExchangePacer(every=4)
    pacer.observe_step(0.01)
    assert [s for s in range(1, 13) if pacer.due(s)] == [4, 8, 12]
    assert pacer.finished(10.0) == 4  # no fraction: nothing adapts


def test_the_interval_is_the_exchange_time_over_the_fraction_of_a_step_within_bounds():
    pacer = ExchangePacer(every=2, fraction=0.1, most=50)
    assert pacer.due(1)  # nothing measured yet: at once
    pacer.mark(1)
    assert not pacer.due(2)  # (at least `every` steps apart)
    for _ in range(10):
        pacer.observe_step(0.05)
    assert pacer.finished(0.1) == 20  # 0.1 s / (0.1 x 0.05 s)
    assert pacer.typical == pytest.approx(2 + 0.2 * 18)
    assert pacer.moved() and not pacer.moved()  # worth a log line once
    assert not pacer.due(20) and pacer.due(21)
    assert pacer.finished(0.01) == 2 and not pacer.moved()  # one near partner: not
    assert pacer.finished(10.0) == 50  # a slow link: capped at `most`
    assert pacer.finished(0.001) == 2  # a fast one: never under `every`
    for _ in range(30):
        pacer.observe_step(0.5)  # a slower step: the same exchange weighs less
    assert pacer.finished(0.09) == 2  # 0.09 / (0.1 x ~0.5 s)
    with pytest.raises(ValueError):
        ExchangePacer(every=4, fraction=1.0)
    with pytest.raises(ValueError):
        ExchangePacer(every=4, fraction=0.1, most=3)


async def _train(algos, steps: int, step_s: float, first: int = 1) -> None:
    """`steps` local steps taking `step_s` virtual seconds each, on every runtime."""
    for number in range(first, first + steps):
        await trio.sleep(step_s)
        for algo in algos:
            algo.ctx.trainer.train_step()
            await algo.after_step(StepResult(step=number, loss=0.0, seconds=step_s))


@pytest.mark.parametrize("algorithm", ["adpsgd", "choco", "selsync"])
async def test_exchanges_space_out_when_the_link_slows_and_come_back_when_it_recovers(
    autojump_clock, algorithm
):
    settings = {
        "choco": {"algorithm_settings": {"choco": ChocoSettings(gamma=0.5)}, "codec": "topk:0.1"},
        "selsync": {"algorithm_settings": {"selsync": SelsyncSettings(threshold=1e-12)}},
    }.get(algorithm, {})
    config = {"algorithm": algorithm, "codec": "none", "exchange_every": 2,
              "comm_fraction": 0.25, "max_exchange_every": 400, **settings}  # fmt: skip
    async with runtimes(2, **config) as (net, (a, b)):
        # one exchange is one round trip (tensor work is inline: no virtual time)
        net.set_delay("p0", "p1", 0.01)  # 0.02 s: 0.02 / (0.25 x 0.01 s a step) = 8 steps
        await _train([a], 100, 0.01)
        await settle()
        pacer = a.pacer if algorithm != "selsync" else a.pairwise.pacer
        assert pacer.interval == 8
        assert a.statistics().exchange_interval == 8
        ok = a.counters.statistics().ok
        assert 10 <= ok <= 13  # about 100 / 8, the first at once
        net.set_delay("p0", "p1", 0.1)  # degraded: 0.2 s -> 80 steps
        await _train([a], 400, 0.01, first=101)
        await settle()
        assert pacer.interval == 80
        slow = a.counters.statistics().ok - ok
        assert 4 <= slow <= 7  # about 400 / 80 (and one at the old cadence)
        net.set_delay("p0", "p1", 0.01)  # recovered: back to 8 after one exchange
        await _train([a], 100, 0.01, first=501)
        await settle()
        assert pacer.interval == 8
        assert a.counters.statistics().ok - ok - slow >= 9
