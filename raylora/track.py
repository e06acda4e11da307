"""Experiment tracking (wandb or TensorBoard) for the rank-0 training worker.

``metrics.jsonl`` is always written elsewhere; this module only mirrors metrics and sample
images into a tracker a person looks at while the job runs. Everything a backend writes
lands under ``{output.uri}/tracking/``. Trackers write to local files, so for an object-store
output they write into a temp dir and ``sync()`` / ``close()`` copy it to the bucket.

A run started again on the same output (a rerun, Ray Train's restart after a failure or a
preemption, an elastic resize) continues the same wandb run and TensorBoard logdir. A tracker
that cannot start (the wandb server unreachable) is logged as a warning, not raised: the
training must not die because a dashboard is down.

No Ray imports here: the worker owns the tracker, the driver never sees one.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import secrets
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from raylora import storage
from raylora.config import TrackingSection
from raylora.storage import Storage

if TYPE_CHECKING:
    from PIL.Image import Image

logger = logging.getLogger(__name__)


class Tracker:
    """The ``none`` backend, and the base of the others: every call is a no-op.

    Subclasses write under ``self.local_dir``; when the output is remote, ``sync`` copies
    that dir to ``self.remote_uri`` (``{output.uri}/tracking``).
    """

    def __init__(self, local_dir: str | None = None, remote_uri: str | None = None,
                 store: Storage | None = None):
        self.local_dir = local_dir
        self.remote_uri = remote_uri
        self._store = store
        self._closed = False

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Scalars for one step; None and non-numeric values are skipped."""

    def log_images(self, step: int, key: str, images: list[Image], captions: list[str]) -> None:
        """A batch of sample images with one caption each, under ``key``.

        wandb drops entries for a step lower than one already logged, so log images for a
        step before logging metrics of a later step.
        """

    def sync(self) -> None:
        """Copy what was written so far to the remote output (no-op for local outputs).

        Safe to call at checkpoints: files still being appended to are copied as they are,
        and the next sync overwrites them.
        """
        if self.remote_uri is not None and self.local_dir is not None:
            for local, uri in self._uploads():
                if os.path.isdir(local):
                    self._store.upload_dir(local, uri, growing=True)

    def close(self, failed: bool = False) -> None:
        """Finish the backend, upload a remote output's files and delete the temp dir.
        ``failed``: the training raised (wandb records the run as failed, not finished)."""
        if self._closed:
            return
        self._closed = True
        self._finish(failed)
        if self.remote_uri is not None:
            self.sync()
            # Only after a successful upload: if it raised, the temp dir keeps the only copy.
            shutil.rmtree(self.local_dir, ignore_errors=True)

    def _finish(self, failed: bool) -> None:
        """Flush and close the backend's writer."""

    def _uploads(self) -> list[tuple[str, str]]:
        """(local dir, URI) pairs that ``sync`` copies."""
        return [(self.local_dir, self.remote_uri)]


class TensorBoardTracker(Tracker):
    """Event files under ``tracking/tensorboard/``, written with tensorboardX (a Ray
    dependency; the ``tensorboard`` package that torch.utils.tensorboard needs is not
    installed).

    Not ``SummaryWriter``: it hands events to a background thread, and its ``flush()``
    does not wait for that queue, so a ``sync()`` right after ``log()`` could upload a file
    without the step. The synchronous ``EventsWriter`` under it has the file complete when
    ``log`` returns.
    """

    def __init__(self, local_dir: str, remote_uri: str | None, store: Storage | None,
                 start_step: int = 0):
        super().__init__(local_dir, remote_uri, store)
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        logdir = os.path.join(local_dir, "tensorboard")
        os.makedirs(logdir, exist_ok=True)
        # Names the file events.out.tfevents.<time>.<host>, like SummaryWriter does, plus
        # the start's time in ns: the name's time has whole seconds and the file is opened
        # "wb", so a second start within that second truncated the first's file. Fixed
        # width, so TensorBoard (files in name order) reads the attempts in the order they
        # started. A resumed run's file also ends in .from<step>.
        suffix = f".{time.time_ns()}" + (f".from{start_step}" if start_step else "")
        self._writer = EventsWriter(os.path.join(logdir, "events"), suffix)
        # A SessionLog START at the first step this attempt logs makes TensorBoard drop
        # the points earlier files have from that step on (what SummaryWriter(purge_step=)
        # writes), so the curve does not fold back: start_step + 1 after a resume from a
        # checkpoint there, 0 for a start from scratch (it logs the base model's held-out
        # loss at step 0 again). Written at every start, a first one too: an object-store
        # output's earlier files are not in this temp dir to be looked for, and a Ray Train
        # restart before the first checkpoint starts from scratch on the same logdir.
        self._writer.write_event(Event(step=start_step + 1 if start_step else 0,
                                       wall_time=time.time(),
                                       session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from tensorboardX import summary

        values = [summary.scalar(name, value).value[0] for name, value in scalars(metrics).items()]
        if values:
            self._write(step, values)

    def log_images(self, step: int, key: str, images: list[Image], captions: list[str]) -> None:
        import numpy as np
        from tensorboardX import summary

        _check_captions(images, captions)
        values = [
            summary.image(f"{key}/{i}", np.asarray(im.convert("RGB")), dataformats="HWC").value[0]
            for i, im in enumerate(images)
        ]
        # TensorBoard's image tab shows no captions; its text tab does (tag gets a
        # "/text_summary" suffix).
        text = "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions))
        values.append(summary.text(f"{key}/captions", text).value[0])
        self._write(step, values)

    def _write(self, step: int, values: list) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._writer.write_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        # A job killed between flushes would lose the end of its curve otherwise.
        self._writer.flush()

    def _finish(self, failed: bool) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A wandb run; its local files go to ``tracking/wandb/`` (wandb names the subdir)."""

    def __init__(self, tracking: TrackingSection, run_name: str, run_id: str, config: dict,
                 local_dir: str, remote_uri: str | None, store: Storage | None):
        super().__init__(local_dir, remote_uri, store)
        import wandb

        self._wandb = wandb
        self._failed = False
        # wandb takes the git root from `dir`; a missing dir prints a warning even when
        # silent.
        os.makedirs(local_dir, exist_ok=True)
        # tracking.project "team/project": that team's (wandb's entity) project
        entity, _, project = tracking.project.rpartition("/")
        init = dict(
            project=project,
            **({"entity": entity} if entity else {}),
            name=run_name,
            dir=local_dir,
            # The output's own id (wandb_run_id): a restarted or resumed run continues
            # its wandb run instead of splitting the curve over a new one per attempt.
            id=run_id,
            resume="allow",
            config=config,
            # A trial reusing this worker process must not log into the previous run.
            reinit="finish_previous",
            # Its banner would land in the middle of the training log.
            settings=wandb.Settings(silent=True),
        )
        try:
            # Explicit, so the config wins over a WANDB_MODE left in the environment.
            self._run = wandb.init(mode=tracking.wandb_mode, **init)
        except Exception as exc:
            if tracking.wandb_mode != "online":
                raise
            # Server unreachable (CommError after wandb's init timeout), key refused, ...:
            # keep the run's metrics and images offline under the same id, so a later
            # `wandb sync` adds them to the same wandb run.
            wandb.teardown()  # the failed init still holds the run id in wandb's service
            self._run = wandb.init(mode="offline", **init)
            logger.warning("tracking: wandb could not start online (%s); logging offline to "
                           "%s instead: `wandb sync` that folder once the server is reachable",
                           _why(exc), os.path.dirname(self._run.dir))
        if not self._run.offline:
            logger.info("wandb run %s", self._run.url)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = scalars(metrics)
        if values:
            self._guarded(lambda: self._run.log(values, step=step))

    def log_images(self, step: int, key: str, images: list[Image], captions: list[str]) -> None:
        _check_captions(images, captions)
        self._guarded(lambda: self._run.log(
            {key: [self._wandb.Image(im, caption=c) for im, c in zip(images, captions)]},
            step=step))

    def _guarded(self, call) -> None:
        """``call()``; the first failure (wandb's service gone, its disk full) is a warning
        and ends the logging to wandb: the training goes on, metrics.jsonl has every step."""
        if self._failed:
            return
        try:
            call()
        except Exception as exc:
            self._failed = True
            logger.warning("tracking: wandb log failed (%s); nothing more goes to wandb in this "
                           "run (metrics.jsonl keeps every step)", _why(exc))

    def _finish(self, failed: bool) -> None:
        # finish() returns once wandb-core has handled the exit record, but the run's .wandb
        # log is flushed only when wandb-core closes the run's stream, which finish() does
        # not wait for (measured: 4 of 30 runs had only the 7-byte header on disk when it
        # returned). teardown() waits for the service process to exit, so the log is whole
        # before close() uploads it. A later run in this process starts a new service.
        # Either failing is a warning: close() still uploads what was written.
        # finish() with no exit code records 0: a run that died on NaN looked successful.
        finish = functools.partial(self._run.finish, exit_code=1 if failed else 0)
        for what, call in (("finish", finish), ("teardown", self._wandb.teardown)):
            try:
                call()
            except Exception as exc:
                logger.warning("tracking: wandb %s failed (%s)", what, _why(exc))

    def _uploads(self) -> list[tuple[str, str]]:
        # Only this run's own dir: wandb/ also holds `latest-run` and log symlinks, which
        # the copy would follow and upload a second time.
        run_dir = os.path.dirname(self._run.dir)
        rel = os.path.relpath(run_dir, self.local_dir)
        return [(run_dir, storage.join(self.remote_uri, rel))]


def tracking_problem(tracking: TrackingSection) -> str | None:
    """Why the tracker cannot start, as one line naming the key, found before Ray: wandb
    online with no API key wherever wandb looks (WANDB_API_KEY, the ~/.netrc entry
    ``wandb login`` writes, its settings file) failed in the rank-0 worker once the run
    had started, with a stack trace. Asked of wandb itself, so a key it would find is
    never refused; a wandb without that function is not checked."""
    if tracking.backend != "wandb" or tracking.wandb_mode != "online":
        return None
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:
        return None
    host = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        found = authenticate_session(host=host, source="raylora", prompt=False,
                                     update_session=False)
    except AuthenticationError as exc:  # a key in the wrong format
        return f"tracking.backend: wandb: {exc}"
    except TypeError:  # another signature: not checked here
        return None
    if found is None:
        return (f"tracking.backend: wandb finds no API key for {host} here: set "
                "WANDB_API_KEY (it reaches the workers as a secret) or run `wandb login`, "
                "or set tracking.wandb_mode: offline and `wandb sync` the run afterwards")
    return None


def open_tracker(tracking: TrackingSection, output_uri: str, config: dict,
                 store: Storage | None = None, start_step: int = 0) -> Tracker:
    """The tracker ``tracking.backend`` asks for, writing under ``{output_uri}/tracking``.

    ``config`` is the job's config tree (recorded by wandb; must hold no secrets, and the
    config never does: credentials come from the environment). ``store`` reaches a remote
    output; default ``Storage()``. ``start_step``: the step a resumed run restarts from
    (0: a fresh run). A backend that fails to start is a warning and the ``none`` tracker.
    """
    if tracking.backend == "none":
        return Tracker()
    target = storage.join(output_uri, "tracking")
    store = store or Storage()
    if storage.is_local(output_uri):
        local_dir, remote_uri = storage.local_path(target), None
    else:
        local_dir, remote_uri = tempfile.mkdtemp(prefix="raylora-track-"), target
    try:
        if tracking.backend == "tensorboard":
            return TensorBoardTracker(local_dir, remote_uri, store, start_step)
        run_name = tracking.run_name or storage.normalize(output_uri).rstrip("/").rsplit("/", 1)[-1]
        return WandbTracker(tracking, run_name, wandb_run_id(target, store), config,
                            local_dir, remote_uri, store)
    except Exception as exc:
        logger.warning("tracking: %s could not start (%s); training goes on without it "
                       "(metrics.jsonl keeps every step)", tracking.backend, _why(exc))
        if remote_uri is not None:
            shutil.rmtree(local_dir, ignore_errors=True)
        return Tracker()


def wandb_run_id(tracking_uri: str, store: Storage) -> str:
    """The wandb run id of one output, kept in ``{tracking_uri}/wandb-run-id``: made on
    first use, read back by every later start on that output.

    Random rather than a hash of the URI: wandb refuses an id whose run was deleted, and
    two people writing to the same path in one project would share a run."""
    uri = storage.join(tracking_uri, "wandb-run-id")
    if store.exists(uri):
        return store.read_bytes(uri).decode().strip()
    run_id = secrets.token_hex(4)  # 8 characters, like wandb's own ids
    # Written now, not at the next sync: a restart before the first checkpoint must find it.
    store.write_bytes(uri, run_id.encode())
    return run_id


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (NaN and inf kept: a diverging loss is
    exactly what the curve should show). numpy and torch scalars become Python floats."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, numbers.Real):
            out[name] = float(value)
            continue
        try:  # numpy / torch scalars and one-element arrays
            value = value.item()
        except (AttributeError, ValueError, RuntimeError, TypeError):
            continue
        if isinstance(value, numbers.Real):
            out[name] = float(value)
    return out


def _why(exc: Exception) -> str:
    """One line about a tracker's failure, for a log: the type and the message's first line,
    any WANDB_API_KEY value in it masked."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


def _check_captions(images: list, captions: list[str]) -> None:
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
