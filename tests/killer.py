"""Kill a Ray Train worker from outside once a checkpoint is registered, as the OOM killer
or a lost node would: shared by the fault tests of DDP (test_faults) and FSDP runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time


def registered_step(train_dir) -> int:
    """The highest step of a checkpoint Ray Train has registered (written and reported:
    what a restart resumes from). A folder alone is not enough: a worker killed during
    its upload leaves one that is never recorded."""
    try:
        snap = json.loads(open(os.path.join(train_dir, "checkpoint_manager_snapshot.json")).read())
    except (OSError, ValueError):
        return 0
    return max((r["metrics"]["step"] for r in snap.get("checkpoint_results", [])), default=0)


def written_step(train_dir) -> int:
    """4 once a checkpoint folder exists under ``train_dir`` (written, maybe not yet
    registered), else 0: the earliest sign that the step-4 checkpoint is being saved."""
    try:
        return 4 * any(n.startswith("checkpoint_") for n in os.listdir(train_dir))
    except OSError:
        return 0


@contextlib.contextmanager
def kill_a_worker_after(train_dir, step: int, sig: int = signal.SIGKILL, registered: list | None = None,
                        reached=registered_step):
    """While the body runs: find a training worker process and send it ``sig`` (SIGKILL,
    or SIGTERM as a spot notice would) once a checkpoint of at least ``step`` is
    registered under ``train_dir``. Yields the list the pid is appended to;
    ``registered`` gets the latest registered step at that moment."""
    import ray
    from ray.util.state import list_actors

    # This test's cluster by address: other local clusters (another suite) may be up too.
    address = ray.get_runtime_context().gcs_address
    killed, done, errors = [], threading.Event(), []

    def killer():
        pid = None
        try:
            while not done.is_set() and not killed:
                if pid is None:
                    alive = list_actors(address=address, filters=[
                        ("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
                    pid = alive[0].pid if alive else None
                elif (at := reached(train_dir)) >= step:
                    os.kill(pid, sig)
                    killed.append(pid)
                    if registered is not None:
                        registered.append(at)
                time.sleep(0.1)
        except Exception as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        yield killed
    finally:
        done.set()
        t.join(timeout=30)
    if errors:
        raise errors[0]
