"""What a node trains and how: tasks (built-in or `module:function`), the trainer, devices."""

from ._builtin import BUILTIN_TASKS as BUILTIN_TASKS
from ._corpus import stdlib_corpus as stdlib_corpus
from ._device import resolve_device as resolve_device
from ._gpt import GPT as GPT
from ._gpt import SIZES as GPT_SIZES  # noqa: F401 (re-exported: the gpt task's named sizes)
from ._gpt import gpt as gpt
from ._loop import Diverged as Diverged
from ._loop import LoopClosed as LoopClosed
from ._loop import LoopTrainer as LoopTrainer
from ._loop import exit_or_defer as exit_or_defer
from ._loop import exits_deferred as exits_deferred
from ._loop import take_deferred_exit as take_deferred_exit
from ._privacy import LEDGER_AHEAD_STEPS as LEDGER_AHEAD_STEPS
from ._privacy import PrivacyError as PrivacyError
from ._privacy import PrivacyStatistics as PrivacyStatistics
from ._privacy import make_private as make_private
from ._recipe import Recipe as Recipe
from ._recipe import schedule_factor as schedule_factor
from ._staging import ChunkStaging as ChunkStaging
from ._staging import StagingStatistics as StagingStatistics
from ._tasks import PARTITIONS as PARTITIONS
from ._tasks import Task as Task
from ._tasks import TaskContext as TaskContext
from ._tasks import TaskError as TaskError
from ._tasks import TaskFunction as TaskFunction
from ._tasks import UnknownTaskParam as UnknownTaskParam
from ._tasks import batch_samples as batch_samples
from ._tasks import endless_batches as endless_batches
from ._tasks import resolve_task as resolve_task
from ._tasks import shard_indices as shard_indices
from ._trainer import OPTIMIZERS as OPTIMIZERS
from ._trainer import StepResult as StepResult
from ._trainer import Trainer as Trainer
