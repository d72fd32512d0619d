# What one rank of a site exchanges with the same rank of a partner site. Invariants: every
# trainable value of the site's model belongs to exactly one rank's share; a share is views into
# the live parameters (a mix writes the model itself, nothing is copied); a replicated model
# (DistributedDataParallel: every rank holds all of it) is cut into N contiguous ranges of its
# flattened trainable parameters, in named_parameters order; a sharded model (FSDP2's
# fully_shard) shares the rank's own local shards; a share's names carry the layout and the rank
# count, so a partner site of another layout or rank count refuses it as another model's.
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import structlog
import torch

from ..training import LoopTrainer

log = structlog.get_logger()

REPLICATED = "ddp"  # DistributedDataParallel: each rank holds the whole model
SHARDED = "fsdp"  # FSDP2 (fully_shard): each rank holds its shard of each parameter


def site_module(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The module a site's rank joins with, and its layout (REPLICATED or SHARDED).

    Raises:
        ValueError: a model that is neither DDP-wrapped nor fully_shard-ed (FSDP1's
            FullyShardedDataParallel is refused too: its flat parameters are not per tensor).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, REPLICATED
    with_fsdp1 = getattr(torch.distributed, "fsdp", None)
    fsdp1 = getattr(with_fsdp1, "FullyShardedDataParallel", None) if with_fsdp1 else None
    if fsdp1 is not None and isinstance(model, fsdp1):
        raise ValueError(f"model {type(model).__name__}: FSDP1 (FullyShardedDataParallel) is not "
                         "supported in a site; shard it with FSDP2 instead "
                         "(torch.distributed.fsdp.fully_shard)")  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and all(_is_dtensor(p) for p in trainable):
        return model, SHARDED
    raise ValueError(f"model {type(model).__name__}: under torchrun (a site of several ranks) "
                     "join with the model wrapped in DistributedDataParallel, or sharded with "
                     "fully_shard (FSDP2), after wrapping it")  # fmt: skip


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, not a copy); any other tensor as it is."""
    return t.to_local() if _is_dtensor(t) else t


def share_views(model: torch.nn.Module, layout: str, rank: int,
                world: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Rank `rank`'s share of `model`'s trainable parameters, as views, by name.

    A replicated model's shares are the ranges [r*S, (r+1)*S) of its flattened trainable
    parameters (S = ceil(total / world)), named "ddp:RofN/<param>[a:b]" (1-D views); a sharded
    model's are its local shards, named "fsdp:RofN/<param>" (the shard's shape; empty shards
    are left out).

    Raises:
        ValueError: a replicated parameter that is not contiguous (no flat view of it).
    """
    prefix = f"{layout}:{rank}of{world}/"
    out: dict[str, torch.Tensor] = {}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if layout == SHARDED:
        for name, p in trainable:
            local = _local(p.data)
            if local.numel():
                out[prefix + name] = local
        return out
    total = sum(p.numel() for _, p in trainable)
    size = math.ceil(total / world)
    lo, hi = rank * size, min(total, (rank + 1) * size)
    offset = 0
    for name, p in trainable:
        a, b = offset, offset + p.numel()
        offset = b
        start, stop = max(a, lo), min(b, hi)
        if start >= stop:
            continue
        if not p.data.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous: a site cuts the model "
                             "into flat ranges of its parameters")  # fmt: skip
        out[f"{prefix}{name}[{start - a}:{stop - a}]"] = p.data.view(-1)[start - a : stop - a]
    return out


class SiteTrainer(LoopTrainer):
    """The node's trainer for one rank of a site: the user's loop and model (the DDP module's
    inner one, or the fully_shard-ed one), exchanging only this rank's share.

    Args:
        model: the module inside DDP, or the fully_shard-ed model.
        layout: REPLICATED or SHARDED; rank, world: this rank and the site's rank count.
        evaluate, metric, higher_is_better: as LoopTrainer's (rank 0's only: see join).
    """

    def __init__(self, model: torch.nn.Module, layout: str, rank: int, world: int,
                 evaluate: Callable[[torch.nn.Module], float] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(model, evaluate, **kwargs)
        self.layout, self.rank, self.world = layout, rank, world
        # every rank's share, as views into this rank's copy (a replicated model: the site
        # sync sends each to the other ranks); a sharded model holds only its own
        ranks = range(world) if layout == REPLICATED else [rank]
        self.shares = {r: share_views(model, layout, r, world) for r in ranks}
        if not self.shares[rank]:
            raise ValueError(f"rank {rank} of {world}: its share of the model is empty (a "
                             "model smaller than the site's rank count)")  # fmt: skip
        self._changed = False  # a change of this rank's share since the last site sync

    def params(self) -> dict[str, torch.Tensor]:
        """This rank's share (views into the live parameters): what is exchanged and synced."""
        return dict(self.shares[self.rank])

    def describe(self) -> str:
        share = self.shares[self.rank]
        numel = sum(t.numel() for t in share.values())
        return (f"rank {self.rank}'s share of a site of {self.world} ranks ({self.layout}): "
                f"{len(share)} tensors, {numel:,} parameters")  # fmt: skip

    def apply(self, fn: Callable[[dict[str, torch.Tensor]], Any], *, changes: bool = True) -> Any:
        """As LoopTrainer's; a change is remembered for the next site sync."""
        if not changes:
            return super().apply(fn, changes=changes)

        def changing(params: dict[str, torch.Tensor]) -> Any:
            self._changed = True
            return fn(params)

        return super().apply(changing, changes=changes)

    def fetch_optimizer_at_wrap(self, fetch: Callable[[], None]) -> None:
        """A site takes no optimizer state from a peer: each lane would take it from its own
        partner site, and a DDP site's ranks would then step with different optimizer states."""
        log.info("optimizer_state_not_fetched", detail="a site's ranks start their optimizer "
                 "fresh after state sync (the model is the swarm's)")  # fmt: skip

    def take_changed(self) -> bool:
        """Whether this rank's share changed (a mix, a state sync) since the last call."""
        changed, self._changed = self._changed, False
        return changed

    def write_share(self, owner: int, flat: torch.Tensor) -> None:
        """Put rank `owner`'s share, `flat` (its tensors one after another), into this rank's
        copy, under the trainer's locks (a checkpoint sees the model whole)."""
        with self._lock, self._writing, torch.no_grad():
            offset = 0
            for view in self.shares[owner].values():
                view.copy_(flat[offset : offset + view.numel()].view_as(view))
                offset += view.numel()

    def read_share(self) -> torch.Tensor:
        """This rank's share as one flat tensor (a copy)."""
        with self._writing, torch.no_grad():
            return torch.cat([v.reshape(-1) for v in self.shares[self.rank].values()])

    def share_numel(self, owner: int) -> int:
        return sum(v.numel() for v in self.shares[owner].values())

    def state_tensors(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """As LoopTrainer's; a sharded model's tensors are this rank's local shards."""
        tensors, meta = super().state_tensors(copy=False)
        if self.layout == SHARDED:
            tensors = {k: _local(v) for k, v in tensors.items()}
        if copy:
            tensors = {k: v.clone() for k, v in tensors.items()}
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict, step: int) -> None:
        """As LoopTrainer's; a sharded model's checkpoint holds this rank's local shards, copied
        into them."""
        if self.layout != SHARDED:
            super().restore(tensors, meta, step)
            return
        own = self.model.state_dict(keep_vars=True)
        with self._lock, self._writing, torch.no_grad():
            for name, live in own.items():
                saved = tensors.get(f"model/{name}")
                target = _local(live.data)
                if saved is None or tuple(saved.shape) != tuple(target.shape):
                    raise RuntimeError(f"the checkpoint's model is not this rank's shard: "
                                       f"{name!r} is missing or of another shape")  # fmt: skip
                target.copy_(saved.to(target.device))
            self.step = step
            self._scheduler_state = meta.get("scheduler")
        if "optimizer" in meta:
            log.warning("optimizer_not_resumed", step=step, detail="a sharded (FSDP2) site "
                        "resumes its model shards, not its optimizer state: the optimizer "
                        "starts fresh")  # fmt: skip
