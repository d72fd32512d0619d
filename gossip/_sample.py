# A model's values kept to measure later how far it has moved (selsync's reference). Invariants:
# within `budget` elements every value is kept and the distance is exact; beyond it, every tensor
# of more than WHOLE_UP_TO elements keeps an evenly strided sample from a random offset (each of
# its elements equally likely to be in it), smaller tensors stay whole, and the squared distance
# is the sum of each part weighted by its stride: an unbiased estimate. A stride shares no factor
# with the tensor's row length, so the sample visits every column, not the same few. Values are
# float32 whatever the model's dtype. Pure tensor arithmetic; the offsets come from an injected
# random.Random.
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import torch

from ._averaging import Params, distance_squared, params_norm

WHOLE_UP_TO = 4096  # elements: a tensor this small (a bias, a norm's scale) is kept whole


class ModelSample:
    """The values of a model at one moment, whole or sampled to fit `budget` elements.

    Args:
        shapes: the model's tensor names and shapes.
        budget: the most elements to keep (about; tensors of at most WHOLE_UP_TO elements are
            kept whole in any case). A model that fits is kept whole and measured exactly.
        rng: draws each sampled tensor's offset.
    """

    def __init__(
        self, shapes: Mapping[str, Sequence[int]], budget: int, rng: random.Random
    ) -> None:
        if budget < 1:
            raise ValueError(f"budget={budget}: expected >= 1 element")
        sizes = {name: math.prod(shape) for name, shape in sorted(shapes.items())}
        total = sum(sizes.values())
        whole = sum(n for n in sizes.values() if n <= WHOLE_UP_TO)
        stride = 1 if total <= budget else math.ceil((total - whole) / max(1, budget - whole))
        self.layout: dict[str, tuple[int, int]] = {}  # name -> (offset, stride)
        for name, n in sizes.items():
            if stride == 1 or n <= WHOLE_UP_TO:
                self.layout[name] = (0, 1)
                continue
            shape = shapes[name]
            row = n // shape[0] if len(shape) > 1 and shape[0] else 1
            s = stride
            while math.gcd(s, row) != 1:
                s += 1
            self.layout[name] = (rng.randrange(s), s)
        self.shapes = {name: tuple(int(d) for d in shapes[name]) for name in sizes}
        self.values: dict[str, torch.Tensor] = {}  # name -> (sampled elements,) float32

    @property
    def exact(self) -> bool:
        """Whether every value is kept (the distance is then exact)."""
        return all(stride == 1 for _, stride in self.layout.values())

    @property
    def numel(self) -> int:
        """Elements kept."""
        return sum(t.numel() for t in self.values.values())

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        offset, stride = self.layout[name]
        flat = tensor.detach().reshape(-1)
        return flat if stride == 1 else flat[offset::stride]

    def take(self, live: Params) -> None:
        """Keep `live`'s values now (in the buffers of the last take: no new copy)."""
        for name in self.layout:
            part = self._part(name, live[name])
            kept = self.values.get(name)
            if kept is None or kept.numel() != part.numel() or kept.device != part.device:
                kept = self.values[name] = torch.empty(part.numel(), device=part.device)
            kept.copy_(part)

    def distance(self, live: Params) -> float:
        """||live - the kept model|| (L2 over every tensor): exact when every value is kept,
        else estimated from the sample (unbiased in its square)."""
        total = 0.0
        for name, (_, stride) in self.layout.items():
            total += stride * distance_squared(self._part(name, live[name]), self.values[name])
        return math.sqrt(total)

    def relative_change(self, live: Params) -> float:
        """||live - the kept model|| / ||live|| (selsync's significance measure; the norm of
        `live` is exact; inf for a zero model)."""
        norm = params_norm(live)
        return self.distance(live) / norm if norm > 0 else math.inf

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """The kept values (not copies) and the layout (name -> [offset, stride])."""
        return dict(self.values), {n: [o, s] for n, (o, s) in self.layout.items()}

    def load(self, values: Mapping[str, torch.Tensor], layout: Mapping | None) -> list[str]:
        """Take back what `state` gave, with its layout; a tensor saved whole (an older
        checkpoint, or a whole-kept one under another budget) is sampled here. What does not
        fit this model is skipped.

        Returns:
            The names taken back.
        """
        taken = []
        for name, t in values.items():
            kept = self.values.get(name)
            if name not in self.layout or kept is None:
                continue
            saved = tuple((layout or {}).get(name) or ())
            if saved == self.layout[name] and t.numel() == kept.numel():
                kept.copy_(t.reshape(-1))
            elif t.numel() == math.prod(self.shapes[name]):
                kept.copy_(self._part(name, t))
            else:
                continue
            taken.append(name)
        return taken
