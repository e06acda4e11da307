"""`raylora submit | status | logs | stop | list`: runs on a Ray cluster through Ray's Job
Submission SDK (the dashboard's HTTP API), from a laptop that only reaches the dashboard.

Address: ``--address``, else ``RAY_ADDRESS`` (a ``host:port`` GCS address is turned into
the dashboard's URL by the SDK; give ``http://host:8265`` when the GCS is not reachable).
Token auth: with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (or ``RAY_AUTH_TOKEN``)
set, as ``cluster/local-up.sh``'s env file sets them, ``client`` sends ``Authorization:
Bearer`` itself (``_auth_headers``): the SDK's own ``get_auth_headers_if_auth_enabled``
follows Ray's process-wide auth mode, fixed at Ray's first use in the process, and a head
started with token auth answers 401 without it (Ray 2.60).

A job is ``python -m raylora train CONFIG OVERRIDES`` run in the shipped working dir,
tagged ``raylora_*`` in the job's metadata (config name, output URI, max steps) so that
``status`` can read the run's own ``progress.json`` and ``list`` can name the config.
Storage settings (endpoint, region) travel as the job's ``runtime_env`` ``env_vars``.
Credentials do not, and never go in the entrypoint: Ray's runtime-env agent writes a job's
env_vars to its log on the head (``runtime_env_agent.log``) and the dashboard shows them
to anyone who can read it (``ray job list``). They travel as a package of their own in the
runtime_env's ``py_modules`` (``SECRETS_PACKAGE``), which the SDK uploads to the cluster's
internal store; the dashboard and the logs show only its ``gcs://`` URI. The job's driver
reads and deletes the file first thing (``load_job_secrets``), keeps the package from its
workers, and hands the credentials on as an embedded or joined run does
(``launch.job_runtime_env``). Credentials the cluster has itself (an instance role, a
Kubernetes Secret) need none of this.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import sys
import tempfile
import time

from raylora import storage
from raylora.progress import PROGRESS_FILE

# Not shipped with the working dir: environments, VCS, outputs, weights.
EXCLUDES = [".git", ".venv", "venv", "runs", ".ray-local", "**/__pycache__", ".pytest_cache",
            "*.safetensors", "*.ckpt", "*.pt", "*.bin"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
META = "raylora_config"


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

    return JobSubmissionClient(address or os.environ.get("RAY_ADDRESS"), headers=_auth_headers())


def entrypoint(config: str, overrides: list[str], working_dir: str) -> str:
    """The job's command: the config by its path inside the working dir (shipped with it)."""
    rel = os.path.relpath(os.path.abspath(config), os.path.abspath(working_dir))
    if rel.startswith(".."):
        raise ValueError(f"{config}: the config must be inside the working dir {working_dir} "
                         "(it is shipped with it); pass --working-dir")
    return " ".join(shlex.quote(a) for a in ["python", "-m", "raylora", "train", rel, *overrides])


# The job's credentials: a package named this in its py_modules, holding SECRETS_FILE; the
# job's env_vars say SECRETS_ENV=1 so that its driver looks for it.
SECRETS_PACKAGE = "_raylora_job_secrets"
SECRETS_FILE = "env.json"
SECRETS_ENV = "RAYLORA_JOB_SECRETS"


def _secrets_package(creds: dict[str, str], into: str) -> str:
    """Write the credentials package under ``into`` (a private temp dir); returns its path."""
    pkg = os.path.join(into, SECRETS_PACKAGE)
    os.mkdir(pkg, 0o700)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    fd = os.open(os.path.join(pkg, SECRETS_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        # A nonce per submission: Ray keeps an unpacked package by its content's hash, and
        # the driver deletes this file once read, so two jobs with the same credentials
        # must not share one copy.
        json.dump({"nonce": secrets.token_hex(16), "env": creds}, f)
    return pkg


def runtime_env(cfg, working_dir: str, scratch: str) -> dict:
    """Working dir + the env the job's driver needs: storage settings, credentials
    (``storage.forwarded_env``; the driver hands them on to its workers itself) as a
    package written under ``scratch``, quiet logging, and Ray's job-stop grace as long as a
    clean stop may take."""
    from raylora import quiet

    forwarded = storage.forwarded_env()
    creds = {k: v for k, v in forwarded.items() if k in storage.SECRET_ENV_VARS}
    env = {**{k: v for k, v in forwarded.items() if k not in creds}, **quiet.worker_env()}
    if quiet.verbose():
        env[quiet.VERBOSE_ENV] = "1"
    # `raylora stop` → stop_job → SIGTERM to the driver, which stops the run at a step
    # with a checkpoint; Ray SIGKILLs a driver still running after this many seconds.
    env["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(cfg.failure.stop_timeout_s) + 30)
    renv = {"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env}
    if creds:
        env[SECRETS_ENV] = "1"
        renv["py_modules"] = [_secrets_package(creds, scratch)]
    return renv


def load_job_secrets() -> None:
    """In the driver of a job that ``submit`` sent with credentials (``SECRETS_ENV``): put
    them in this process's environment, delete their file, and drop their package from
    the job config this driver's ``ray.init`` reads, so that no worker node unpacks a copy.
    A no-op anywhere else."""
    if os.environ.get(SECRETS_ENV) != "1":
        return
    # Ray puts each py_modules package's unpacked folder on the driver's PYTHONPATH.
    found = [os.path.join(d, SECRETS_PACKAGE, SECRETS_FILE) for d in sys.path]
    path = next((p for p in found if os.path.isfile(p)), None)
    if path is None:
        raise SystemExit(f"raylora: this job was submitted with credentials ({SECRETS_ENV}=1), "
                         f"but {SECRETS_PACKAGE}/{SECRETS_FILE} is not on the Python path: "
                         "its driver reads and deletes it once; submit the job again")
    with open(path) as f:
        os.environ.update(json.load(f)["env"])
    with contextlib.suppress(OSError):
        os.remove(path)
    _drop_py_module(os.path.basename(os.path.dirname(os.path.dirname(path))))


def _drop_py_module(unpacked: str) -> None:
    """Remove the py_modules URI of the package unpacked into folder ``unpacked``
    (``_ray_pkg_<hash>``, that of URI ``gcs://_ray_pkg_<hash>.zip``) from the job config
    Ray hands the driver as JSON in ``RAY_JOB_CONFIG_JSON_ENV_VAR``: the driver's
    ``ray.init`` gives that runtime_env to every worker of the job."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return
    config = json.loads(raw)
    renv = config.get("runtime_env") or {}
    mods = renv.get("py_modules") or []
    keep = [m for m in mods if f"/{unpacked}." not in m]
    if len(keep) == len(mods):
        return
    if keep:
        renv["py_modules"] = keep
    else:
        renv.pop("py_modules")
    os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps(config)


def submit(config: str, overrides: list[str], address: str | None = None,
           working_dir: str = ".", submission_id: str | None = None) -> str:
    """Validate and preflight the config here (what `raylora train` checks before Ray),
    then submit it; returns the job id."""
    from raylora import launch, preflight
    from raylora.config import load_config

    cfg = load_config(config, overrides)
    resolved = launch.resolve_paths(cfg)
    p = launch.plan(resolved)
    if not preflight.on_cluster(resolved):  # GPU sizes known here (gpu_memory_gb) or none
        preflight.check_memory(resolved)
    meta = {META: os.path.basename(config), "raylora_output": resolved.output.uri,
            "raylora_max_steps": str(p.max_steps)}
    # The SDK uploads the credentials package within submit_job; nothing of it stays here.
    with tempfile.TemporaryDirectory(prefix="raylora-submit-") as scratch:
        return client(address).submit_job(
            entrypoint=entrypoint(config, overrides, working_dir), submission_id=submission_id,
            runtime_env=runtime_env(cfg, os.path.abspath(working_dir), scratch), metadata=meta,
        )


def last_progress(info) -> dict | None:
    """The run's ``{output}/progress.json`` (the driver's last progress line: step, loss,
    ETA; ``raylora.progress``), read through raylora.storage, local or object storage.
    None before the first step."""
    out = (info.metadata or {}).get("raylora_output")
    if not out:
        return None
    try:
        return json.loads(storage.Storage().read_bytes(storage.join(out, PROGRESS_FILE)))
    except (FileNotFoundError, OSError, ValueError):
        return None


def status(job: str, address: str | None = None) -> tuple[str, str | None]:
    """(job state, the run's last progress line or None)."""
    info = client(address).get_job_info(job)
    row = last_progress(info)
    line = row["line"].removeprefix("raylora: ") if row else None
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


def follow_logs(job: str, address: str | None, out) -> None:
    """Print the job's log as it grows (the SDK's websocket tail) until the job ends."""
    import asyncio

    async def tail() -> None:
        async for chunk in client(address).tail_job_logs(job):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())


def list_jobs(address: str | None = None) -> list[dict]:
    """raylora's jobs on the cluster, oldest first."""
    rows = []
    for j in client(address).list_jobs():
        meta = j.metadata or {}
        if META not in meta:
            continue
        rows.append({"job": j.submission_id, "state": str(j.status.value), "config": meta[META],
                     "start_time": j.start_time or 0})
    return sorted(rows, key=lambda r: r["start_time"])
