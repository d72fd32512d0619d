"""Robust mixing (gossip.robust): the adaptive clipping radius, self-centred clipping in a streamed
pairwise exchange, dpsgd's trimmed mean and its fallback, diloco's clipped outer average, the
config field and the counters status shows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import trio
from _runtimes import model, runtimes, step

from geotrain.gossip import (
    ClipRadius,
    clip_scale,
    clipped_neighbourhood_mix,
    robust_average,
    trim_count,
    trimmed_mean_mix,
)
from geotrain.gossip._robust import ROBUST_FADE
from geotrain.node import ConfigError, GossipConfig
from geotrain.node._config import ROBUST_RULES as CONFIG_RULES
from geotrain.node._config import config_from_toml


def _distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float(torch.sum((a[k] - b[k]) ** 2)) for k in a))


def test_the_radius_is_half_the_lower_quartile_of_recent_distances_and_counts_clips():
    radius = ClipRadius("clip", window=4)
    assert radius.radius(1.0) == pytest.approx(0.5)  # the first update: half its own distance
    assert radius.radius(3.0) == pytest.approx(0.75)  # lower quartile of (1, 3) is 1.5
    assert radius.radius(2.0) == pytest.approx(0.75)  # of (1, 2, 3)
    assert radius.radius(100.0) == pytest.approx(0.875)  # of (1, 2, 3, 100): 1.75
    assert radius.clipped == 4 and radius.mixed == 4
    # the window forgets 1.0; half of it far away still leaves tau an honest distance ...
    assert radius.radius(100.0) == pytest.approx(1.375)  # of (2, 3, 100, 100)
    # ... three quarters does not (the rule assumes fewer far-away updates than that)
    assert radius.radius(100.0) == pytest.approx(37.75)  # of (2, 100, 100, 100)
    assert radius.clipped == 6
    assert radius.statistics().robust_tau == pytest.approx(37.75)
    assert ClipRadius("clip", quantile=0.5, scale=2.0).radius(4.0) == pytest.approx(8.0)
    capped = ClipRadius("clip", cap=0.5)
    assert capped.radius(10.0) == 0.5 and capped.clipped == 1
    assert ClipRadius("none", cap=0.7).radius(10.0) == 0.7  # gossip.clip alone, as before
    assert ClipRadius("none").radius(10.0) is None
    with pytest.raises(ValueError, match="rule='median'"):
        ClipRadius("median")


def test_a_far_difference_pulls_less_the_farther_it_is_under_a_robust_rule():
    # plain clipping let every far update (a sign-flipping or IPM peer's) move us by a whole
    # tau, always toward where it points; beyond ROBUST_FADE tau its pull fades with distance
    pulls = [d * clip_scale(d, 1.0, 4.0) for d in (0.5, 2.0, 4.0, 8.0, 16.0, 64.0)]
    assert pulls == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.25, 1 / 16])  # tau^2 fade / d beyond
    assert [d * clip_scale(d, 1.0) for d in (0.5, 2.0, 64.0)] == pytest.approx([0.5, 1.0, 1.0])
    radius = ClipRadius("clip", window=4)
    for _ in range(3):
        radius.factor(2.0)  # honest distances of 2: tau = 1
    assert 64.0 * radius.factor(64.0) == pytest.approx(1 / 16) and radius.tau == 1.0
    assert radius.faded == 1 and radius.statistics().robust_faded == 1
    # gossip.clip alone (no robust rule) clips to its cap and never fades
    plain = ClipRadius("none", cap=1.0)
    assert [d * plain.factor(d) for d in (0.5, 8.0, 64.0)] == pytest.approx([0.5, 1.0, 1.0])
    assert plain.faded == 0
    with pytest.raises(ValueError, match="fade=0.5"):
        ClipRadius("clip", fade=0.5)


def test_a_node_pulled_by_a_far_attacker_drifts_less_than_plain_clipping_lets_it():
    # one node averaging with an honest peer near it and an attacker that always sends a model
    # far off in one direction: clipped, the attacker drags it by tau per exchange, steadily;
    # faded, by tau^2 fade / distance
    def drift(fade: float) -> float:
        radius = ClipRadius("clip", fade=fade)
        live = {"w": torch.zeros(8)}
        gen = torch.Generator().manual_seed(0)
        for i in range(64):
            sent = {"w": live["w"].clone()}
            if i % 4 == 3:  # a quarter of the exchanges with the attacker, 100 away
                remote = {"w": sent["w"] + torch.full((8,), 100 / math.sqrt(8))}
            else:
                remote = {"w": sent["w"] + torch.randn(8, generator=gen) * 0.5}
            clipped_neighbourhood_mix(live, sent, {"r": remote}, {"r": 0.5}, radius)
        return float(live["w"].mean())

    clipped, faded = drift(float("inf")), drift(4.0)
    assert clipped > 1.0  # the attack's steady pull (16 exchanges x 0.5 x tau, tau ~ 0.4)
    assert abs(faded) < 0.2 * clipped, (faded, clipped)


def test_a_clipped_neighbourhood_mix_moves_us_at_most_weight_times_tau():
    sent = {"w": torch.zeros(4)}
    honest = [{"w": torch.full((4,), 0.5)} for _ in range(3)]
    radius = ClipRadius("clip")
    live = {"w": torch.zeros(4)}
    for h in honest:  # three honest rounds fill the window with distance 1.0
        clipped_neighbourhood_mix(live, sent, {"h": h}, {"h": 0.0}, radius)
    live = {"w": torch.zeros(4)}
    attacker = {"w": torch.full((4,), -1000.0)}
    largest = clipped_neighbourhood_mix(live, sent, {"bad": attacker}, {"bad": 0.5}, radius)
    assert largest == pytest.approx(2000.0)
    tau = radius.tau
    assert tau == pytest.approx(0.5)  # half the lower quartile of (1, 1, 1, 2000)
    # at most weight x tau, and this far off (beyond ROBUST_FADE tau) faded to a sliver of it
    pull = float(torch.linalg.vector_norm(live["w"]))
    assert pull == pytest.approx(0.5 * tau * (ROBUST_FADE * tau / 2000.0)) and pull < 0.5 * tau
    assert radius.clipped == 4  # (honest updates longer than tau are shortened too)


def test_a_trimmed_mean_drops_the_extremes_of_every_coordinate():
    sent = {"w": torch.tensor([0.0, 0.0, 0.0])}
    remotes = {
        "a": {"w": torch.tensor([1.0, 1.0, 1.0])},
        "b": {"w": torch.tensor([2.0, 2.0, 2.0])},
        "bad": {"w": torch.tensor([1e6, -1e6, 3.0])},
    }
    live = {"w": torch.tensor([0.1, 0.1, 0.1])}  # moved on since the round's snapshot
    assert trim_count(4) == 1 and trim_count(5) == 2 and trim_count(3) == 0
    assert trimmed_mean_mix(live, sent, remotes) == 1
    # per coordinate, (0, 1, 2, +-1e6 or 3) minus its extremes: the mean of the two middle values
    assert torch.allclose(live["w"], torch.tensor([1.5, 0.5, 1.5]) + 0.1)
    with pytest.raises(ValueError, match="trimmed mean needs 3"):
        trimmed_mean_mix(live, sent, {"a": remotes["a"]})


def test_robust_average_clips_pseudo_gradients_around_ours_and_trims_with_enough():
    own = {"w": torch.zeros(2)}
    others = [{"w": torch.ones(2)}, {"w": torch.ones(2)}, {"w": torch.full((2,), 1e4)}]
    radius = ClipRadius("clip")
    plain = robust_average(own, others, "none", radius)
    clipped = robust_average(own, others, "clip", radius)
    assert float(plain["w"][0]) > 2000
    assert float(clipped["w"][0]) < 2.0 and radius.clipped >= 1
    trim = ClipRadius("trim")
    trimmed = robust_average(own, others, "trim", trim)
    assert torch.allclose(trimmed["w"], torch.ones(2)) and trim.trimmed_rounds == 1
    assert torch.equal(own["w"], torch.zeros(2))  # inputs untouched
    robust_average(own, others[:1], "trim", trim)
    assert trim.trim_fallbacks == 1


def _scale_model(algo, factor: float) -> None:
    algo.ctx.trainer.update(lambda live: [t.mul_(factor) for t in live.values()])


def _shift_model(algo, by: float) -> None:
    algo.ctx.trainer.update(lambda live: [t.add_(by) for t in live.values()])


@pytest.mark.parametrize("chunk_numel", [None, 8])
async def test_a_pairwise_exchange_clips_a_far_peer_by_the_full_difference(
    autojump_clock, chunk_numel
):
    # With chunks of 8 elements the 33-parameter model streams in 5 chunks: the radius is applied
    # to the norm of the whole difference (summed over the chunks before anything is mixed), so
    # the result is the same as one whole message.
    async with runtimes(3, algorithm="adpsgd", codec="none", robust="clip",
                        chunk_numel=chunk_numel) as (net, (a, b, c)):  # fmt: skip
        b.ctx.peers._membership.peers = ["p0"]
        c.ctx.peers._membership.peers = ["p0"]
        a.ctx.trainer.train_step()
        for _ in range(3):  # honest exchanges set the radius
            b.ctx.trainer.train_step()
            assert await b.exchange_once()
        _shift_model(c, 2.0)  # a model far away (still within max_norm_ratio)
        before, theirs = model(a), model(c)
        clipped = a.ctx.robust.clipped
        assert await c.exchange_once()
        moved = _distance(model(a), before)
        assert a.ctx.robust.clipped == clipped + 1 and a.ctx.robust.mixed == 4
        # moved by half of tau (weight 0.5), faded as far beyond tau as the peer is, and tau
        # is still an honest distance's scale
        tau, far = a.ctx.robust.tau, _distance(theirs, before)
        assert moved == pytest.approx(0.5 * tau * min(1.0, ROBUST_FADE * tau / far), rel=1e-4)
        assert a.ctx.robust.tau < 0.3 * _distance(theirs, before)
        assert a.status_counters()["robust_clipped"] == a.ctx.robust.clipped


async def test_without_robust_mixing_the_same_peer_moves_us_half_way(autojump_clock):
    async with runtimes(2, algorithm="adpsgd", codec="none") as (net, (a, c)):
        a.ctx.trainer.train_step()
        _shift_model(c, 1.0)
        before, theirs = model(a), model(c)
        assert await c.exchange_once()
        assert _distance(model(a), before) == pytest.approx(0.5 * _distance(theirs, before))
        assert "robust_clipped" not in a.status_counters()  # robust = none: status unchanged


async def test_dpsgd_trims_an_outlier_and_falls_back_to_clipping_with_few_neighbours(
    autojump_clock,
):
    gossip = {"algorithm": "dpsgd", "codec": "none", "exchange_every": 1, "robust": "trim"}
    async with runtimes(5, **gossip) as (net, algos):
        for algo in algos[1:4]:
            algo.ctx.trainer.train_step()
        _scale_model(algos[4], 8.0)
        honest_before = [model(x) for x in algos[:4]]
        async with trio.open_nursery() as nursery:
            for algo in algos:
                nursery.start_soon(algo.after_step, step(algo, 1))
        a = algos[0]
        assert a.ctx.robust.trimmed_rounds == 1 and a.status_counters()["robust_trimmed_rounds"]
        # every coordinate of a's new model lies within the honest models' range
        for k in honest_before[0]:
            low = torch.stack([m[k] for m in honest_before]).min(dim=0).values
            high = torch.stack([m[k] for m in honest_before]).max(dim=0).values
            assert bool(((model(a)[k] >= low - 1e-6) & (model(a)[k] <= high + 1e-6)).all())
    async with runtimes(2, **gossip) as (net, (a, b)):
        async with trio.open_nursery() as nursery:
            for algo in (a, b):
                nursery.start_soon(algo.after_step, step(algo, 1))
        assert a.ctx.robust.trim_fallbacks == 1 and a.ctx.robust.mixed == 1


def test_gossip_robust_is_validated_and_defaults_to_none():
    assert GossipConfig().robust == "none"
    assert CONFIG_RULES == ("none", "clip", "trim")
    base, ident = Path("."), '[identity]\nopen_swarm = true\n'
    with pytest.raises(ConfigError, match=r"gossip.robust = 'median': expected 'none' or 'clip'"):
        config_from_toml(ident + '[gossip]\nrobust = "median"\n', base=base)
    config = config_from_toml(ident + '[gossip]\nrobust = "trim"\n', base=base)
    assert config.gossip.robust == "trim"


async def test_choco_clips_the_estimates_difference_but_keeps_the_estimates_exact(autojump_clock):
    from geotrain.node.algorithms.choco import ChocoSettings

    gossip = {"algorithm": "choco", "codec": "none", "max_norm_ratio": 100.0, "robust": "clip",
              "algorithm_settings": {"choco": ChocoSettings(gamma=0.5)}}  # fmt: skip
    async with runtimes(2, **gossip) as (net, (a, b)):
        a.ctx.trainer.train_step()
        for _ in range(4):  # earlier, honest exchanges set a small radius
            a.ctx.robust.radius(0.01)
        _shift_model(b, 1.0)
        xa, xb = model(a), model(b)
        clipped = a.ctx.robust.clipped
        await a._exchange("p1")
        link_a, link_b = a._link("p1"), b._link("p0")
        assert all(torch.equal(link_a.mine[k], link_b.theirs[k]) for k in xa)  # still exact
        moved = _distance(model(a), xa)
        assert a.ctx.robust.clipped == clipped + 1
        assert 0 < moved <= 0.25 * a.ctx.robust.tau * (1 + 1e-4)  # gamma/2 x tau at most
        assert a.ctx.robust.faded == 1  # (100 radii away: faded)
        assert moved < 0.1 * 0.25 * _distance(xb, xa)  # unclipped it would be gamma/2 x that


async def test_diloco_clips_a_far_partners_pseudo_gradient_around_ours(autojump_clock):
    from geotrain.node.algorithms.diloco import DilocoSettings

    gossip = {"algorithm": "diloco", "codec": "none", "robust": "clip",
              "algorithm_settings": {"diloco": DilocoSettings(inner_steps=2)}}  # fmt: skip
    async with runtimes(2, **gossip) as (net, (a, b)):
        for _ in range(2):
            b.ctx.trainer.train_step()
        _shift_model(b, 0.5)  # b's update is far from anything a would do
        await b.after_step(step(b, 2))
        for _ in range(2):
            a.ctx.trainer.train_step()
        a.ctx.robust.radius(1e-3)  # earlier rounds: small distances
        clipped = a.ctx.robust.clipped
        await a.after_step(step(a, 2))
        assert a.statistics().peer_deltas_used == 1 and a.ctx.robust.clipped == clipped + 1
        assert a.status_counters()["robust_clipped"] == clipped + 1
