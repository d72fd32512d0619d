# The node's memory budget. Invariants: the estimate is made from the model's size alone, before
# training starts, in model copies: the plain training loop (weights, gradients, optimizer state),
# what the algorithm keeps (its spec says), and a fixed runtime share; a config whose estimate
# exceeds limits.memory_gb is refused with the figures, never discovered by the OOM killer later.
from __future__ import annotations

import dataclasses
import os
import resource
import sys
from dataclasses import dataclass

import torch

from ._config import ConfigError, NodeConfig
from .algorithms import AlgorithmSpec, window_chunks
from .training import Trainer

RUNTIME_GB = 0.5  # interpreter, torch, transport buffers: a small node's RSS on this kind of box
# Chunks of a stream in flight each hold a few buffers at once (read, encoded, encrypted, received,
# decoded, the difference): about this many chunk sizes per chunk in flight.
BUFFERS_PER_CHUNK = 8
OPTIMIZER_COPIES = {"sgd": 1.0, "adam": 2.0, "adamw": 2.0}  # momentum; first and second moments
# a loop of the user's own: its optimizer is known only at wrap(); until then, Adam's two moments
LOOP_OPTIMIZER = "adam"


class MemoryBudgetError(ConfigError):
    """The node would need more memory than limits.memory_gb allows; the message has the figures."""


@dataclass(frozen=True)
class MemoryEstimate:
    model_gb: float  # the model's parameters that train (those frozen at join: frozen_gb)
    plain_copies: float  # weights + gradients + optimizer state
    algorithm: str
    algorithm_copies: float | None  # None: the algorithm states none
    buffers_gb: float = 0.0  # chunks of model streams in flight
    runtime_gb: float = RUNTIME_GB
    numel: int = 0  # the model's parameters (what an algorithm's fit is told)
    frozen_gb: float = 0.0  # parameters frozen at join: one copy, never averaged
    optimizer: str = ""  # whose state plain_copies counts (explain() says it)

    @property
    def copies(self) -> float:
        return self.plain_copies + (self.algorithm_copies or 0.0)

    @property
    def total_gb(self) -> float:
        return self.model_gb * self.copies + self.frozen_gb + self.buffers_gb + self.runtime_gb

    def explain(self) -> str:
        extra = "?" if self.algorithm_copies is None else f"{self.algorithm_copies:g}"
        return (
            f"model {self.model_gb:.3g} GB x ({self.plain_copies:g} plain training loop + {extra} "
            f"{self.algorithm}) + "
            + (f"{self.frozen_gb:.3g} GB frozen + " if self.frozen_gb else "")
            + f"{self.buffers_gb:.2g} GB chunks in flight + "
            f"{self.runtime_gb:g} GB runtime = {self.total_gb:.3g} GB"
            + (f"; the plain loop: weights, gradients, {self.optimizer}" if self.optimizer else "")
        )


def estimate_memory(
    config: NodeConfig, trainer: Trainer, spec: AlgorithmSpec, optimizer: str | None = None,
    *, state_copies: float | None = None, described: str = "",
) -> MemoryEstimate:
    """The node's memory need for this model, optimizer and algorithm (`optimizer`: the one a
    user's own loop brings, when the config's does not apply; Adam's two moments if unknown;
    `state_copies` and `described`: a user's optimizer measured by optimizer_state_copies;
    `described` alone: a note on the named optimizer's part, e.g. that it is a guess)."""
    params = trainer.params().values()
    numel = sum(p.numel() for p in params)
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = optimizer or config.training.optimizer or "sgd"
    if state_copies is None:  # (the one the node makes: torch's defaults for this model)
        copies = OPTIMIZER_COPIES.get(optimizer, 2.0)
        step = adam_step_copies(list(params)) if optimizer in ("adam", "adamw") else 0.0
        described = _described(optimizer, copies, step) + (f", {described}" if described else "")
        copies += step
    else:
        copies = state_copies
        described = described or f"{optimizer}'s state ({copies:g})"
    extra = spec.memory(config.gossip, numel) if spec.memory is not None else None
    # a peer's chunks may be up to network.peer_chunk_mb (at least our own chunk_mb)
    chunk_bytes = min(model_bytes, config.network.max_chunk_numel * 4)
    buffers = window_chunks(chunk_bytes, model_bytes) * BUFFERS_PER_CHUNK * chunk_bytes
    return MemoryEstimate(
        model_bytes / 1e9, 2.0 + copies, spec.name, extra,
        buffers / 1e9, numel=numel, frozen_gb=trainer.frozen_bytes / 1e9, optimizer=described,
    )  # fmt: skip


def adam_step_copies(params: list[torch.Tensor], foreach: bool | None = None,
                     fused: bool | None = None) -> float:  # fmt: skip
    """Model copies an Adam or AdamW step allocates for a moment, beyond its state (measured on
    torch 2.13's CPU build, /proc peaks of a plain loop): the one-tensor-at-a-time
    implementation (torch's default on CPU) two temporaries of each tensor in turn, so twice
    the largest tensor (a 10^8 model of one 10k x 10k layer peaked at 5.95 copies with AdamW,
    against the 4 counted); foreach (the default on CUDA) one temporary of every tensor at
    once, a whole copy; fused none."""
    numel = sum(p.numel() for p in params)
    if not numel or fused:
        return 0.0
    if foreach is None:  # (torch's own choice: foreach where every tensor is on CUDA or XPU)
        foreach = all(p.device.type in ("cuda", "xpu") for p in params)
    return 1.0 if foreach else 2 * max(p.numel() for p in params) / numel


def _described(name: str, state: float, step: float) -> str:
    """How explain() names an optimizer's part of the plain loop."""
    return f"{name}'s state ({state:g})" + (
        f" and its step's temporaries ({step:.2g})" if step else "")


def optimizer_state_copies(optimizer: torch.optim.Optimizer) -> tuple[float, str]:
    """The model copies a torch optimizer's state holds, and how explain() says it: SGD's
    momentum buffer (none without momentum), Adam's two moments (three with amsgrad), ...;
    an optimizer not known here is counted as Adam."""
    groups = getattr(optimizer, "param_groups", [])

    def any_set(key: str) -> bool:
        return any(bool(g.get(key)) for g in groups)

    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        copies = 1.0 if any_set("momentum") else 0.0
    elif isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        copies = 3.0 if any_set("amsgrad") else 2.0
        # (what it steps: a frozen tensor passed to it gets no gradient and no temporaries)
        params = [p for g in groups for p in g.get("params", []) if p.requires_grad]
        defaults = getattr(optimizer, "defaults", {})
        step = adam_step_copies(params, defaults.get("foreach"), defaults.get("fused"))
        return copies + step, _described(name, copies, step)
    elif isinstance(optimizer, (torch.optim.NAdam, torch.optim.RAdam,
                                torch.optim.Adamax)):  # fmt: skip
        copies = 3.0 if any_set("amsgrad") else 2.0
    elif isinstance(optimizer, torch.optim.Adagrad):
        copies = 1.0
    elif isinstance(optimizer, torch.optim.RMSprop):
        copies = 1.0 + any_set("momentum") + any_set("centered")
    else:
        return 2.0, f"{name}'s state (2, assumed: an optimizer not known here)"
    return copies, f"{name}'s state ({copies:g})"


def machine_memory_gb() -> float | None:
    """This machine's physical memory in GB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (ValueError, OSError, AttributeError):
        return None


def fit_budget(
    config: NodeConfig, trainer: Trainer, spec: AlgorithmSpec, optimizer: str | None = None,
    described: str = "",
) -> tuple[NodeConfig, MemoryEstimate, str]:
    """The config with the algorithm's settings fitted to the memory there is, and its estimate.

    An algorithm whose memory grows with a setting (choco: two copies per neighbour kept) says
    through `spec.fit` what it would keep within the copies left; the limit is limits.memory_gb,
    or, when unset, this machine's memory (so that a default that cannot fit is lowered instead
    of ending in the OOM killer). Nothing is raised here (check_budget refuses).

    Returns:
        (the config, fitted or as given; its estimate; what was changed and why, or "").
    """
    estimate = estimate_memory(config, trainer, spec, optimizer, described=described)
    limit = config.limits.memory_gb or machine_memory_gb()
    if spec.fit is None or limit is None or estimate.total_gb <= limit or not estimate.model_gb:
        return config, estimate, ""
    room = (limit - estimate.frozen_gb - estimate.buffers_gb - estimate.runtime_gb) / (
        estimate.model_gb)
    fitted = spec.fit(config.gossip, room - estimate.plain_copies, estimate.numel)
    if fitted is None or fitted == config.gossip:
        return config, estimate, ""
    config = dataclasses.replace(config, gossip=fitted)
    source = "limits.memory_gb" if config.limits.memory_gb else "this machine's memory"
    note = (f"{spec.name} settings lowered to fit {limit:.3g} GB ({source}): "
            f"{fitted.settings} (was {estimate.explain()})")
    return config, estimate_memory(config, trainer, spec, optimizer, described=described), note


def check_budget(config: NodeConfig, estimate: MemoryEstimate) -> None:
    """Refuse a config whose estimate does not fit limits.memory_gb.

    Raises:
        MemoryBudgetError: it does not fit (the message names the figures and what to change).
    """
    limit = config.limits.memory_gb
    if limit is None or estimate.total_gb <= limit:
        return
    raise MemoryBudgetError(
        f"limits.memory_gb = {limit:g}: this node needs about {estimate.explain()}; raise the "
        f"limit, use a smaller model, or an algorithm that keeps fewer copies "
        f"(docs/how-to/memory.md)"
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB.

    On Linux it is VmHWM, the high-water mark of this process's own memory since it started its
    program. Not getrusage's ru_maxrss: that one keeps the peak of the process that launched us
    across fork and exec (measured: a node started by a 2.9 GB parent reported 2.9 GB at once),
    so a node started from a big test runner, testbed or notebook would report their memory.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6  # kB
    except (OSError, ValueError, IndexError):
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6


def rss_mb() -> float | None:
    """This process's resident memory now, in MB as peak_rss_mb counts them (None where
    /proc/self/status does not say: not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Restart peak_rss_mb's high-water mark from the memory now (Linux); False where it
    cannot (the peak then counts from the start of the process)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


