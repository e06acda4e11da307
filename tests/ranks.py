"""Real process groups for tests: N spawned CPU processes over gloo on loopback."""

from __future__ import annotations

import os
import sys

import torch.multiprocessing as mp


def _run_then_exit(rank: int, fn, args: tuple) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: after destroy_process_group a ProcessGroupGloo worker
    # thread can still drop the last reference to a finished collective's tensor; when that
    # races finalization the thread cannot take the GIL, is pthread_exit'ed through a
    # noexcept frame and the process aborts ("terminate called without an active
    # exception", SIGABRT). Seen about once in 50 runs of test_fsdp's two-rank run, the
    # aborting thread's stack in ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject,
    # after every rank had returned. The results are on disk by now; an exception above
    # still takes mp.spawn's error path.
    os._exit(0)


def spawn(fn, nprocs: int, *args) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; raise if any fails."""
    mp.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs, join=True)
