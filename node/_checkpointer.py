# Checkpoints of a running node: what goes in (model, optimizer, the algorithm's state, link
# estimates), when, and how a restart reads it back. Invariants: a checkpoint of another algorithm
# is refused before anything starts (ResumeError); tensors are copied under the trainer's lock and
# written in a worker thread; link state is read on the event loop; a checkpoint of the previous
# layout (error feedback at the top level, before algorithms owned their state) is read as if it
# were of this one.
from __future__ import annotations

import errno
import time

import structlog
import torch
import trio

from geotrain.gossip import LinkTable, all_finite

from ._limits import open_files
from .algorithms import Algorithm
from .state import Checkpoint, CheckpointStore
from .training import LoopClosed, Trainer

LAYOUT = 2  # 1: adpsgd's error feedback as "ef/..." beside the model; 2: all of it under "algo/"
SAY_WRITTEN_EVERY_S = 600.0  # a periodic checkpoint is logged at info at most this often
QUIET_WAIT_S = 30.0  # how long a checkpoint waits for the exchanges in flight to end
log = structlog.get_logger()


class ResumeError(Exception):
    """The state directory holds a checkpoint this configuration cannot continue from."""


def load_checkpoint(store: CheckpointStore, algorithm: str) -> Checkpoint | None:
    """The newest good checkpoint in `store`, or None; unreadable ones are skipped (logged).

    Raises:
        ResumeError: the checkpoint was written by another algorithm.
    """
    ckpt, skipped = store.load_latest()
    for reason in skipped:
        log.warning("checkpoint_skipped", reason=reason)
    if ckpt is not None and ckpt.algorithm != algorithm:
        raise ResumeError(
            f"{store.directory} holds a checkpoint of algorithm {ckpt.algorithm!r} "
            f"(step {ckpt.step}); this node is configured for {algorithm!r}: use another "
            f"state.dir or the same algorithm"
        )
    return ckpt


class Checkpointer:
    """Writes and restores one node's checkpoints.

    Args:
        store: where checkpoints go; algorithm_name / task: recorded in each.
        trainer, algorithm, links: whose state is saved.
    """

    def __init__(
        self,
        store: CheckpointStore,
        algorithm_name: str,
        task: str,
        trainer: Trainer,
        algorithm: Algorithm,
        links: LinkTable,
    ) -> None:
        self._store = store
        self._name = algorithm_name
        self._task = task
        self._trainer = trainer
        self._algorithm = algorithm
        self._links = links
        self._written_step = -1
        self.final_failed = False  # the checkpoint at stop could not be written
        self.written_at: float | None = None  # time.monotonic() of the last write
        self._said_at: float | None = None  # ... and of the last one logged at info
        self.failures = 0  # writes that failed (OSError: a full disk) or were refused (NaN)

    def restore(self, ckpt: Checkpoint) -> None:
        """Load a checkpoint's model, optimizer, algorithm state and link estimates."""
        tensors = dict(ckpt.tensors)
        if ckpt.meta.get("layout", 1) < 2:  # layout 1: adpsgd's residuals at the top level
            tensors.update({f"algo/{k}": v for k, v in tensors.items() if k.startswith("ef/")})
        try:
            self._trainer.restore(tensors, ckpt.meta, ckpt.step)
        except torch.OutOfMemoryError:  # the checkpoint is fine: the device is too small
            raise
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
            # torch's own words (a size mismatch, an optimizer of another kind) on one line
            said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise ResumeError(
                f"{self._store.directory}: the checkpoint of step {ckpt.step} does not fit this "
                f"configuration's model or optimizer ({type(exc).__name__}: {said[:300]}): run "
                "it with the settings that wrote it, or use another state.dir"
            ) from exc
        algo = {k[5:]: v for k, v in tensors.items() if k.startswith("algo/")}
        self._algorithm.load_state(algo, ckpt.meta.get("algo") or {})
        links = ckpt.meta.get("links")
        if isinstance(links, dict):
            try:
                self._links.load_state_dict(links, trio.current_time())
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("link_state_ignored", reason=str(exc))
        self._written_step = ckpt.step
        if isinstance(self._trainer, Trainer):
            log.info("resumed", step=ckpt.step)
        else:  # (a loop that keeps checkpoints of its own loses newer work unawares)
            log.info("resumed", step=ckpt.step, state_dir=str(self._store.directory.parent),
                     detail="the model given to join is now this checkpoint's, and so will the "
                     "optimizer's and scheduler's state be at wrap: a loop with a step counter "
                     "or checkpoints of its own goes on from swarm.step")  # fmt: skip

    async def write(self, *, final: bool = False) -> None:
        """Write a checkpoint unless one of this step exists already: between two iterations of
        a loop of the user's own, or at once when `final` (the node stops). A write that fails
        with an OSError (a full disk) is logged and counted, and leaves the older checkpoints as
        they were: it stopped the node, whose work since the last checkpoint was lost with it."""
        if self._trainer.step == self._written_step:
            return
        links = self._links.state_dict(trio.current_time())

        if final and getattr(self._trainer, "cut_short", False):
            self.failures += 1
            log.error("checkpoint_refused", step=self._trainer.step,
                      reason="Ctrl-C cut a change of the model short (a mix or an outer step): "
                      "it may be half applied", hint="the newest checkpoint on disk stays; a "
                      "restart resumes from it")  # fmt: skip
            return

        def write() -> tuple[int, float, list[str]]:
            # Written straight from the live tensors, under the model lock: no copy of the model
            # or its optimizer state is made (a 10^8-parameter model would need two), and the
            # file is one consistent step; training and exchanges' reads pause meanwhile. A loop
            # of the user's own is between two iterations then (its schedule stepped too).
            started = time.perf_counter()
            tensors, meta = self._trainer.state_tensors(copy=False)
            algo_tensors, meta["algo"] = self._algorithm.state()
            tensors.update({f"algo/{k}": v for k, v in algo_tensors.items()})
            meta.update(links=links, task=self._task, layout=LAYOUT)
            step = meta["step"]
            # a diverged model (NaN or inf in its parameters or any optimizer or algorithm
            # state) would rotate the last good files out. Buffers are not checked: an
            # attention mask holds -inf by design (charlm's `causal`), and a healthy model
            # with one would be refused every checkpoint
            params = {f"model/{name}" for name, _ in self._trainer.model.named_parameters()}
            bad = [name for name, t in tensors.items()
                   if (name in params or not name.startswith("model/")) and not all_finite(t)]
            if not bad:
                self._store.save(Checkpoint(step, self._name, tensors, meta))
            return step, time.perf_counter() - started, bad

        try:
            # (no exchange meanwhile: its chunks would wait on the model lock we hold for the
            # write, seconds at 10^8, and its partner's deadline pass; those in flight end first)
            async with self._algorithm.quiet(0.0 if final else QUIET_WAIT_S):
                step, seconds, bad = await trio.to_thread.run_sync(
                    lambda: self._trainer.at_step_start(write, wait=not final))
        except LoopClosed:  # the user's loop was interrupted (Ctrl-C) while it wrote: its
            # close writes the final one
            log.info("checkpoint_skipped", step=self._trainer.step, reason="loop interrupted")
            return
        except OSError as exc:  # a full or failing disk: the run goes on, the older files stay
            self.failures += 1
            if final:  # nothing goes on: say what is lost (the daemon exits 1)
                self.final_failed = True
                log.error("checkpoint_failed", step=self._trainer.step, error=str(exc),
                          directory=str(self._store.directory), final=True,
                          hint="the node stops WITHOUT its final checkpoint: a restart resumes "
                          f"from the newest one on disk (step {self._written_step}; -1: none), "
                          f"the steps after it are lost ({_cause(exc)})")  # fmt: skip
                return
            log.error("checkpoint_failed", step=self._trainer.step, error=str(exc),
                      directory=str(self._store.directory),
                      hint="training goes on and the previous checkpoint is kept; the next "
                      f"one is tried at the next checkpoint_every ({_cause(exc)})")  # fmt: skip
            return
        if bad:
            self.failures += 1
            log.error("checkpoint_refused", step=step, non_finite=len(bad), first=bad[:3],
                      reason="the model or its optimizer state holds NaN or inf (diverged)",
                      hint="the previous checkpoints are kept: a restart resumes from the "
                      "newest good one")  # fmt: skip
            return
        self._written_step = step
        self.written_at = now = time.monotonic()
        # every write at debug, the final one and one every SAY_WRITTEN_EVERY_S at info: a fast
        # task's checkpoint every 200 steps would otherwise be most of a node's log lines
        loud = final or self._said_at is None or now - self._said_at >= SAY_WRITTEN_EVERY_S
        if loud:
            self._said_at = now
        (log.info if loud else log.debug)("checkpoint_written", step=step,
                                          seconds=round(seconds, 3))  # fmt: skip


def _cause(exc: OSError) -> str:
    """What an operator does about a failed checkpoint write."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        files, limit = open_files()
        held = (f"has {files} files open of its limit {limit}" if files is not None
                else f"is at its limit of {limit} open files")  # (the count needs one too)
        return (f"the process {held}: many idle connections to the node's port hold one each "
                "until they time out (~16 s); `geotrain status` shows the count")  # fmt: skip
    return "free space, or see the error"
