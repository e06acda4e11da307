"""Quiet by default: what Ray and the model libraries print that a user cannot act on.

A `make demo` used to print ~100 lines: Ray Train's ``TrainingReport(...)`` dump and
``Checkpoint successfully created`` per report per worker, Ray Data's execution plan and
``execution finished`` lines, bitsandbytes' missing-kernel warning in every process,
transformers/diffusers advisories and "Loading weights" bars. They are silenced here;
warnings and errors from everything else still show. ``--verbose`` on the CLI or
``RAYLORA_VERBOSE=1`` turns all of it back on.

Every knob is one the library itself reads (an env var, a logger's level, Ray Train's
``LoggingConfig``); the Ray worker processes get them through the job's runtime_env
(``env_vars`` + ``worker_process_setup_hook``, see ``launch.job_runtime_env``).
"""

from __future__ import annotations

import logging
import os
import re
import sys

VERBOSE_ENV = "RAYLORA_VERBOSE"

# Read by the libraries when they are imported: set before that, in every process.
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",  # torchvision fallback advisories, load reports
    "DIFFUSERS_VERBOSITY": "error",  # "No LoRA keys associated to CLIPTextModel ..."
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars
    # Ray Data's per-operator bars never draw in a job log; its summary lines are below.
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
}

# Loggers whose INFO (or warnings) are routine here; their errors still show.
QUIET_LOGGERS = {
    # Warns at import, in every process, that an optional 4-bit CPU kernel is missing.
    "bitsandbytes": logging.ERROR,
    # "Starting execution", "Execution plan", "execution finished": one set per dataset.
    # Ray Data configures only its "ray.data" logger, so a level set on a child stays.
    "ray.data._internal": logging.WARNING,
    "ray.data._internal.progress": logging.ERROR,  # "Progress bars disabled. To enable..."
    # "Token authentication is enabled for this Ray cluster" on every local start.
    "ray._private.authentication": logging.ERROR,
    # huggingface_hub's client logs every request's URL at INFO ("HTTP Request: GET ..."):
    # 45 lines for a tiny hub model's run, and a mirror's password with each where
    # HF_ENDPOINT carries one (https://user:pass@mirror).
    # (huggingface_hub 2.x's client is httpx2; httpx for the other clients)
    **{name: logging.WARNING for name in ("httpx2", "httpcore2", "httpx", "httpcore")},
    # `raylora submit`, through Ray's job SDK, at every submit: "Ignoring upload to cluster
    # for these files: [.gitignore]" (the file it reads rules from, which it does upload),
    # "Creating a file package ...", "Uploading package gcs://...", and the job commands'
    # "WebSocket closed for job ...". Failures still show. The SDK's modules set INFO on
    # their loggers when imported: raylora.jobs.client applies these again after that.
    "ray._private.runtime_env.packaging": logging.WARNING,
    "ray.dashboard.modules.dashboard_sdk": logging.WARNING,
    "ray.dashboard.modules.job.sdk": logging.WARNING,
}


# Ray Train's logger of a worker's error and its traceback ("Error in training function"),
# on every rank that raised.
TRAIN_FN_ERROR_LOGGER = "ray.train.v2._internal.util"
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


class RepeatedErrorTraceback(logging.Filter):
    """Drops Ray Train's "Error in training function" traceback of an error that a
    restart would repeat (``restart_repeats``: data over data.max_bad_fraction, a loss
    that stayed NaN/inf, a data stream that ended early). The run ends on it, and the
    driver prints it as one line naming the rank and the cause (``raylora.entry``): the
    ranks' tracebacks before that line said nothing more, twice. Any other error keeps
    its traceback (a bug, a lost peer: there it is the evidence)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith("Error in training function"):
            return True
        for line in reversed(text.rstrip().splitlines()):  # the last exception raised
            match = _EXCEPTION_LINE.match(line)
            module, _, name = match.group(1).rpartition(".") if match else ("", "", "")
            error = getattr(sys.modules.get(module or "builtins"), name, None)
            if isinstance(error, type) and issubclass(error, BaseException):
                return not getattr(error, "restart_repeats", False)
        return True


# The HTTP clients' loggers, whose request lines name each URL whole.
URL_LOGGERS = ("httpx2", "httpx")


class MaskedURLs(logging.Filter):
    """A URL's user and password left out of the record (``storage.masked``): with
    ``--verbose`` the hub client's request lines show again, and each named a mirror's
    ``https://user:pass@...`` (an ``HF_ENDPOINT`` that carries one) whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        from raylora.storage import masked

        try:
            text = record.getMessage()
        except Exception:  # a record that cannot format itself is logging's to report
            return True
        if masked(text) != text:
            record.msg, record.args = masked(text), None
        return True


class DropsMessage(logging.Filter):
    """Drops a logger's records whose message holds ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.text not in record.getMessage()
        except Exception:  # a record that cannot format itself is logging's to report
            return True


WORKING_DIR_LOGGER = "ray._private.runtime_env.working_dir"
# Logger → the text of a message of it a user cannot act on:
DROPPED_MESSAGES = {
    # Ray Tune's "Experiment has been interrupted, but the most recent state was saved.
    # Resume experiment with: Tuner.restore(path=..., trainable=...)": after Ctrl-C or
    # `raylora stop` on a search, a Python call the user does not make (the same `raylora
    # tune` command resumes the search, as the driver's own last line says).
    "ray.tune.tune": "Tuner.restore(",
    # Ray's job SDK, at every submit: `.git` and `.venv` are "now ignored by default when
    # packaging the working directory"; raylora submit leaves both out itself
    # (raylora.jobs.EXCLUDES), whatever Ray's defaults.
    WORKING_DIR_LOGGER: "is now ignored by default when packaging",
}


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def ray_train_log_level() -> str:
    """For ``ray.train.LoggingConfig``: its INFO lines are the per-report dumps."""
    return "INFO" if verbose() else "WARNING"


def apply() -> None:
    """Quiet this process (driver or Ray worker) unless verbose. Env vars are set only
    where the user set none, so an explicit ``TRANSFORMERS_VERBOSITY=info`` wins. URLs'
    passwords are masked in the HTTP clients' lines, verbose or not."""
    for name in URL_LOGGERS:
        named = logging.getLogger(name)
        if not any(isinstance(f, MaskedURLs) for f in named.filters):
            named.addFilter(MaskedURLs())
    if verbose():
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger(_train_context_logger()).setLevel(logging.WARNING)
    errors = logging.getLogger(TRAIN_FN_ERROR_LOGGER)
    if not any(isinstance(f, RepeatedErrorTraceback) for f in errors.filters):
        errors.addFilter(RepeatedErrorTraceback())
    for name, text in DROPPED_MESSAGES.items():
        named = logging.getLogger(name)
        if not any(isinstance(f, DropsMessage) and f.text == text for f in named.filters):
            named.addFilter(DropsMessage(text))


def _train_context_logger() -> str:
    """Ray Train's "Reporting training result N: TrainingReport(...)" logger is named by
    its file's path (``getLogger(__file__)``), so it is outside ``ray.train`` and its
    LoggingConfig, and propagates to the worker's root logger."""
    import ray

    return os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution",
                        "context.py")


def worker_env() -> dict[str, str]:
    """``env_vars`` for the job's runtime_env: the quiet settings, or the verbose flag."""
    if verbose():
        return {VERBOSE_ENV: "1"}
    return {k: os.environ.get(k, v) for k, v in QUIET_ENV.items()}


def diffusers_bars_off() -> None:
    """diffusers reads no env var for its bars ("Loading pipeline components")."""
    if not verbose():
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
