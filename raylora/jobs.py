"""`raylora submit | status | logs | stop | list`: runs on a Ray cluster through Ray's Job
Submission SDK (the dashboard's HTTP API), from a laptop that only reaches the dashboard.

Address: ``--address``, else ``RAY_ADDRESS`` (a ``host:port`` GCS address is turned into
the dashboard's URL by the SDK; give ``http://host:8265`` when the GCS is not reachable).
Token auth: with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (or ``RAY_AUTH_TOKEN``)
set, as ``cluster/local-up.sh``'s env file sets them, ``client`` sends ``Authorization:
Bearer`` itself (``_auth_headers``): the SDK's own ``get_auth_headers_if_auth_enabled``
follows Ray's process-wide auth mode, fixed at Ray's first use in the process, and a head
started with token auth answers 401 without it (Ray 2.60).

A job is ``python -m raylora train CONFIG OVERRIDES`` (``tune`` for a config with a
``tune:`` section) run in the shipped working dir (what of it Ray ships: ``Shipping``; a
relative path to what it ships stays relative, the rest goes absolute: ``path_overrides``),
with what a ``--runtime-env`` file adds (pip, uv, conda, env_vars: ``runtime_env``),
tagged ``raylora_*`` in the job's metadata (config name, command, output URI, max steps)
so that ``status`` can read the run's own ``progress.json`` and ``list`` can name the config.
Storage settings (endpoint, region) travel as the job's ``runtime_env`` ``env_vars``.
Credentials do not, and never go in the entrypoint: Ray's runtime-env agent writes a job's
env_vars to its log on the head (``runtime_env_agent.log``) and the dashboard shows them
to anyone who can read it (``ray job list``). They travel as a package of their own in the
runtime_env's ``py_modules`` (``raylora.jobsecrets``); the job's driver reads it first
thing and hands the credentials on as an embedded or joined run does
(``launch.job_runtime_env``). Credentials the cluster has itself (an instance role, a
Kubernetes Secret) need none of this.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import tempfile
import time
from pathlib import Path

from raylora import jobsecrets, storage
from raylora.progress import PROGRESS_FILE

# Not shipped with the working dir: environments, VCS, outputs, weights.
EXCLUDES = [".git", ".venv", "venv", "runs", ".ray-local", "**/__pycache__", ".pytest_cache",
            "*.safetensors", "*.ckpt", "*.pt", "*.bin"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
META = "raylora_config"
COMMAND = "raylora_command"  # train | tune (absent: train, jobs of raylora before it)
STORAGE = "raylora_storage"  # the config's storage section (endpoint, region), when set


def _auth_headers() -> dict:
    """The head's token as a header, read here: the SDK adds it itself only when Ray's
    process-wide config, fixed at its first use in a process, says token auth; a process
    that touched Ray before RAY_AUTH_MODE was set (tests, notebooks) would send none."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if not token and os.path.isfile(path):
        with open(path) as f:
            token = f.read().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    from raylora import quiet
    from raylora.launch import ray_address_problem

    quiet.apply()  # again: importing the job SDK set its loggers to INFO

    given = address or os.environ.get("RAY_ADDRESS")
    # A GCS address with no cluster behind it: the SDK waited 40 s, then a stack trace.
    if given and (problem := ray_address_problem(given, "--address" if address else "RAY_ADDRESS",
                                                 dashboard=True)):
        raise ValueError(problem)
    return JobSubmissionClient(given, headers=_auth_headers())


def command(cfg):
    """(CLI command, its launch.Setup) that runs a config: a ``tune:`` section makes it a
    search (`raylora tune`), else one run (`raylora train`)."""
    from raylora import launch

    if cfg.tune is not None:
        from raylora.tune import search_setup

        return "tune", search_setup()
    return "train", launch.TRAIN


class Shipping:
    """What Ray packs of the working dir, answered as Ray's packaging decides it
    (``ray._private.runtime_env.packaging._dir_travel``, with its own matchers): its default
    excludes then the runtime_env's ``excludes``, matched against the path below the working
    dir, and each folder's ``.gitignore`` (unless ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``)
    and ``.rayignore`` against the path below that folder, from that folder down. A path
    a rule matches is not looked into. Asked here, before the upload: a config or a data
    folder that Ray leaves out is known before the job fails on its absence."""

    def __init__(self, working_dir: str, excludes=(), excludes_from: str = "--runtime-env"):
        from ray._private import ray_constants
        from ray._private.runtime_env import packaging

        self.working_dir = working_dir
        self.root = Path(os.path.abspath(working_dir))
        defaults = ray_constants.get_runtime_env_default_excludes()
        # The runtime_env's excludes are EXCLUDES, then a --runtime-env file's.
        self.rules = [*defaults, *EXCLUDES, *excludes]
        self.sources = (["Ray's default excludes (RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES)"] * len(defaults)
                        + ["raylora submit's excludes (raylora.jobs.EXCLUDES)"] * len(EXCLUDES)
                        + [f"the excludes of {excludes_from}"] * len(excludes))
        self._match = packaging._get_excludes(self.root, self.rules)
        self._ignore_file = packaging._get_ignore_file
        self.names = [".gitignore", ".rayignore"]
        if os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") == "1":
            self.names = [".rayignore"]

    def _ignores(self, folder: Path) -> list:
        """The matchers of ``folder``'s own ignore files (Ray's ``get_excludes_from_ignore_files``)."""
        return [(m, folder / n) for n in self.names if (m := self._ignore_file(folder, n))]

    def _why(self, path: Path, active: list) -> str | None:
        for match, source in active:
            if match(path):
                return self._rule(path, source)
        return None

    def _rule(self, path: Path, source: Path | None) -> str:
        """``'RULE' in SOURCE``: the last rule that matches (git's order; a later ``!rule``
        would have let the path through)."""
        from ray._private.thirdparty.pathspec import PathSpec

        if source is None:
            rules, names, base = self.rules, self.sources, self.root
        else:
            with open(source) as f:
                rules = [line.rstrip("\n") for line in f]
            names, base = [f"{source} (line {i + 1})" for i in range(len(rules))], source.parent
        rel = str(path.relative_to(base))
        found = "?"
        for rule, name in zip(rules, names):
            pats = [p for p in PathSpec.from_lines("gitwildmatch", [rule]).patterns if p.include is not None]
            if pats and list(pats[0].match([rel])):
                found = f"'{rule.strip()}' in {name}" if pats[0].include else "?"
        return found

    def skipped(self, path: str) -> str | None:
        """Why ``path`` (inside the working dir) does not travel whole with it: ``PATH is
        excluded by 'RULE' in SOURCE`` for it, a folder above it or (a folder) a path below
        it; None when it all ships."""
        target = Path(os.path.abspath(path))
        node, active = self.root, [(self._match, None)]
        for part in ("", *target.relative_to(self.root).parts):
            node = node / part if part else node
            active = [*active, *self._ignores(node)]
            if why := self._why(node, active):
                return f"{os.path.relpath(node, self.root)} is excluded by {why}"
        folders = [(target, active)] if target.is_dir() else []
        while folders:
            folder, above = folders.pop()
            for child in sorted(folder.iterdir()):
                here = [*above, *self._ignores(child)]
                if why := self._why(child, here):
                    return f"{os.path.relpath(child, self.root)} is excluded by {why}"
                if child.is_dir():
                    folders.append((child, here))
        return None

    def relative(self, given: str, resolved: str) -> str | None:
        """What to send for a relative local path ``given`` (absolute here: ``resolved``)
        that the working dir ships whole: ``given`` when it names the same place from the
        working dir (the job's cwd), else the path from there; None when it is outside the
        working dir, missing here, or not all shipped (then it goes absolute)."""
        if not isinstance(given, str) or not storage.is_local(given):
            return None
        plain = given.removeprefix("file://")
        if os.path.isabs(os.path.expanduser(plain)):
            return None
        rel = os.path.relpath(resolved, self.root)
        if rel == ".." or rel.startswith("../"):
            return None
        found = glob.glob(resolved) if glob.has_magic(resolved) else [resolved] * os.path.exists(resolved)
        if not found or any(self.skipped(f) for f in found):
            return None
        return given if os.path.normpath(plain) == rel else "./" + rel

    def config_path(self, config: str) -> str:
        """The config's path from the working dir, where the job reads it; a config
        outside it or left out of it is refused before anything is sent."""
        rel = os.path.relpath(os.path.abspath(config), self.root)
        if rel == ".." or rel.startswith("../"):
            raise ValueError(f"{config}: the config must be inside the working dir {self.working_dir} "
                             "(it is shipped with it); pass --working-dir")
        if why := self.skipped(config):
            raise ValueError(f"{config}: the working dir {self.working_dir} is shipped without it "
                             f"({why}), so the job could not read it; keep the config in a "
                             "folder that is shipped (such as jobs/configs/)")
        return rel


def entrypoint(cmd: str, config: str, overrides: list[str], working_dir: str,
               ship: Shipping | None = None) -> str:
    """The job's command line: ``cmd`` on the config by its path inside the working dir
    (shipped with it: ``Shipping.config_path``)."""
    rel = (ship or Shipping(working_dir)).config_path(config)
    return " ".join(shlex.quote(a) for a in ["python", "-m", "raylora", cmd, rel, *overrides])


# Places the job writes: sent absolute, as submit checked them (a relative one would be
# written into Ray's temporary copy of the working dir, and lost with it).
WRITES = ("output.uri", "data.cache_uri", "train.compile_cache_uri", "data.class_generation.uri")


def path_overrides(given, resolved, ship: Shipping | None = None) -> list[str]:
    """Overrides that make the job read and write what ``submit`` checked here: the values
    ``launch.resolve_paths`` (``resolved``) made absolute in ``given`` (a list such as
    data.sources whole), except a relative path to something the working dir ships whole
    (``ship``, default ``.`` as submit ships it): the job's driver resolves that one
    inside its unpacked copy of the working dir, where it is (an absolute path of this
    machine is not, on a remote head). What it does not ship (runs/, weights: EXCLUDES)
    and every place it writes (``WRITES``) go absolute."""
    from raylora.config import differences

    ship = ship or Shipping(".")
    d = given.data
    writes = set(WRITES)
    # Class images may be generated into {data.class_sources}/raylora-generated (one writable
    # folder: classgen.generated_place): sent absolute, as a place the job writes.
    if d.class_prompt is not None and d.class_generation.uri is None and isinstance(d.class_sources, str):
        writes.add("data.class_sources")

    def sent(key: str, g, r):
        if isinstance(g, dict) and isinstance(r, dict):
            return {k: sent(f"{key}.{k}".lstrip("."), g.get(k), v) for k, v in r.items()}
        if isinstance(g, list) and isinstance(r, list) and len(g) == len(r):
            return [sent(key, a, b) for a, b in zip(g, r)]
        if g != r and isinstance(r, str) and key not in writes and (kept := ship.relative(g, r)):
            return kept
        return r

    now = sent("", given.to_dict(), resolved.to_dict())
    # JSON: the override's YAML reads it back as it was
    return [f"{key}={json.dumps(v)}" for key, _, v in differences(given.to_dict(), now)]


# A --runtime-env file's env var that looks like a credential: Ray logs env_vars on the
# head and `ray job list` shows them (see this module's docstring).
_CREDENTIAL_PARTS = {"SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY"}
_CREDENTIAL_NAMES = ("API_KEY", "ACCESS_KEY", "PRIVATE_KEY", "SECRET")
# Not credentials, though named like them: the path of a key file on the cluster's nodes
# (a mounted Secret: *_FILE, *_PATH, and Google's own name for it; the file is the
# secret, not its path), and switches that turn a credential's use off.
_KEY_FILE_SUFFIXES = ("_FILE", "_PATH")
_KEY_FILE_NAMES = {"GOOGLE_APPLICATION_CREDENTIALS"}
_NOT_CREDENTIALS = {"HF_HUB_DISABLE_IMPLICIT_TOKEN"}


def looks_like_credential(name: str, value=None) -> bool:
    """Whether env var ``name`` (set to ``value``) may hold a secret. A key file's path
    variable counts as one unless its ``value`` is a path (absolute or ~): a token pasted
    into it is still a token."""
    up = name.upper()
    if up in storage.SECRET_ENV_VARS:
        return True
    if up in _NOT_CREDENTIALS:
        return False
    if up.endswith(_KEY_FILE_SUFFIXES) or up in _KEY_FILE_NAMES:
        return not (isinstance(value, str) and value.startswith(("/", "~")))
    return bool(_CREDENTIAL_PARTS & set(up.split("_"))) or any(n in up for n in _CREDENTIAL_NAMES)


def load_runtime_env(path: str, working_dir: str) -> dict:
    """A ``--runtime-env`` file (YAML, as ``ray job submit --runtime-env`` reads it, e.g.
    jobs/runtime_env.yaml): its fields, checked here as Ray checks them (``RuntimeEnv``:
    types, pip/uv/conda together) before anything is sent. Refused: a field Ray does not
    know, a ``working_dir`` other than ``--working-dir``, the driver's own
    ``worker_process_setup_hook``, and env_vars that look like credentials."""
    import yaml
    from ray.runtime_env import RuntimeEnv

    from raylora.config import yaml_text

    try:
        doc = yaml.safe_load(yaml_text(path))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the runtime_env file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({exc})".replace("\n", " ")) from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a runtime_env file is a mapping of runtime_env fields "
                         f"(pip, env_vars, ...), not a {type(doc).__name__}")
    known = sorted(k for k in RuntimeEnv.known_fields if not k.startswith("_"))
    for key in doc:
        if key not in known:
            raise ValueError(f"{path}: {key}: not a runtime_env field Ray knows ({', '.join(known)})")
    wd = doc.pop("working_dir", None)
    if wd is not None and (not isinstance(wd, str) or os.path.abspath(wd) != os.path.abspath(working_dir)):
        raise ValueError(f"{path}: working_dir: raylora submit ships --working-dir ({working_dir}); "
                         f"remove working_dir from the file, or pass --working-dir {wd}")
    if "worker_process_setup_hook" in doc:
        raise ValueError(f"{path}: worker_process_setup_hook: raylora's job driver sets its own "
                         "for its workers (launch.job_runtime_env); remove it from the file")
    env = doc.get("env_vars") or {}
    for key, value in env.items() if isinstance(env, dict) else []:
        if looks_like_credential(str(key), value):
            raise ValueError(
                f"{path}: env_vars.{key}: looks like a credential, and Ray writes a job's env_vars "
                "to its log on the head and shows them in `ray job list` and the dashboard; "
                "remove it. raylora submit sends " + ", ".join(storage.SECRET_ENV_VARS) + " from "
                "this shell's environment apart from env_vars (raylora.jobsecrets): export it "
                "here instead; for others give the cluster its own (a Kubernetes Secret, an "
                "instance role). A *_FILE or *_PATH variable naming a key file on the nodes "
                "(an absolute path) is fine")
    try:
        RuntimeEnv(**doc)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}".replace("\n", " ")) from None
    return doc


# Why submit sets these env_vars itself (a --runtime-env file may not set them otherwise).
_OWN_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": "failure.stop_timeout_s + 30: change failure.stop_timeout_s",
            jobsecrets.ENV: "it marks the credentials package"}


def runtime_env(cfg, working_dir: str, scratch: str | None, extra: dict | None = None,
                source: str = "--runtime-env") -> dict:
    """Working dir + the env the job's driver needs: storage settings, credentials
    (``storage.forwarded_env``; the driver hands them on to its workers itself) as a
    package written under ``scratch`` (None: checked, not written), quiet logging, and
    Ray's job-stop grace as long as a clean stop may take; merged with ``extra``, the
    fields of a ``--runtime-env`` file (``load_runtime_env``): its pip/uv/conda and the rest
    as they are, its excludes after EXCLUDES, its py_modules before the credentials
    package, its env_vars beside submit's own (one that submit sets to another value is
    refused: ``source`` names the file)."""
    from raylora import quiet

    extra = dict(extra or {})
    plain, creds = storage.split_secrets(storage.forwarded_env())
    env = {**plain, **quiet.worker_env()}
    if quiet.verbose():
        env[quiet.VERBOSE_ENV] = "1"
    # `raylora stop` → stop_job → SIGTERM to the driver, which stops the run at a step
    # with a checkpoint; Ray SIGKILLs a driver still running after this many seconds.
    env["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(cfg.failure.stop_timeout_s) + 30)
    if creds:
        env[jobsecrets.ENV] = "1"
    theirs = extra.pop("env_vars", None) or {}
    for key, value in theirs.items():
        if key in env and env[key] != value:
            why = _OWN_ENV.get(key, "from this shell's environment: set it there")
            raise ValueError(f"{source}: env_vars.{key}: raylora submit sets it to {env[key]!r} "
                             f"({why}); remove it from the file")
    renv = {**extra, "working_dir": working_dir, "excludes": [*EXCLUDES, *(extra.get("excludes") or [])],
            "env_vars": {**theirs, **env}}
    if creds and scratch is not None:
        renv["py_modules"] = [*(extra.get("py_modules") or []), jobsecrets.write_package(creds, scratch)]
    return renv


def _status_code(exc: Exception) -> int | None:
    """The HTTP status of the SDK's failed request (it raises RuntimeError("Request failed
    with status code N: BODY.") for every answer but 200); None for another error."""
    import re

    m = re.match(r"Request failed with status code (\d+)", str(exc))
    return int(m[1]) if m and isinstance(exc, RuntimeError) else None


def sdk_problem(exc: Exception, job: str | None) -> tuple[str, int] | None:
    """(one line, exit code) for the SDK's failed request: a job id the cluster does not
    know is bad input (2); any other answer is the cluster's (1), told by the last line of
    its body (a server-side traceback's error). None: not the SDK's error."""
    code = _status_code(exc)
    if code is None:
        return None
    if code == 404 and job:
        return f"{job}: no job with this id on the cluster (`raylora list` names raylora's jobs)", 2
    body = str(exc).split(":", 1)[1].strip()
    last = [line for line in body.splitlines() if line.strip().strip(".")]
    why = (last[-1] if last else body).strip().rstrip(".")
    hint = ("; a head with token auth needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH or "
            "RAY_AUTH_TOKEN") if code == 401 else ""
    return f"the cluster's job API answered {code}: {why}{hint}", 1


def refuse_taken(c, job: str) -> None:
    """Refuse a ``--job-id`` the cluster already has, before the checks and the upload
    (Ray refused it only then, in a 36-line traceback)."""
    try:
        info = c.get_job_info(job)
    except RuntimeError as exc:
        if _status_code(exc) == 404:
            return
        raise
    raise ValueError(f"--job-id {job}: the cluster already has a job with this id "
                     f"({info.status.value}); a job id is used once: pass another id or "
                     "omit --job-id (Ray makes one). To resume that job's run, submit the "
                     "same config under a new id: it resumes from the last checkpoint in "
                     "its output.uri")


def submit(config: str, overrides: list[str], address: str | None = None,
           working_dir: str = ".", submission_id: str | None = None,
           runtime_env_file: str | None = None) -> str:
    """Check the config here as its command checks it before Ray (``command``: plan,
    resume, memory where the GPUs are known here), then submit it; returns the job id.
    What needs no data (the ``--runtime-env`` file, that the working dir ships the
    config, a ``submission_id`` the cluster already has) is refused first."""
    from raylora import launch
    from raylora.config import load_config

    extra = load_runtime_env(runtime_env_file, working_dir) if runtime_env_file else {}
    ship = Shipping(working_dir, extra.get("excludes") or [], runtime_env_file or "--runtime-env")
    ship.config_path(config)
    cfg = load_config(config, overrides)
    cmd, setup = command(cfg)
    runtime_env(cfg, os.path.abspath(working_dir), None, extra, runtime_env_file)  # conflicts
    # The client reaches the cluster: a job id is checked there before the checks here,
    # which otherwise come first (a broken checkpoint is exit 2 with no cluster up).
    c = client(address) if submission_id else None
    if submission_id:
        refuse_taken(c, submission_id)
    # remote: the job's GPUs are the cluster's (read by its driver there), never this
    # machine's, whether the address came from --address or RAY_ADDRESS
    r = launch.checked(cfg, setup, remote=True)
    c = c or client(address)
    overrides = [*overrides, *path_overrides(cfg, launch.resolve_paths(cfg), ship)]
    meta = {META: os.path.basename(config), COMMAND: cmd, "raylora_output": r.cfg.output.uri,
            "raylora_max_steps": str(r.plan.max_steps)}
    # how `status` reaches the output (a config's storage.endpoint_url, not only AWS_*)
    reach = {k: v for k, v in cfg.storage.model_dump().items() if v}
    if reach:
        meta[STORAGE] = json.dumps(reach)
    # The SDK uploads the credentials package within submit_job; nothing of it stays here.
    with tempfile.TemporaryDirectory(prefix="raylora-submit-") as scratch:
        return c.submit_job(
            entrypoint=entrypoint(cmd, config, overrides, working_dir, ship), submission_id=submission_id,
            runtime_env=runtime_env(cfg, os.path.abspath(working_dir), scratch, extra, runtime_env_file),
            metadata=meta,
        )


class ProgressUnreadable(Exception):
    """``{output}/progress.json`` is there to read, or may be, but not from this machine
    (a store only the cluster reaches, expired or missing keys, a 403): the message says
    which file and why, with no credential in it."""


# `status` reads one small file: an answer in seconds, not the minute and a half the
# training side's retries (storage.S3_ATTEMPTS, each read again by retried_read) take
# to give up on an endpoint this machine cannot reach.
STATUS_READ_ATTEMPTS = 2
STATUS_READ_TIMEOUT_S = 3


def _quick_fs(fs):
    """``fs`` (a ``Storage.fs``'s) with few retries and short timeouts, for one read."""
    import datetime

    import pyarrow.fs as pafs

    if isinstance(fs, storage.RetryingS3):
        return pafs.S3FileSystem(
            **{**fs.kwargs, "connect_timeout": STATUS_READ_TIMEOUT_S, "request_timeout": 10},
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=STATUS_READ_ATTEMPTS))
    if isinstance(fs, pafs.GcsFileSystem):
        # its settings are public only as what it pickles (storage._gcs: emulator, project)
        rebuild, (kwargs,) = fs.__reduce__()
        return rebuild({**kwargs, "retry_time_limit": datetime.timedelta(seconds=STATUS_READ_TIMEOUT_S)})
    return fs


def _read_progress(uri: str, reach: dict) -> dict | None:
    """``uri``'s JSON; None when it is not there yet (no step) or is being replaced."""
    try:
        fs, path = storage.Storage(reach.get("endpoint_url"), reach.get("region")).fs(uri)
        with _quick_fs(fs).open_input_stream(path) as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: a storage setting refused (endpoint URL)
        why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        # an SDK's message may quote a key it was given: never print one
        for name in storage.SECRET_ENV_VARS:
            if len(secret := os.environ.get(name) or "") >= 4:
                why = why.replace(secret, f"<{name}>")
        raise ProgressUnreadable(f"{uri} is not readable from here ({why}); the run's progress "
                                 "lines are in `raylora logs`") from None
    try:
        return json.loads(data)
    except ValueError:  # not whole yet (a store without atomic replace): the next read has it
        return None


def _in_job_time(row, info) -> bool:
    """Whether ``row`` (a progress line) was written while the job ran. Jobs of one config
    share the file (a stopped job and the one resuming it): a line written outside this
    job's time is the other's (Ray's times in ms; 5 s of slack). A row with no time: kept."""
    t = row.get("time") if isinstance(row, dict) else None
    start, end = getattr(info, "start_time", None), getattr(info, "end_time", None)
    return not (isinstance(t, (int, float)) and ((start and t < start / 1000 - 5)
                                                 or (end and t > end / 1000 + 5)))


def last_progress(info) -> dict | None:
    """The run's ``{output}/progress.json`` (the driver's last progress line: step, loss,
    ETA; a search's ``{"trials": {label: row}}``; ``raylora.progress``), read through
    raylora.storage, local or object storage, as far as this job wrote it (a search: the
    trials' rows it wrote). None before the first step. Raises ``ProgressUnreadable``
    when the file cannot be read from here."""
    meta = info.metadata or {}
    out = meta.get("raylora_output")
    if not out:
        return None
    row = _read_progress(storage.join(out, PROGRESS_FILE), json.loads(meta.get(STORAGE) or "{}"))
    if isinstance(row, dict) and isinstance(row.get("trials"), dict):
        # each trial's row has its own time (written as it came): judged one by one
        trials = {label: r for label, r in row["trials"].items() if _in_job_time(r, info)}
        return {**row, "trials": trials} if trials else None
    return row if _in_job_time(row, info) else None


def status(job: str, address: str | None = None) -> tuple[str, str | None]:
    """(job state, the run's last progress line or None). A search has no one line (its
    trials run side by side, each its own run): each trial's latest line, one per line,
    after a line saying where all of them and Tune's trial table are."""
    info = client(address).get_job_info(job)
    try:
        row = last_progress(info)
    except ProgressUnreadable as exc:
        row, unreadable = None, str(exc).replace("`raylora logs`", f"`raylora logs {job}`")
    else:
        unreadable = None
    if (info.metadata or {}).get(COMMAND) == "tune":
        trials = (row or {}).get("trials") or {}
        lines = [f"a search (raylora tune): each trial's progress lines and Tune's trial table "
                 f"are in `raylora logs {job}`"]
        lines += [unreadable] if unreadable else []
        lines += [r["line"].removeprefix("raylora: ") for _, r in sorted(trials.items())]
        return str(info.status.value), "\nraylora: ".join(lines)
    line = row["line"].removeprefix("raylora: ") if row else unreadable
    return str(info.status.value), line


def stop(job: str, address: str | None = None, timeout_s: float = 600) -> str:
    """Ask the job to stop cleanly (its driver gets SIGTERM: the run stops at the next step
    with a checkpoint); wait for a terminal state. Ray itself SIGKILLs a driver still
    running after ``RAY_JOB_STOP_WAIT_TIME_S`` (set by ``submit``), so this is bounded."""
    c = client(address)
    c.stop_job(job)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = str(c.get_job_status(job).value)
        if state in TERMINAL:
            return state
        time.sleep(1)
    return str(c.get_job_status(job).value)


def stopped_line(job: str, state: str, line: str | None) -> str:
    """What `raylora stop` prints: the job's state and its run's last progress line. A
    job STOPPED whose run had finished (``progress.FINISHED``: the stop came in the
    seconds its driver takes to exit after writing the adapter) says so: nothing is left
    to resume, though Ray records the job as stopped."""
    from raylora.progress import FINISHED

    if state == "STOPPED" and (line or "").startswith(FINISHED):
        line += " (the stop came after that: nothing to resume)"
    return f"raylora: job {job} {state}" + (f"; {line}" if line else "")


def follow_logs(job: str, address: str | None, out, wait_s: float = 10) -> str:
    """Print the job's log as it grows (the SDK's websocket tail) until the job ends;
    returns its final state (the tail may close a moment before the state is recorded)."""
    import asyncio

    c = client(address)
    c.get_job_info(job)  # an unknown id: the SDK's 404, not a websocket that says nothing

    async def tail() -> None:
        async for chunk in c.tail_job_logs(job):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())
    deadline = time.monotonic() + wait_s
    state = str(c.get_job_status(job).value)
    while state not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        state = str(c.get_job_status(job).value)
    return state


def list_jobs(address: str | None = None) -> list[dict]:
    """raylora's jobs on the cluster, oldest first."""
    rows = []
    for j in client(address).list_jobs():
        meta = j.metadata or {}
        if META not in meta:
            continue
        rows.append({"job": j.submission_id, "state": str(j.status.value), "config": meta[META],
                     "command": meta.get(COMMAND, "train"), "start_time": j.start_time or 0})
    return sorted(rows, key=lambda r: r["start_time"])
