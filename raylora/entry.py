"""What the driver hands Ray Train: the per-worker entry functions and their WorkerSpec.

Light on purpose. Ray Train's controller actor unpickles the trainer's function and its
``train_loop_config`` only to pass them on to the workers, and a function or class pickled
by reference imports the module that defines it. When these lived in ``raylora.worker``,
every run's controller (and every Tune trial's) imported torch, diffusers, peft and
bitsandbytes first: about 6 s of one core on a 2-core box, before it asked for the
workers. The workers import ``raylora.worker`` themselves, on their first call.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray.train
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from raylora.config import RayLoraConfig
from raylora.launch import Plan


@dataclass(frozen=True)
class LrFindSettings:
    """``raylora lr-find``: the range test's sweep (raylora.train.lr_find.range_test)."""

    start_lr: float = 1e-7
    end_lr: float = 1.0
    num_steps: int = 100
    smoothing: float = 0.9
    diverge_factor: float = 10.0


@dataclass
class WorkerSpec:
    """Everything one worker is told, built once by the driver (``launch.build_trainer``)
    and sent as ``train_loop_config={"spec": spec}``."""

    config: RayLoraConfig
    plan: Plan
    # The tokenizers, read once by the driver for every worker (None: cached latents).
    tokenizer_specs: tuple | None = None
    progress_bar: bool = False  # verbose, and a terminal is watching: Ray Data's bars
    lr_find: LrFindSettings | None = None
    # The run's desk (raylora.desk), by name, as the progress board (``raylora train``,
    # ``raylora tune``): rank 0 sends it each step, labelled with ``progress_label`` (a
    # search's trial) when there is one.
    progress_board: str | None = None
    progress_label: str | None = None
    # The run's desk again, for its raylora.stop.Requests: rank 0 polls it.
    stop_requests: str | None = None

    @classmethod
    def of(cls, loop_config: dict) -> WorkerSpec:
        return loop_config["spec"]


def train_loop_per_worker(loop_config: dict) -> None:
    """``raylora train`` and Tune trials: raylora.worker.train_loop_per_worker."""
    from raylora import worker

    try:
        worker.train_loop_per_worker(loop_config)
    except Exception as error:
        # After the worker closed its data stream and tracker: a rank whose node, or a
        # peer's, is being preempted holds its error until Ray Train restarts the workers
        # (raylora.stop.notice_wait_s says why).
        from raylora.stop import hold_error_for_notice

        hold_error_for_notice(error)
        raise


def lr_find_per_worker(loop_config: dict) -> None:
    """``raylora lr-find``: raylora.worker.lr_find_per_worker."""
    from raylora import worker

    worker.lr_find_per_worker(loop_config)


class RepeatedError(ValueError):
    """A worker error that restarting the workers would only repeat (``EndOnRepeated``);
    ``launch.fit_interruptibly`` raises it in place of Ray Train's error."""


class EndOnRepeated(ray.train.UserCallback):
    """Ends the run at a worker error whose class says a restart repeats it
    (``restart_repeats``): data over data.max_bad_fraction, a loss that stayed NaN/inf,
    a data stream that ended early.

    Ray Train restarts the workers from the latest checkpoint after any worker error, up
    to failure.max_failures: right for a lost node or a killed process, which is what that
    setting is for. These errors came back each time, after the workers had loaded the
    model and read the data again: with failure.max_failures -1, without end. Called in
    the controller's poll of the workers; a ControllerError raised there ends the run
    (its failure policy retries only the workers' errors and failed starts), with this
    error as the run's."""

    def after_exception(self, run_context, worker_exceptions):
        for rank, error in sorted(worker_exceptions.items()):
            cause = getattr(error, "_base_exc", error)  # Ray's UserExceptionWithTraceback
            if getattr(cause, "restart_repeats", False):
                raise ray.train.ControllerError(RepeatedError(
                    f"rank {rank}: {type(cause).__name__}: {cause} (not retried: restarting "
                    "the workers would repeat it; failure.max_failures is for lost workers)"))


class NoDatasetsCallback(DatasetsCallback):
    """Ray Train's ``DatasetsCallback`` for a run given no ``datasets=`` (every raylora run:
    the workers build their dataset themselves, ``worker._epoch_batches``).

    The stock callback starts a ``DatasetManager`` actor per run even with nothing to
    split: one more process importing Ray Data, ~1.6 CPU-s of a ~25 CPU-s tiny run on 2
    cores, and one per Tune trial. This one starts none. It still copies the driver's
    Ray Data context to the workers (``after_worker_group_start``): the datasets the
    workers build must see the driver's settings (progress bars off in job logs)."""

    def before_init_train_context(self, workers):
        return {}  # no shard provider: the workers never ask Ray Train for a dataset shard
