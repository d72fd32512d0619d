# CHOCO-SGD's per-link bookkeeping, sans-I/O. Invariants: each link (this node, one neighbour)
# holds our public estimate as the neighbour knows it, the neighbour's, and a count of completed
# exchanges; both ends apply exactly the q's that went over the wire, so their copies stay equal;
# a link starts (and restarts) at the swarm's common initial model, or at zero (CHOCO's own
# start) when the two ends' initial models differ (`zero`); counts that differ mean an
# exchange was lost half-way, and both ends restart that link; at most `max_peers` links are kept
# (least recently used dropped first), a busy link is never dropped; links of peers no longer
# live are dropped. Pure bookkeeping: the caller does the I/O and hands in who is live.
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ._algorithms import choco_consensus
from ._robust import ClipRadius

Params = Mapping[str, torch.Tensor]
Verdict = Literal["ok", "busy", "resync"]


@dataclass
class ChocoLink:
    """One neighbour's link: `mine` (our estimate, as it holds it), `theirs`, and `seq`."""

    seq: int = 0
    mine: dict[str, torch.Tensor] = field(default_factory=dict)
    theirs: dict[str, torch.Tensor] = field(default_factory=dict)
    busy: bool = False
    # a streamed exchange the neighbour runs on this link: (its id, chunks begun, when it began,
    # chunks done); None when none runs. Chunks change the estimates as they come, so one left
    # unfinished means the two ends' copies may differ: the link then restarts (see `partial`).
    stream: tuple[int, set[int], float, set[int]] | None = None
    seen: float = 0.0  # when that stream's latest chunk came (a silent one is given up)
    partial: bool = False  # some chunk of an unfinished exchange changed the estimates
    # the two ends started from different models: the estimates start at zero, not at `base`
    zero: bool = False

    def reset(self, base: Params) -> None:
        """Back to the start, count 0 (both ends do this on a resync): the common initial model
        `base`, or zeros of its shapes on a `zero` link."""
        self.seq = 0
        start = torch.zeros_like if self.zero else torch.clone
        self.mine = {n: start(t) for n, t in base.items()}
        self.theirs = {n: start(t) for n, t in base.items()}
        self.stream, self.partial = None, False

    def add_slices(self, q_mine: Iterable[tuple[str, int, torch.Tensor]],
                   q_theirs: Iterable[tuple[str, int, torch.Tensor]]) -> None:  # fmt: skip
        """Add one chunk of both decoded q's to the estimates: (tensor name, first flat index,
        values) each. The exchange stays `partial` until `finish`."""
        self.partial = True
        with torch.no_grad():
            for target, parts in ((self.mine, q_mine), (self.theirs, q_theirs)):
                for name, start, values in parts:
                    flat = target[name].view(-1)
                    flat[start : start + values.numel()].add_(values.to(flat.dtype))

    def finish(self, live: dict[str, torch.Tensor], gamma: float,
               radius: ClipRadius | None = None) -> float:  # fmt: skip
        """Every chunk of the exchange is in: count it and take the consensus step
        x += gamma/2 (x_hat_j - x_hat) on `live` in place (its difference clipped by `radius`
        when given). Returns the step's distance."""
        self.seq += 1
        self.stream, self.partial = None, False
        return choco_consensus(live, self.mine, self.theirs, gamma=gamma, radius=radius)

    def judge(self, seq: int) -> Verdict:
        """Responder side: may an exchange that the peer counts as `seq` run on this link now?

        "busy" while another runs; "resync" when the counts differ (then reset both ends).
        """
        if self.busy:
            return "busy"
        return "ok" if seq == self.seq else "resync"


class ChocoLinks:
    """The links of one node.

    Args:
        base: the common initial model every link starts from (cloned per link).
        max_peers: most links kept.
    """

    def __init__(self, base: Params, max_peers: int) -> None:
        if max_peers < 1:
            raise ValueError(f"max_peers={max_peers}: expected >= 1")
        self.base = base
        self.max_peers = max_peers
        self._links: OrderedDict[str, ChocoLink] = OrderedDict()

    def __contains__(self, peer: object) -> bool:
        return peer in self._links

    def __getitem__(self, peer: str) -> ChocoLink:
        return self._links[peer]

    def __len__(self) -> int:
        return len(self._links)

    def values(self) -> list[ChocoLink]:
        """Every link kept now."""
        return list(self._links.values())

    def link(self, peer: str, live: Iterable[str]) -> ChocoLink:
        """The link to `peer` (made at the base model if new), marked most recently used; links
        of peers not in `live` and beyond `max_peers` are dropped unless busy."""
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = ChocoLink()
            link.reset(self.base)
        self._links.move_to_end(peer)
        keep = set(live) | {peer}
        for other in [p for p, x in self._links.items() if p not in keep and not x.busy]:
            del self._links[other]
        while len(self._links) > self.max_peers:
            oldest = next(p for p, x in self._links.items() if not x.busy or p == peer)
            del self._links[oldest]
        return link

    def zero_peers(self) -> list[str]:
        """The idle links that start from zero (see ChocoLink.zero), for a checkpoint."""
        return [peer for peer, link in self._links.items() if link.zero and not link.busy]

    def state_dict(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Tensors `<peer>/mine/<name>`, `<peer>/theirs/<name>` and counts of idle links (a busy
        one is half-way; after a restart the count check resyncs it anyway). `copy=False` hands
        out the estimates themselves (for a caller that holds off every change while it reads)."""
        tensors: dict[str, torch.Tensor] = {}
        seqs: dict[str, int] = {}
        for peer, link in list(self._links.items()):
            if link.busy:
                continue
            seqs[peer] = link.seq
            tensors.update({f"{peer}/mine/{n}": t.clone() if copy else t
                            for n, t in link.mine.items()})  # fmt: skip
            tensors.update({f"{peer}/theirs/{n}": t.clone() if copy else t
                            for n, t in link.theirs.items()})  # fmt: skip
        return tensors, seqs

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], seqs: Mapping[str, int],
                        device: torch.device, zero: Iterable[str] = ()) -> None:  # fmt: skip
        """Restore what `state_dict` returned (names as in `base`); `zero`: `zero_peers()`.

        Raises:
            KeyError: a tensor of a listed link is missing.
        """
        zero = set(zero)
        for peer, seq in seqs.items():
            link = ChocoLink(seq=int(seq), zero=peer in zero)
            for name in self.base:
                link.mine[name] = tensors[f"{peer}/mine/{name}"].to(device)
                link.theirs[name] = tensors[f"{peer}/theirs/{name}"].to(device)
            self._links[peer] = link
