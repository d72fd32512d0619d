# The node's trainer: a model, its optimizer and scheduler, and the loop that steps them. A loop of
# the user's own (geotrain.join) is this class itself; the daemon's task loop is its subclass
# Trainer, whose steps go through the same `stepped`, checkpoints and state sync. Invariants: the
# loop's thread owns the model; the node reads it (snapshots, chunks) under the model lock, which
# a user's thread holds only while the wrapped optimizer steps; the node's changes (a mix, an
# outer step) wait for the next step and run in the user's thread right after the optimizer's,
# so a forward or backward pass never sees a half-mixed model and `step()` never waits on the
# network; before the loop starts and after it ends they run at once.
from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
import torch

from ..state import (
    OptimizerStateError,
    adopt_optimizer_state,
    optimizer_from_checkpoint,
    optimizer_to_checkpoint,
)
from ._optimizer_sync import OptimizerSync, advance_schedule
from ._staging import ChunkStaging

T = TypeVar("T")
log = structlog.get_logger()


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    seconds: float  # wall time of the step, including any emulated slowdown
    samples: int = 0  # training samples the step took (0: not known, as in a user's own loop)


class LoopClosed(RuntimeError):
    """The swarm was closed: its loop takes no more steps, and queued changes were dropped."""


class Diverged(RuntimeError):
    """The model diverged: training.max_nonfinite_steps steps in a row reported a NaN or
    infinite loss. Raised by the step that made it so, once the step is taken and counted (a
    loop of the user's own: its optimizer's `step()`); the daemon stops with it. Checkpoints of
    a non-finite model are refused, so a restart resumes from the newest good one."""

    def __init__(self, message: str, result: StepResult | None = None) -> None:
        super().__init__(message)
        self.result = result  # the step that raised it, as `stepped` returns it


class _Pending:
    """A change of the model waiting for the next step, and its outcome."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], Any], changes: bool = True) -> None:
        self.fn = fn
        self.changes = changes  # it changes the model (an evaluation reads it)
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


def frozen_digest(frozen: list[tuple[str, torch.Tensor]], samples: int = 256) -> int:
    """A digest of frozen parameters: their names, shapes and `samples` values of each (all of
    a smaller one), evenly spaced from the first to the last and rounded to bfloat16 (a base
    loaded in bfloat16 on one peer and in float32 on another digests alike). 0 when nothing is
    frozen. It reads those values where they lie (no copy of a non-contiguous tensor): a
    10^9-parameter base costs milliseconds. Values between the samples are not compared."""
    if not frozen:
        return 0
    h = hashlib.sha256()
    for name, p in sorted(frozen, key=lambda item: item[0]):
        h.update(repr((name, tuple(p.shape))).encode())
        if not p.numel():
            continue
        at = torch.linspace(0, p.numel() - 1, min(p.numel(), samples), dtype=torch.float64)
        index = torch.unravel_index(at.round().long().to(p.device), tuple(p.shape))
        picked = p.detach()[index] if p.dim() else p.detach().reshape(1)
        h.update(picked.to("cpu", torch.bfloat16).float().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "big") >> 1


COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before every name


class LoopTrainer(OptimizerSync):
    """The node's trainer for a model trained by the user's own loop (see geotrain.join).

    Args:
        model: the user's model (its parameters are mixed in place).
        evaluate: `(model) -> float`, a held-out metric for status; None reports the loss.
        metric: the metric's name; higher_is_better: its direction.
    """

    overran_steps = 0  # compute emulation pads the daemon's steps only, never the user's loop
    # the user's loop keeps stepping while the algorithm's after_step runs (the daemon's waits)
    steps_beside_algorithm = True

    def __init__(
        self,
        model: torch.nn.Module,
        evaluate: Callable[[torch.nn.Module], float] | None = None,
        *,
        metric: str = "loss",
        higher_is_better: bool = False,
    ) -> None:
        self.model = model
        # what is averaged and synced: the parameters that train when the swarm is joined. Those
        # frozen then (requires_grad False: a fine-tuned model's base) stay as each peer loaded
        # them; a digest of samples of their values goes into every plan, so peers that froze
        # other parameters, or loaded other frozen values, refuse each other's exchanges
        named = list(model.named_parameters())
        lazy = [n for n, p in [*named, *model.named_buffers()] if torch.nn.parameter.is_lazy(p)]
        if lazy:
            raise ValueError(f"model {type(model).__name__}: {lazy[:3]} are not initialized "
                             "yet (a lazy module's): run one forward pass on a batch before "
                             "joining (every peer needs their shapes)")  # fmt: skip
        meta = [n for n, p in named if p.is_meta]
        if meta:
            raise ValueError(f"model {type(model).__name__}: parameters {meta[:3]} are on the "
                             "meta device (no values: offloaded, or built empty): load them "
                             "before joining")  # fmt: skip
        self._exchanged = frozenset(n for n, p in named if p.requires_grad)
        if not self._exchanged:
            raise ValueError(f"model {type(model).__name__}: every parameter is frozen "
                             "(requires_grad False): nothing to train or average; unfreeze what "
                             "trains before joining")  # fmt: skip
        self._trained_one = next(p for n, p in named if n in self._exchanged)
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        self._frozen = [p for _, p in frozen]
        self._frozen_ids = frozenset(id(p) for p in self._frozen)
        self.frozen_numel = sum(p.numel() for p in self._frozen)
        self.frozen_bytes = sum(p.numel() * p.element_size() for p in self._frozen)
        self.frozen_digest = frozen_digest(frozen)
        self._said_unfrozen = False
        self._evaluate = evaluate
        self.metric = metric if evaluate is not None else "loss"
        self.evaluates = evaluate is not None  # (False: the metric is the training loss)
        self.higher_is_better = higher_is_better if evaluate is not None else False
        self._lock = threading.RLock()
        # Held (after `_lock`, never before it) by whatever changes the parameters' values: an
        # optimizer step, a mix, a restore. `read` takes only this one, so a read of the model
        # (a chunk of an exchange or a state sync) goes on while the daemon's step runs its
        # forward and backward passes under `_lock`: a chunk that waited for each step made a
        # 100M-parameter choco exchange take ~70 s beside 0.9 s steps.
        self._writing = threading.RLock()
        self._pending: deque[_Pending] = deque()
        self._before_step: deque[_Pending] = deque()  # work for the start of the next step
        self._started = False  # the user's loop runs: changes wait for its steps
        self._closed = False
        self.step = 0
        self.last_loss = math.nan
        self._step_ends: deque[float] = deque(maxlen=50)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self._optimizer_state: tuple[dict, dict] | None = None  # from a checkpoint, until wrap
        self._said_optimizer_unsaved = False  # optimizer_not_checkpointed: warned once
        self._scheduler_state: dict | None = None  # likewise
        self._schedule_steps: int | None = None  # a peer's schedule point, for a later scheduler
        self._fetch_at_wrap: Callable[[], None] | None = None  # state sync's optimizer fetch
        self._last_end: float | None = None  # perf_counter at the end of the last step
        self._bad_losses = 0  # steps in a row whose reported loss was NaN or infinite
        self.max_bad_losses = 100  # that many in a row: Diverged (0: never; the node sets it)
        self._evaluate_failures = 0  # evaluations that raised or gave no number
        self.cut_short = False  # a change of the model was interrupted (Ctrl-C) midway
        self._staging: dict[str, ChunkStaging] = {}  # chunk_staging's, by stream
        self._staging_lock = threading.Lock()

    # -- what the node reads ----------------------------------------------------------------
    @property
    def nonfinite_losses(self) -> int:
        """Steps in a row, up to the last, whose reported loss was NaN or infinite."""
        return self._bad_losses

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters exchanged, averaged and synced: those that trained at join."""
        kept = self._exchanged
        return {name: p.data for name, p in self.model.named_parameters() if name in kept}

    def sample_digest(self) -> int:
        """A digest of samples of the exchanged parameters (see frozen_digest): whether the
        model changed between two calls. About 0.25 ms a tensor, whatever its size."""
        return frozen_digest(list(self.params().items()))

    def describe(self) -> str:
        """What this node exchanges, for errors: "N tensors, M parameters[ exchanged, F frozen]"."""
        params = self.params()
        numel = sum(t.numel() for t in params.values())
        return f"{len(params)} tensors, {numel:,} parameters" + (
            f" exchanged, {self.frozen_numel:,} frozen" if self.frozen_numel else "")

    @property
    def task_device(self) -> torch.device:
        """Where the parameters that train lie (a frozen part may be elsewhere)."""
        return self._trained_one.device

    def chunk_staging(self, stream: str) -> ChunkStaging | None:
        """The one host buffer (pinned on CUDA) through which chunks of `stream` ("exchange",
        "state_sync") cross between the model's device and the wire, made on first use; None
        where the model is in host memory (chunks are read straight into their messages)."""
        if self.task_device.type == "cpu":
            return None
        with self._staging_lock:
            staging = self._staging.get(stream)
            if staging is None:
                staging = self._staging[stream] = ChunkStaging(self.task_device)
            return staging

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the parameters exchanged (a read: see `read`)."""
        with self._writing:
            return {name: t.detach().clone() for name, t in self.params().items()}

    def update(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """Read (or, before the loop starts, change) the model under the lock, without autograd."""
        with self._lock, self._writing, torch.no_grad():
            return fn(self.params())

    def read(self, fn: Callable[[dict[str, torch.Tensor]], T]) -> T:
        """`fn(live parameters)` for a read that changes nothing (not the model, nor anything
        else guarded by the trainer's lock), without autograd: it waits only for a change of
        the parameters' values (an optimizer step, a mix), not for a step's forward and
        backward passes. `fn` must not call back into the trainer."""
        with self._writing, torch.no_grad():
            return fn(self.params())

    def update_beside(self, fn: Callable[[], T]) -> T:
        """`fn()` changing state kept beside the model (choco's estimates), not the model: apart
        from every read, change of the model and checkpoint (a checkpoint sees that state whole),
        but beside a step's forward and backward passes, which never touch it."""
        with self._writing:
            return fn()

    def apply(self, fn: Callable[[dict[str, torch.Tensor]], T], *, changes: bool = True) -> T:
        """Change the model by `fn` at the user's next step (at once before the loop starts or
        after it ended); blocks until done. Called from the node's worker threads.

        Raises:
            LoopClosed: the swarm was closed before the change ran.
        """
        with self._lock:
            if not self._started or self._closed:
                with self._writing, torch.no_grad():
                    return fn(self.params())
            pending = _Pending(fn, changes)
            self._pending.append(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.result

    def at_step_start(self, fn: Callable[[], T], *, wait: bool = True) -> T:
        """Run `fn` under the lock where the user's loop is between two iterations: at the start
        of its next step (before that optimizer step), at once before the loop starts or after
        it ended, or when not `wait` (the node stops by itself: the loop may never step again);
        blocks until done. A checkpoint taken there holds a scheduler the user steps
        after `opt.step()` stepped too: taken as the step was reported, it held the schedule
        one step behind whenever it won the race with the user's `schedule.step()`. An error
        of `fn` is raised here, not in the user's loop.
        """
        with self._lock:
            if not self._started or self._closed or not wait:
                with self._writing:  # (a checkpoint: apart from changes beside the model too)
                    return fn()
            pending = _Pending(lambda _params: fn())
            self._before_step.append(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.result

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's floating-point buffers its state_dict keeps (BatchNorm's running
        statistics): checkpointed, handed to a joiner by state sync, not averaged in exchanges
        (each node keeps statistics of its own data)."""
        kept = self.model.state_dict(keep_vars=True)  # (references, no copies)
        return {name: b.data for name, b in self.model.named_buffers()
                if name in kept and b.is_floating_point()}  # fmt: skip

    def load_buffers(self, remote: dict[str, torch.Tensor]) -> None:
        """Take a peer's buffers (state sync, before the loop starts): exactly ours by name and
        size, finite.

        Raises:
            ValueError: they are not.
        """
        from geotrain.gossip import all_finite

        def replace(_params: dict[str, torch.Tensor]) -> None:
            ours = self.buffers()
            if sorted(remote) != sorted(ours):
                raise ValueError(f"buffers {sorted(remote)[:3]}... are not ours "
                                 f"({sorted(ours)[:3]}...)")  # fmt: skip
            for name, t in remote.items():
                if t.numel() != ours[name].numel() or not all_finite(t):
                    raise ValueError(f"buffer {name}: {t.numel()} values, or not finite")
            for name, t in remote.items():
                ours[name].copy_(t.reshape(ours[name].shape))

        self.apply(replace)

    def load_params(self, remote: dict[str, torch.Tensor], *, max_norm_ratio: float) -> None:
        """Replace the parameters with a peer's (state sync, before the loop starts)."""
        from geotrain.gossip import check_update

        def replace(live: dict[str, torch.Tensor]) -> None:
            moved = {k: v.to(self.task_device) for k, v in remote.items()}
            check_update(live, moved, max_norm_ratio=max_norm_ratio)
            for name, tensor in live.items():
                tensor.copy_(moved[name])

        self.apply(replace)

    def step_interval_s(self) -> float | None:
        ends = list(self._step_ends)
        if len(ends) < 2:
            return None
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    def evaluate(self) -> float | None:
        """The user's metric (model in eval mode), or the last loss when none was given. It runs
        at the user's next step, between two of their steps (as a mix does): switching the model
        to eval mode while their forward pass runs would change it (dropout, batch norm).
        Blocks until then; called from the node's worker threads.

        Once the user's loop is closed (also while this waited for a next step that never
        came) it evaluates at once. None when the evaluation raised or gave no number (logged:
        evaluate_failed; it stopped the node, with no final checkpoint).
        """
        if self._evaluate is None:
            return self.last_loss

        def run(_params: dict[str, torch.Tensor]) -> float | None:
            was_training = self.model.training
            self.model.eval()
            try:
                value = self._evaluate(self.model)  # type: ignore[misc]
                if value is None or isinstance(value, str | bytes):
                    raise TypeError(f"evaluate returned {value!r:.60}: expected a number")
                metric = float(value)
                if not math.isfinite(metric):  # (it showed as no metric at all, unexplained)
                    raise ValueError(f"evaluate returned {metric}: expected a finite number")
                return metric
            except Exception as exc:  # the user's code: say so, train on
                self._evaluate_failed(exc)
                return None
            finally:
                self.model.train(was_training)

        try:
            return self.apply(run, changes=False)
        except LoopClosed:  # the loop ended before its next step: nothing runs beside us now
            return self.apply(run, changes=False)

    def _evaluate_failed(self, exc: Exception) -> None:
        """Log a failed evaluation: the first, then every 100th."""
        self._evaluate_failures += 1
        if self._evaluate_failures % 100 == 1:
            log.error("evaluate_failed", step=self.step, error=f"{type(exc).__name__}: {exc}"[:300],
                      failures=self._evaluate_failures,
                      detail="the evaluation raised or gave no number: the metric keeps its last "
                      "value and training goes on")  # fmt: skip

    # -- checkpoints ------------------------------------------------------------------------
    def state_tensors(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """Model, optimizer (once wrapped) and scheduler state for a checkpoint. Parameters
        frozen at join are left out (a fine-tuned model's base is not rewritten at every
        checkpoint); their digest goes in the meta."""
        with self._lock:
            tensors = {f"model/{k}": v.detach()
                       for k, v in self.model.state_dict(keep_vars=True).items()
                       if id(v) not in self._frozen_ids}  # fmt: skip
            meta: dict[str, Any] = {"step": self.step}
            if self._frozen:
                meta["frozen_digest"] = self.frozen_digest
            if self.optimizer is not None:
                try:
                    opt_tensors, meta["optimizer"] = optimizer_to_checkpoint(
                        self.optimizer, self.optimizer_names(self.optimizer))
                except OptimizerStateError as exc:  # the model is saved; the optimizer cannot be
                    if not self._said_optimizer_unsaved:
                        self._said_optimizer_unsaved = True
                        log.warning("optimizer_not_checkpointed", reason=str(exc),
                                    detail="checkpoints hold the model; a resume starts the "
                                    "optimizer fresh")  # fmt: skip
                    opt_tensors = {}
                tensors.update({k: v.detach() for k, v in opt_tensors.items()})
            elif self._optimizer_state is not None:  # restored, not wrapped yet: keep it
                opt_tensors, meta["optimizer"] = self._optimizer_state
                tensors.update(opt_tensors)
            if self.scheduler is not None:
                meta["scheduler"] = _jsonable(self.scheduler.state_dict())
            meta.update(self.checkpoint_extra())
            if copy:
                tensors = {k: v.clone() for k, v in tensors.items()}
            return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict, step: int) -> None:
        """Load a checkpoint: the model now; the optimizer's and scheduler's state now when
        they are attached (the daemon's), else at `wrap`."""
        device = self.task_device
        own = self.model.state_dict(keep_vars=True)
        frozen = {name for name, p in own.items() if id(p) in self._frozen_ids}
        # a checkpoint written through torch.compile's wrapper (before join took the module
        # inside it) names everything "_orig_mod.<name>": read under our names
        wrapped = not any(k.startswith(COMPILED_PREFIX) for k in own)
        names = {k: k[6:].removeprefix(COMPILED_PREFIX) if wrapped else k[6:]
                 for k in tensors if k.startswith("model/")}  # fmt: skip
        # the frozen parameters stay as loaded before join (an older checkpoint holds them too)
        model_sd = {names[k]: tensors[k].to(device) for k in names if names[k] not in frozen}
        with self._lock, self._writing:
            if frozen:
                result = self.model.load_state_dict(model_sd, strict=False)
                missing = sorted(set(result.missing_keys) - frozen)
                if missing or result.unexpected_keys:
                    raise RuntimeError(f"the checkpoint's model is not this one: missing "
                                       f"{missing[:5]}, unexpected "
                                       f"{result.unexpected_keys[:5]}")  # fmt: skip
            else:
                self.model.load_state_dict(model_sd)
            self.step = step
            saved = meta.get("frozen_digest")
            if saved is not None and saved != self.frozen_digest:
                log.warning("frozen_parameters_differ", step=step,
                            detail="this checkpoint was written with other frozen parameter "
                            "values than those loaded before join: those loaded now are kept "
                            "(peers that froze the other values refuse this node's "
                            "exchanges)")  # fmt: skip
            if "optimizer" in meta:
                opt = {k: v.to(device) for k, v in tensors.items() if k.startswith("optim/")}
                self._optimizer_state = (opt, meta["optimizer"])
            self._scheduler_state = meta.get("scheduler")
            self.restore_extra(meta)
            if self.optimizer is not None:
                self._load_saved_state(self.optimizer, self.scheduler)

    def checkpoint_extra(self) -> dict[str, Any]:
        """More JSON-able state for a checkpoint's meta (the daemon's privacy budget)."""
        return {}

    def restore_extra(self, meta: dict) -> None:
        """Load what `checkpoint_extra` wrote."""

    # -- optimizer state for a joiner (state sync) ------------------------------------------
    def adopt_optimizer_state(self, cls: str, tensors: dict[str, torch.Tensor], scalars: dict,
                              schedule_steps: int | None = None,
                              params: list[str] | None = None) -> bool:  # fmt: skip
        """A peer's optimizer state (state sync), and how many steps its scheduler took: loaded
        into the optimizer (with its own hyperparameters) and the scheduler moved on there at
        `wrap`, or now if it is wrapped already. Returns whether it is in the optimizer now.

        Raises:
            ValueError: it does not fit the wrapped optimizer; nothing was changed.
        """
        with self._lock:
            if self.optimizer is not None:
                adopt_optimizer_state(self.optimizer, cls, tensors, scalars, params,
                                      self.optimizer_names(self.optimizer))  # fmt: skip
                self._move_schedule(self.scheduler, schedule_steps)
                return True
            # (param_groups None: the user's own, at wrap)
            self._optimizer_state = (tensors, {"cls": cls, "scalars": scalars,
                                               "param_groups": None, "params": params,
                                               "schedule_steps": schedule_steps})  # fmt: skip
            return False

    def _move_schedule(self, scheduler: Any, steps: int | None) -> None:
        """Move `scheduler` on by a peer's `steps`; with no scheduler yet, at a later wrap that
        brings one (a wrap without one, then one with it, lost the peer's point)."""
        if steps is None:
            return
        if scheduler is None:
            self._schedule_steps = steps
            return
        self._schedule_steps = None
        why = advance_schedule(scheduler, steps)
        if why is None:
            log.info("schedule_synced", steps=steps, lr=_lr_of(scheduler))
        else:
            log.warning("schedule_not_synced", reason=why, detail="the schedule starts over")

    # -- the user's side --------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        """The user's optimizer (and scheduler): restore their checkpointed state into them.

        Raises:
            ValueError: the optimizer steps parameters that are not the model's, or the
                checkpoint restored at join holds another optimizer's state (its class, its
                number of parameter groups).
        """
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not callable(getattr(optimizer, "step", None)):
            # (the type only: a module's repr is many lines, and was cut mid-line)
            value = f" ({optimizer!r:.40})" if isinstance(optimizer, str | int | float) else ""
            raise ValueError(f"wrap() takes your torch optimizer, got a {type(optimizer).__name__}"
                             f"{value}: e.g. swarm.wrap(torch.optim.AdamW("
                             "model.parameters()))")  # fmt: skip
        mine = {id(p) for p in self.model.parameters()}
        theirs = [p for group in groups for p in group["params"]]
        if not theirs or any(id(p) not in mine for p in theirs):
            raise ValueError("the optimizer's parameters are not (all) the joined model's: wrap "
                             "the optimizer of the model given to geotrain.join")  # fmt: skip
        thawed = [p for p in theirs if id(p) in self._frozen_ids and p.requires_grad]
        if thawed:
            raise ValueError(f"the optimizer trains {len(thawed)} parameter(s) that were frozen "
                             "(requires_grad False) when the swarm was joined: nothing would "
                             "average them. Freeze or unfreeze before geotrain.join")  # fmt: skip
        cold = [n for n, p in self.model.named_parameters()
                if n in self._exchanged and not p.requires_grad]  # fmt: skip
        if cold:  # frozen between join and wrap: they still travel (and a lossy codec moves them)
            log.warning("frozen_after_join", parameters=cold[:5], count=len(cold),
                        detail="these parameters were trainable when the swarm was joined: "
                        "they are still exchanged, averaged and checkpointed (a lossy codec's "
                        "rounding moves them). Freeze before geotrain.join")  # fmt: skip
        if scheduler is not None:
            if not (callable(getattr(scheduler, "step", None))
                    and callable(getattr(scheduler, "state_dict", None))):  # fmt: skip
                raise ValueError(f"scheduler {scheduler!r:.60}: expected a torch learning-rate "
                                 "scheduler (with step() and state_dict())")  # fmt: skip
            scheduled = getattr(scheduler, "optimizer", optimizer)
            # (one made on what wrap returned schedules this optimizer through it)
            if optimizer not in (scheduled, getattr(scheduled, "optimizer", None)):
                raise ValueError("the scheduler schedules another optimizer than the one "
                                 "wrapped: pass the scheduler made for this optimizer")  # fmt: skip
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError("an optimizer is wrapped already: wrap one optimizer per swarm (a "
                             "second would take over its checkpoints and state sync)")  # fmt: skip
        with self._lock, self._writing:  # (a joiner reads the optimizer under _writing)
            try:
                self._load_saved_state(optimizer, scheduler)
            except ValueError as exc:
                raise ValueError(f"{exc}: wrap the optimizer that wrote the checkpoint (the same "
                                 "class and parameter groups), or start in another "
                                 "state.dir") from None  # fmt: skip
            self.optimizer, self.scheduler = optimizer, scheduler or self.scheduler
        fetch, self._fetch_at_wrap = self._fetch_at_wrap, None
        if fetch is not None:  # (outside the lock: the node's threads take it to load the state)
            fetch()

    def fetch_optimizer_at_wrap(self, fetch: Callable[[], None]) -> None:
        """State sync's fetch of a peer's optimizer state, to run in `attach` (the user's wrap),
        once the optimizer and its class are known; it loads the state into it, or says why
        not in the log."""
        self._fetch_at_wrap = fetch

    def _load_saved_state(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """Load the optimizer and scheduler state kept from a checkpoint or a peer into them."""
        if self._optimizer_state is not None:
            tensors, meta = self._optimizer_state
            if meta.get("param_groups") is None:  # a peer's (state sync): must fit
                try:
                    adopt_optimizer_state(optimizer, meta["cls"], tensors, meta["scalars"],
                                          meta.get("params"), self.optimizer_names(optimizer))
                    log.info("optimizer_state_synced", tensors=len(tensors),
                             detail="a peer's optimizer state, loaded at wrap")  # fmt: skip
                except ValueError as exc:
                    log.warning("optimizer_state_skipped", reason=str(exc),
                                detail="the optimizer starts fresh, and so does the schedule "
                                "(its warmup again), though the model is the peer's")  # fmt: skip
                else:
                    self._move_schedule(scheduler, meta.get("schedule_steps"))
            else:  # (a ValueError keeps it: a wrap of the right optimizer still gets it)
                given = _group_settings(optimizer)
                optimizer_from_checkpoint(optimizer, tensors, meta,
                                          self.optimizer_names(optimizer))  # fmt: skip
                _say_settings_replaced(given, _group_settings(optimizer))
            self._optimizer_state = None
        state = self._scheduler_state
        if scheduler is not None and isinstance(state, dict):
            current = scheduler.state_dict()
            if "lr_lambdas" in current and "lr_lambdas" not in state:  # older checkpoints
                state = {**state, "lr_lambdas": current["lr_lambdas"]}
            scheduler.load_state_dict(state)
        if scheduler is not None:  # (kept for a scheduler passed at a later wrap of it)
            self._scheduler_state = None
            self._move_schedule(scheduler, self._schedule_steps)

    def start(self) -> None:
        """The user's loop begins: from now on changes wait for its steps."""
        with self._lock:
            self._started = True

    def stepped(self, inner_step: Callable[[], Any], loss: float | None) -> tuple[Any, StepResult]:
        """Run the optimizer's step under the lock, then the changes that arrived meanwhile.

        Raises:
            LoopClosed: after `close`.
        """
        started = time.perf_counter()
        with self._lock, self._writing:
            if self._closed:
                raise LoopClosed("step() after the swarm was closed")
            self._run(self._before_step)
            result = inner_step()
            self.step += 1
            if loss is not None:
                self.last_loss = float(loss)
                self._check_loss()
            self._run(self._pending)
            step = self.step
            if self._frozen and not self._said_unfrozen:
                self._check_frozen()
            diverged = 0 < self.max_bad_losses <= self._bad_losses
        self._step_ends.append(time.monotonic())
        ended = time.perf_counter()
        # a step's seconds are the user's whole iteration (data, forward, backward, step), from
        # the end of their previous step: what the algorithms pace rounds and deadlines by
        since = started if self._last_end is None else self._last_end
        self._last_end = ended
        stepped = StepResult(step, self.last_loss, ended - since)
        if diverged:  # (after the step's bookkeeping: a loop that catches it goes on counted)
            raise Diverged(
                f"{self._bad_losses} steps in a row reported a non-finite loss (the last "
                f"{self.last_loss} at step {step}): the model diverged. Lower the learning "
                "rate or clip gradients; a restart resumes from the newest checkpoint "
                "(non-finite models are not checkpointed). training.max_nonfinite_steps "
                "sets how many are allowed (0: train on)", stepped)  # fmt: skip
        return result, stepped

    def _check_frozen(self) -> None:
        """Warn once when a parameter frozen at join trains now: nothing averages it."""
        thawed = [p for p in self._frozen if p.requires_grad]
        if thawed:
            self._said_unfrozen = True
            ids = {id(p) for p in thawed}
            names = [n for n, p in self.model.named_parameters() if id(p) in ids]
            log.warning("unfrozen_after_join", step=self.step, parameters=names[:5],
                        count=len(thawed), detail="these parameters were frozen when the swarm "
                        "was joined: they train now, but are neither averaged nor synced, so "
                        "peers' copies drift apart. Unfreeze before geotrain.join")  # fmt: skip

    def _check_loss(self) -> None:
        """Say so when the reported loss is NaN or infinite: the model diverged, and peers will
        refuse its exchanges as non-finite (at the first such step, then every 1000); counted
        for `Diverged`."""
        if math.isfinite(self.last_loss):
            self._bad_losses = 0
            return
        if self._bad_losses % 1000 == 0:
            log.warning("loss_not_finite", step=self.step, loss=self.last_loss,
                        in_a_row=self._bad_losses + 1,
                        detail="the model diverged: lower the learning rate, clip gradients, or "
                        "use bf16/fp32 (peers refuse a non-finite model's exchanges)")  # fmt: skip
        self._bad_losses += 1

    def _run(self, queue: deque[_Pending]) -> None:
        main = threading.current_thread() is threading.main_thread()
        while queue:
            # (from before the pop: a change taken off the queue is run and answered; an
            # evaluation too, which changes nothing: one counter, no window between two)
            deferring = main
            _DeferredExit.depth += deferring
            pending: _Pending | None = None
            try:
                pending = queue.popleft()
                with torch.no_grad():
                    pending.result = pending.fn(self.params())
            except (KeyboardInterrupt, SystemExit):  # Ctrl-C (or a signal handler's exit) in
                # the user's thread while it ran the node's change: the user's to handle, not
                # the node's (handed over, it failed the node: no final checkpoint, no leave).
                # The node hears that the loop closed; the changes behind stay queued (close
                # runs them)
                if pending is not None:
                    pending.error = LoopClosed("the loop was interrupted during this change")
                    # a mix or an outer step cut short leaves the model half changed: no final
                    # checkpoint of it (the newest on disk stays); an evaluation changed nothing
                    self.cut_short = self.cut_short or pending.changes
                raise
            except BaseException as exc:  # handed to the node's thread that asked for it
                assert pending is not None  # (popleft of a queue that has items raises none)
                pending.error = exc
            finally:
                if pending is not None:
                    pending.done.set()
                _DeferredExit.depth -= deferring
            raise_deferred_exit()  # (none within close: its caller takes it)

    def close(self) -> None:
        """No more steps: the changes that wait run now (the loop stopped, nothing runs beside
        them: a mix or an evaluation that arrived lands in the final checkpoint instead of
        failing the node's exchange and its shutdown), later ones at once; `stepped` refuses
        from now on. Called from the user's thread. A SIGTERM meanwhile (join's exit) is left
        for the caller (take_deferred_exit): every change that waits is run first."""
        with self._lock, self._writing, exits_deferred():
            self._closed = True
            self._run(self._before_step)
            self._run(self._pending)


class _DeferredExit:
    """join's SIGTERM exit while the main thread runs one of the node's changes (a mix, an outer
    step; an evaluation too): raised at the change's end, not in its middle (a change cut short
    leaves the model half changed, and its final checkpoint is refused: the steps since the last
    one were lost)."""

    depth = 0  # changes the main thread runs now (only the main thread runs signal handlers)
    code: int | None = None  # the exit a handler asked for meanwhile


@contextlib.contextmanager
def exits_deferred() -> Iterator[None]:
    """Within it, join's SIGTERM exit (exit_or_defer) waits, in the main thread: for the caller
    to take it after (take_deferred_exit). Elsewhere nothing changes."""
    main = threading.current_thread() is threading.main_thread()
    _DeferredExit.depth += main
    try:
        yield
    finally:
        _DeferredExit.depth -= main


def exit_or_defer(code: int) -> None:
    """For a signal handler of geotrain's own: raise SystemExit(`code`) now, or, while the main
    thread applies a change of the model, once that change is done (see _DeferredExit)."""
    if _DeferredExit.depth:
        _DeferredExit.code = code
        return
    raise SystemExit(code)


def take_deferred_exit() -> SystemExit | None:
    """The exit a signal asked for during a change whose end raised none (the loop's close):
    for the caller to raise once it is done; None when none was asked for."""
    code, _DeferredExit.code = _DeferredExit.code, None
    return None if code is None else SystemExit(code)


def raise_deferred_exit() -> None:
    """Raise the exit a signal asked for during a change, if any (outside every change)."""
    if not _DeferredExit.depth and (exc := take_deferred_exit()) is not None:
        raise exc


def _jsonable(value: Any) -> Any:
    """A scheduler's state dict as JSON can hold it (numbers, strings, lists, dicts)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def _lr_of(scheduler: Any) -> float | None:
    last = getattr(scheduler, "_last_lr", None)
    return float(last[0]) if isinstance(last, list) and last else None


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (a scheduler's `initial_lr` standing for `lr`)."""
    out = []
    for group in optimizer.param_groups:
        skip = {"params", "lr", "initial_lr"}
        if "max_momentum" in group:  # (OneCycleLR, CyclicLR: their schedule moves these)
            skip |= {"momentum", "betas"}
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()
                    if k not in skip and isinstance(v, int | float | bool | tuple | list)}
        settings["lr"] = group.get("initial_lr", group.get("lr"))
        out.append(settings)
    return out


def _say_settings_replaced(given: list[dict[str, Any]], restored: list[dict[str, Any]]) -> None:
    """A resume loads the checkpoint's optimizer settings over the ones the loop gave (as torch's
    load_state_dict does): a restart with a new learning rate trained on at the old one, and
    nothing said so."""
    changed = {f"group {i}: {key}": {"given": mine.get(key), "checkpoint": theirs[key]}
               for i, (mine, theirs) in enumerate(zip(given, restored, strict=False))
               for key in theirs if key in mine and mine[key] != theirs[key]}  # fmt: skip
    if changed:
        log.warning("optimizer_settings_from_checkpoint", changed=changed,
                    detail="the checkpoint's optimizer state carries its settings, and they "
                    "replace the ones your optimizer was made with (as torch's "
                    "load_state_dict does; a scheduler restored from it keeps its base rates "
                    "too). To change them on a resume, set them after wrap() (for a group: "
                    "group['lr'] = ..., and a scheduler's base_lrs), or start in another "
                    "state.dir")  # fmt: skip
