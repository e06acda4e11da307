"""A submitted job's credentials, outside its ``env_vars``: Ray's runtime-env agent writes a
job's env_vars to its log on the head (``runtime_env_agent.log``) and the dashboard shows
them. ``raylora submit`` (``raylora.jobs``) sends them as a package of their own in the
runtime_env's ``py_modules``, which the SDK uploads to the cluster's internal store (the
dashboard and the logs show only its ``gcs://`` URI); the job's driver reads and deletes
the file first thing (``load``, from ``raylora.cli``) and keeps the package from its
workers. Kept apart from ``raylora.jobs`` so that every CLI start, which calls ``load``,
imports nothing heavy (no pyarrow).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys

# A package named this in the job's py_modules holds FILE; the job's env_vars say ENV=1 so
# that its driver looks for it.
PACKAGE = "_raylora_job_secrets"
FILE = "env.json"
ENV = "RAYLORA_JOB_SECRETS"


def write_package(creds: dict[str, str], into: str) -> str:
    """Write the credentials package under ``into`` (a private temp dir); returns its path."""
    pkg = os.path.join(into, PACKAGE)
    os.mkdir(pkg, 0o700)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    fd = os.open(os.path.join(pkg, FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        # A nonce per submission: Ray keeps an unpacked package by its content's hash, and
        # the driver deletes this file once read, so two jobs with the same credentials
        # must not share one copy.
        json.dump({"nonce": secrets.token_hex(16), "env": creds}, f)
    return pkg


def load() -> None:
    """In the driver of a job that ``submit`` sent with credentials (``ENV``): put them in
    this process's environment, delete their file, and drop their package from the job
    config this driver's ``ray.init`` reads, so that no worker node unpacks a copy. A
    no-op anywhere else."""
    if os.environ.get(ENV) != "1":
        return
    # Ray puts each py_modules package's unpacked folder on the driver's PYTHONPATH.
    found = [os.path.join(d, PACKAGE, FILE) for d in sys.path]
    path = next((p for p in found if os.path.isfile(p)), None)
    if path is None:
        raise SystemExit(f"raylora: this job was submitted with credentials ({ENV}=1), "
                         f"but {PACKAGE}/{FILE} is not on the Python path: "
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
