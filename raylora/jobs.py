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
``tune:`` section) run in the shipped working dir, tagged ``raylora_*`` in the job's
metadata (config name, command, output URI, max steps) so that ``status`` can read the
run's own ``progress.json`` and ``list`` can name the config.
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

import json
import os
import shlex
import tempfile
import time

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

    from raylora.launch import ray_address_problem

    given = address or os.environ.get("RAY_ADDRESS")
    # A GCS address with no cluster behind it: the SDK waited 40 s, then a stack trace.
    if given and (problem := ray_address_problem(given, "--address" if address else "RAY_ADDRESS")):
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


def entrypoint(cmd: str, config: str, overrides: list[str], working_dir: str) -> str:
    """The job's command line: ``cmd`` on the config by its path inside the working dir
    (shipped with it)."""
    rel = os.path.relpath(os.path.abspath(config), os.path.abspath(working_dir))
    if rel.startswith(".."):
        raise ValueError(f"{config}: the config must be inside the working dir {working_dir} "
                         "(it is shipped with it); pass --working-dir")
    return " ".join(shlex.quote(a) for a in ["python", "-m", "raylora", cmd, rel, *overrides])


def path_overrides(given, resolved) -> list[str]:
    """Overrides that make the job read and write what ``submit`` checked here: every value
    ``launch.resolve_paths`` (``resolved``) changed in ``given``, a relative local path made
    absolute (a list such as data.sources whole). The job's driver resolves a relative one
    inside its unpacked copy of the working dir, which has no runs/ and no weights
    (EXCLUDES), and writes a relative output there, not where ``submit`` checked it."""
    from raylora.config import differences

    # JSON: the override's YAML reads it back as it was
    return [f"{key}={json.dumps(now)}" for key, _, now in differences(given.to_dict(), resolved.to_dict())]


def runtime_env(cfg, working_dir: str, scratch: str) -> dict:
    """Working dir + the env the job's driver needs: storage settings, credentials
    (``storage.forwarded_env``; the driver hands them on to its workers itself) as a
    package written under ``scratch``, quiet logging, and Ray's job-stop grace as long as a
    clean stop may take."""
    from raylora import quiet

    plain, creds = storage.split_secrets(storage.forwarded_env())
    env = {**plain, **quiet.worker_env()}
    if quiet.verbose():
        env[quiet.VERBOSE_ENV] = "1"
    # `raylora stop` → stop_job → SIGTERM to the driver, which stops the run at a step
    # with a checkpoint; Ray SIGKILLs a driver still running after this many seconds.
    env["RAY_JOB_STOP_WAIT_TIME_S"] = str(int(cfg.failure.stop_timeout_s) + 30)
    renv = {"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env}
    if creds:
        env[jobsecrets.ENV] = "1"
        renv["py_modules"] = [jobsecrets.write_package(creds, scratch)]
    return renv


def submit(config: str, overrides: list[str], address: str | None = None,
           working_dir: str = ".", submission_id: str | None = None) -> str:
    """Check the config here as its command checks it before Ray (``command``: plan,
    resume, memory where the GPUs are known here), then submit it; returns the job id."""
    from raylora import launch
    from raylora.config import load_config

    cfg = load_config(config, overrides)
    cmd, setup = command(cfg)
    r = launch.checked(cfg, setup)
    overrides = [*overrides, *path_overrides(cfg, launch.resolve_paths(cfg))]
    meta = {META: os.path.basename(config), COMMAND: cmd, "raylora_output": r.cfg.output.uri,
            "raylora_max_steps": str(r.plan.max_steps)}
    # how `status` reaches the output (a config's storage.endpoint_url, not only AWS_*)
    reach = {k: v for k, v in cfg.storage.model_dump().items() if v}
    if reach:
        meta[STORAGE] = json.dumps(reach)
    # The SDK uploads the credentials package within submit_job; nothing of it stays here.
    with tempfile.TemporaryDirectory(prefix="raylora-submit-") as scratch:
        return client(address).submit_job(
            entrypoint=entrypoint(cmd, config, overrides, working_dir), submission_id=submission_id,
            runtime_env=runtime_env(cfg, os.path.abspath(working_dir), scratch), metadata=meta,
        )


def last_progress(info) -> dict | None:
    """The run's ``{output}/progress.json`` (the driver's last progress line: step, loss,
    ETA; ``raylora.progress``), read through raylora.storage, local or object storage.
    None before the first step."""
    meta = info.metadata or {}
    out = meta.get("raylora_output")
    if not out:
        return None
    reach = json.loads(meta.get(STORAGE) or "{}")
    try:
        return json.loads(storage.Storage(reach.get("endpoint_url"), reach.get("region"))
                          .read_bytes(storage.join(out, PROGRESS_FILE)))
    except (FileNotFoundError, OSError, ValueError):
        return None


def status(job: str, address: str | None = None) -> tuple[str, str | None]:
    """(job state, the run's last progress line or None). A search has no one line (its
    trials run side by side, each its own run): each trial's latest line, one per line,
    after a line saying where all of them and Tune's trial table are."""
    info = client(address).get_job_info(job)
    if (info.metadata or {}).get(COMMAND) == "tune":
        trials = (last_progress(info) or {}).get("trials") or {}
        lines = [f"a search (raylora tune): each trial's progress lines and Tune's trial table "
                 f"are in `raylora logs {job}`"]
        lines += [r["line"].removeprefix("raylora: ") for _, r in sorted(trials.items())]
        return str(info.status.value), "\nraylora: ".join(lines)
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
                     "command": meta.get(COMMAND, "train"), "start_time": j.start_time or 0})
    return sorted(rows, key=lambda r: r["start_time"])
