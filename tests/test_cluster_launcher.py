"""cluster/aws-gpu.yaml is a config `ray up` accepts: checked against the JSON schema shipped
in the installed ray package, and through Ray's own offline config preparation."""

from __future__ import annotations

import copy
import json
import os
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "cluster" / "aws-gpu.yaml"


def ray_version() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.match(r"ray(?:\[[^\]]*\])?==([\w.]+)$", d))]
    assert len(pins) == 1, f"expected one ray==X pin in pyproject.toml, found {pins}"
    return pins[0]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(path) as f:
        return jsonschema.Draft7Validator(json.load(f))


@pytest.fixture
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def errors(validator, cfg) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(cfg)]


def test_matches_ray_schema(validator, config):
    assert not errors(validator, config)


def test_ray_prepares_and_validates_it_offline(config):
    # What `ray up` does before talking to AWS: merge the provider defaults, then validate
    # (the merged config must also pass the schema).
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda c: c.update(max_worker=2), "'max_worker' was unexpected"),
        (lambda c: c.update(max_workers="two"), "'two' is not of type 'integer'"),
        (lambda c: c["available_node_types"]["gpu_worker"].pop("node_config"), "node_config"),
        (lambda c: c["docker"].update(imag="x"), "'imag' was unexpected"),
    ],
    ids=["unknown-key", "wrong-type", "no-node-config", "docker-typo"],
)
def test_schema_rejects_broken_config(validator, config, mutate, expected):
    mutate(config)
    assert any(expected in e for e in errors(validator, config)), errors(validator, config)


def test_installs_raylora_and_has_gpu_workers(config):
    assert any(re.search(r"pip install .*raylora", cmd) for cmd in config["setup_commands"])
    types = config["available_node_types"]
    head = config["head_node_type"]
    assert head in types and "GPU" not in types[head]["resources"]
    workers = {name: t for name, t in types.items() if name != head}
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers.values())
    for name, t in workers.items():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"], name


def test_image_pinned_and_ray_started_cleanly(config):
    version = ray_version()
    image = config["docker"]["image"]
    assert re.fullmatch(rf"rayproject/ray:{re.escape(version)}-py311-gpu", image), image
    head, worker = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    # `ray stop` first, so a restarted node does not keep a stale Ray.
    assert head[0] == worker[0] == "ray stop"
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head[-1]
    assert "--dashboard-host=127.0.0.1" in head[-1]  # dashboard only through `ray dashboard`
    assert "--address=$RAY_HEAD_IP:6379" in worker[-1]
    # The head runs every job's supervisor: a plain `ray job submit` is SIGKILLed this long
    # after `ray job stop`'s SIGTERM (Ray's default 3 s) and needs the run's clean stop time.
    from raylora.config import FailureSection

    wait = re.search(r"\bRAY_JOB_STOP_WAIT_TIME_S=(\d+) ray start --head", head[-1])
    assert wait and int(wait.group(1)) >= FailureSection().stop_timeout_s + 15, head[-1]
