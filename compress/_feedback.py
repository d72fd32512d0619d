# Invariants: after encode(t, name=n), residual[n] == (t + old residual[n]) - decode(payload)
# exactly as the receiver decodes it, so what was sent plus the residual always sums to what was
# fed in (mass conservation; exactly with float32 residuals, up to the residual's own rounding with
# a half-precision `dtype`). Residuals live on the input's device and are only changed by encode,
# load_state_dict and reset.
"""Error feedback: keep what a lossy codec dropped and add it to the next input (EF-SGD)."""

from __future__ import annotations

import torch

from ._base import Codec, CodecState, decode


class ErrorFeedback:
    """Wrap a codec with per-name residuals (error feedback / error compensation).

    The residuals are the state: save them with `state_dict()` for checkpoints, restore with
    `load_state_dict()`, drop them with `reset()`.

    Args:
        codec: the default codec.
        dtype: how residuals are stored: float32 (exact), or float16 / bfloat16 to hold half the
            memory (a residual is small next to the values it corrects; its rounding error is
            about 1e-3 of itself in float16).
    """

    def __init__(self, codec: Codec, *, dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"ErrorFeedback(codec={codec!r}): expected a Codec")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"ErrorFeedback(dtype={dtype}): expected float32, float16, bfloat16")
        self.codec = codec
        self.dtype = dtype
        self._residuals: dict[str, torch.Tensor] = {}

    def encode(
        self,
        t: torch.Tensor,
        *,
        name: str = "",
        seed: int = 0,
        codec: Codec | None = None,
        state: CodecState | None = None,
    ) -> bytes:
        """Encode `t` plus the residual kept under `name`; keep the new residual.

        Args:
            t: the tensor to send (not modified).
            name: key of the residual (one per tensor of a model).
            seed: passed to the codec.
            codec: use this codec instead of `self.codec` (e.g. a per-link choice).
            state: passed to stateful codecs.

        Returns:
            The payload, as `Codec.encode` returns it.
        """
        corrected = t.detach().float()
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.shape != corrected.shape:
                raise ValueError(
                    f"ErrorFeedback residual {name!r} has shape "
                    f"{tuple(residual.shape)}, input has {tuple(corrected.shape)}"
                )
            corrected = corrected + residual
        data = (codec or self.codec).encode(corrected, seed=seed, state=state, name=name)
        sent = decode(data, max_numel=corrected.numel(), device=corrected.device)
        if residual is not None and residual.dtype == self.dtype:
            residual.copy_(corrected.sub_(sent.float()))  # in place: the old residual is reused
        else:
            self._residuals[name] = (corrected - sent.float()).to(self.dtype)
        return data

    def residual(self, name: str = "") -> torch.Tensor | None:
        """The residual kept for `name` (a view; do not modify), or None."""
        return self._residuals.get(name)

    def residual_norm(self) -> float:
        """L2 norm of all residuals together."""
        squares = [float(torch.linalg.vector_norm(r)) ** 2 for r in self._residuals.values()]
        return sum(squares) ** 0.5

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the residuals by name."""
        # list() first: a residual may be added from another thread meanwhile
        return {name: r.clone() for name, r in list(self._residuals.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace all residuals with copies of `state`'s tensors."""
        for name, r in state.items():
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                raise ValueError(
                    f"ErrorFeedback state {name!r}: expected a float tensor, got {type(r).__name__}"
                )
        self._residuals = {name: r.detach().to(self.dtype).clone() for name, r in state.items()}

    def reset(self) -> None:
        """Forget all residuals."""
        self._residuals.clear()
