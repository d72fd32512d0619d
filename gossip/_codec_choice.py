# Per-link compression choice. Invariants: the choice depends only on the link estimate, the
# payload's element count, the local step time and an injected size function; the ladder is
# ordered from least to most compression and the least compression that fits the time budget wins.
from __future__ import annotations

from collections.abc import Callable, Sequence

from ._errors import LocalProtocolError
from ._links import LinkEstimate

DEFAULT_LADDER: tuple[str, ...] = (
    "none",
    "fp16",
    "int8",
    "int4",
    "topk:0.1+int8",
    "topk:0.01+int8",
    "topk:0.001+int8",
)
"""Codec specs from least to most compression (spec strings of compress/)."""


LATENCY_SLACK = 1.1
"""When no spec fits the budget, a spec within this factor of the fastest one's time is as good."""


def choose_codec(
    estimate: LinkEstimate,
    numel: int,
    step_time_s: float,
    ladder: Sequence[str] = DEFAULT_LADDER,
    size_of: Callable[[str, int], int] | None = None,
    *,
    steps_per_exchange: float = 1.0,
) -> str:
    """The least compression whose exchange fits in the compute time it overlaps with.

    An exchange of `numel` elements under a spec is expected to take
    estimate.transfer_time(size_of(spec, numel)); the budget is step_time_s * steps_per_exchange
    (the local computation the exchange hides behind). Picking per link the first spec within
    budget makes an exchange cost about the same wall time on every link: fast links send more
    exactly, slow links compress harder. When nothing fits, the least compression whose time is
    within LATENCY_SLACK of the fastest spec's is returned (on a latency-bound link, compressing
    harder saves no time).

    Args:
        estimate: the link's current estimate.
        numel: elements in the payload.
        step_time_s: seconds of one local training step.
        ladder: specs from least to most compression.
        size_of: bytes a spec produces for numel elements; required (None is refused): node
            passes `lambda spec, n: compress.get_codec(spec).expected_nbytes(n)`.
        steps_per_exchange: local steps between two exchanges.

    Raises:
        LocalProtocolError: no size_of, an empty ladder, a negative numel or a non-positive time.
    """
    if size_of is None:
        raise LocalProtocolError("choose_codec needs size_of (compress's expected sizes)")
    if not ladder:
        raise LocalProtocolError("choose_codec needs a non-empty ladder")
    if numel < 0 or not step_time_s > 0 or not steps_per_exchange > 0:
        raise LocalProtocolError(
            f"choose_codec: numel={numel!r} step_time_s={step_time_s!r} "
            f"steps_per_exchange={steps_per_exchange!r}; expected numel >= 0 and positive times"
        )
    budget = step_time_s * steps_per_exchange
    times = [estimate.transfer_time(size_of(spec, numel)) for spec in ladder]
    for spec, seconds in zip(ladder, times, strict=True):
        if seconds <= budget:
            return spec
    # Nothing fits: compression only pays where bytes, not the round trip, cost the time. Take
    # the least compression within LATENCY_SLACK of the fastest spec, so a latency-bound link
    # (small model, long RTT) is not sent a needlessly lossy model.
    best = min(times)
    return next(s for s, t in zip(ladder, times, strict=True) if t <= best * LATENCY_SLACK)


def nominal_nbytes(spec: str, numel: int) -> int:
    """A rough wire size of a DEFAULT_LADDER spec, for tests and the simulator only.

    node/ passes compress's exact sizes to choose_codec instead; this model exists so that gossip
    needs no compress API: 4 bytes an element uncompressed, 2 for fp16, 1 for int8, 1/2 for int4,
    and for "topk:F+int8" F*numel elements at 1 value byte plus a 4-byte index, with 8 bytes of
    scale per message for the quantized specs.

    Raises:
        LocalProtocolError: a spec this model does not know.
    """
    per_element = {"none": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
    if spec in per_element:
        return int(per_element[spec] * numel) + (8 if spec.startswith("int") else 0)
    head, _, tail = spec.partition("+")
    if head.startswith("topk:") and tail == "int8":
        try:
            fraction = float(head[5:])
        except ValueError:
            raise LocalProtocolError(f"unknown spec {spec!r}") from None
        if 0 < fraction <= 1:
            return int(max(1, round(fraction * numel)) * 5) + 8
    raise LocalProtocolError(f"unknown spec {spec!r}")
