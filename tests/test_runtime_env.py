"""jobs/runtime_env.yaml installs raylora's dependencies on a remote cluster's workers. It
must ask for what pyproject.toml asks for, with the same bounds: a job there otherwise gets
versions the local install refuses (transformers 5.24 wants a peft that is not released)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def requirements(lines) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in reqs}


def brought_by(dist: str, extras: set[str]) -> set[str]:
    """What installing ``dist[extras]`` installs with it (installed metadata, not a list)."""
    names = set()
    for line in metadata.requires(dist) or []:
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""}):
            names.add(canonicalize_name(r.name))
    return names


def test_the_remote_runtime_env_asks_for_pyprojects_dependencies_with_the_same_bounds():
    project = requirements(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    listed = requirements(env["pip"]["packages"])

    # The cluster runs its own Ray (pinned by its image); a job that reinstalled it would
    # run a driver whose Ray differs from the raylets'.
    assert "ray" not in listed
    unknown = set(listed) - set(project)
    assert not unknown, f"jobs/runtime_env.yaml installs what pyproject.toml does not ask for: {unknown}"
    drift = {n: (str(listed[n].specifier), str(project[n].specifier))
             for n in listed if listed[n].specifier != project[n].specifier}
    assert not drift, f"bounds differ (runtime_env.yaml, pyproject.toml): {drift}"

    # Left out only what comes with Ray (in pyproject's extras) or with diffusers anyway.
    ray = project["ray"]
    brought = brought_by("ray", set(ray.extras)) | brought_by("diffusers", set())
    missing = set(project) - set(listed) - {"ray"} - brought
    assert not missing, f"jobs/runtime_env.yaml lacks pyproject.toml's {sorted(missing)}"
    assert {"numpy", "pyarrow", "pyyaml", "pillow"} <= brought  # what it does leave out


def test_the_local_runtime_env_installs_nothing():
    """cluster/local-up.sh's cluster runs raylora's venv: a pip/uv/conda field would make
    Ray copy that venv for every new environment, before the job starts."""
    env = yaml.safe_load((REPO / "jobs" / "runtime_env.local.yaml").read_text())
    assert set(env) == {"env_vars"}
    assert env["env_vars"] == yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())["env_vars"]
