"""Per-link codec choice: the least compression that fits, so exchanges cost the same time."""

from __future__ import annotations

import pytest

from geotrain.gossip._codec_choice import DEFAULT_LADDER, choose_codec, nominal_nbytes
from geotrain.gossip._errors import LocalProtocolError
from geotrain.gossip._links import LinkEstimate


def _link(rtt_s: float, gbit: float) -> LinkEstimate:
    return LinkEstimate(rtt_s, rtt_s / 4, gbit * 1e9 / 8, 1.0, 0, True, True)


NUMEL = 25_000_000  # a 25M-parameter model: 100 MB uncompressed
# Not compress's real sizes (node injects those): the rough model gossip ships for tests and sim.
SIZE = nominal_nbytes


def test_fast_links_send_more_exactly_than_slow_ones():
    fast = choose_codec(_link(0.02, 2.0), NUMEL, step_time_s=1.0, size_of=SIZE)
    slow = choose_codec(_link(0.46, 0.364), NUMEL, step_time_s=1.0, size_of=SIZE)
    home = choose_codec(_link(0.10, 0.02), NUMEL, step_time_s=1.0, size_of=SIZE)
    ranks = [DEFAULT_LADDER.index(spec) for spec in (fast, slow, home)]
    assert ranks == sorted(ranks) and ranks[0] < ranks[1] < ranks[2]
    assert fast == "none"  # 100 MB at 2 Gbit/s = 0.4 s fits a 1 s step


def test_the_chosen_exchange_fits_the_budget_on_every_link():
    links = [_link(0.02, 2.0), _link(0.134, 0.79), _link(0.19, 0.523), _link(0.46, 0.364)]
    for step in (0.5, 1.0, 4.0):
        for link in links:
            spec = choose_codec(link, NUMEL, step_time_s=step, size_of=SIZE)
            assert link.transfer_time(SIZE(spec, NUMEL)) <= step
            harder = DEFAULT_LADDER.index(spec)
            if harder > 0:  # one step less compression would not have fit
                lighter = DEFAULT_LADDER[harder - 1]
                assert link.transfer_time(SIZE(lighter, NUMEL)) > step


def test_more_steps_per_exchange_allow_less_compression():
    link = _link(0.19, 0.523)
    every_step = choose_codec(link, NUMEL, 0.5, size_of=SIZE)
    every_8 = choose_codec(link, NUMEL, 0.5, size_of=SIZE, steps_per_exchange=8)
    assert DEFAULT_LADDER.index(every_8) < DEFAULT_LADDER.index(every_step)


def test_when_bytes_dominate_and_nothing_fits_the_hardest_spec_is_used():
    home = _link(0.05, 0.01)  # 10 Mbit/s: even the hardest spec of 25M elements takes > 0.5 s
    assert choose_codec(home, NUMEL, 0.5, size_of=SIZE) == DEFAULT_LADDER[-1]


def test_when_the_round_trip_dominates_compression_is_not_wasted():
    latency_bound = _link(2.0, 1.0)  # the RTT alone exceeds the step time
    small = 5_000  # a small model: 20 kB uncompressed, 16 us at 1 Gbit/s
    assert choose_codec(latency_bound, small, 0.5, size_of=SIZE) == "none"
    # A big model on the same link is bandwidth-bound again: compressing harder saves time.
    assert choose_codec(latency_bound, NUMEL, 0.5, size_of=SIZE) != "none"


def test_the_size_function_is_injected():
    calls = []

    def size_of(spec: str, numel: int) -> int:
        calls.append(spec)
        return 1

    assert choose_codec(_link(0.01, 1.0), 10, 1.0, ("a", "b"), size_of=size_of) == "a"
    assert set(calls) <= {"a", "b"} and "a" in calls


def test_nominal_sizes_shrink_down_the_ladder():
    sizes = [nominal_nbytes(spec, NUMEL) for spec in DEFAULT_LADDER]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 4 * NUMEL
    with pytest.raises(LocalProtocolError):
        nominal_nbytes("zstd", 10)


def test_the_contract_signature_works_positionally():
    spec = choose_codec(_link(0.02, 2.0), NUMEL, 1.0, DEFAULT_LADDER, nominal_nbytes)
    assert spec == "none"


def test_misuse_is_a_local_error():
    with pytest.raises(LocalProtocolError):
        choose_codec(_link(0.01, 1.0), 10, 1.0)  # the size function must be injected
    with pytest.raises(LocalProtocolError):
        choose_codec(_link(0.01, 1.0), 10, 1.0, (), size_of=nominal_nbytes)
    with pytest.raises(LocalProtocolError):
        choose_codec(_link(0.01, 1.0), 10, 0.0, size_of=nominal_nbytes)
