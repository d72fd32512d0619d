# The one owner of torch device placement. Invariant: every tensor a node trains, encodes or mixes
# lives on the device resolved here once at start-up; nothing else picks a device.
from __future__ import annotations

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str) -> torch.device:
    """Turn a config's device string into a torch device that exists on this machine.

    Args:
        spec: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".

    Raises:
        ValueError: an unknown spec, or CUDA asked for where there is none (the message says which).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = spec.partition(":")[2]
        if index and not index.isdigit():
            raise ValueError(f"device {spec!r}: expected {DEVICE_CHOICES}")
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: this machine has no usable CUDA device")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
        return torch.device(spec)
    raise ValueError(f"device {spec!r}: expected {DEVICE_CHOICES}")
