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


@contextlib.contextmanager
def kill_a_worker_after(train_dir, step: int):
    """While the body runs: find a training worker process and SIGKILL it once a
    checkpoint of at least ``step`` is registered under ``train_dir``. Yields the list
    the killed pid is appended to."""
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
                elif registered_step(train_dir) >= step:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
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
