"""Shared fixtures: a tiny model and demo shards built once per session, offline."""

from __future__ import annotations

import os

import pytest

# Tests must never reach for the hub (no network here, and not in CI).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# A shell that sourced a cluster's env (local-up.sh's $STATE/env) must not steer the tests'
# Rays: each test starts or names the cluster it uses. Seen: a stale token path failed 57
# tests with AuthenticationError.
for _var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
    os.environ.pop(_var, None)
# Ray Train's controller polls its workers every 2 s (default); a test run's 3-20 steps
# take about a second, so the first and last polls were ~2.5 s of each ~20 s Ray run
# (measured: 4 runs of one tiny SD3 test, 20.2-21.3 s at 2.0 vs 18.3-18.6 s at 0.25). Set
# before any Ray starts here, so every raylet, job and worker the tests start inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray Train starts a PreemptionWatcher actor per run, a process that imports ray.train
# (pandas, Ray Data: ~2 CPU-s here) to watch for drained nodes. Only test_elastic drains
# a node, and its cluster turns the watcher back on, as test_faults does for its SIGTERMed
# workers; raylora itself keeps Ray's default (on). Measured on test_families_cluster (6
# two-worker runs): 362 -> 338 busy CPU-s, 203 -> 192 s.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


@pytest.fixture(autouse=True)
def _environ_restored():
    """Each test leaves this process's environment as it found it. Code under test sets
    variables here: ``raylora.cli.main`` Ray's signal-check interval, the verbose flag and
    the quiet-logging ones; ``jobsecrets.load`` a job's credentials. A later test (and a
    Ray it starts) inherited them: a loaded secret failed test_cluster_local's clean-AWS
    check when test_jobs ran first. Fixtures of wider scope are set up before this one, so
    what they set (a module's Ray, the session's) stays."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from raylora.model.tiny import build_tiny_sd

    return str(build_tiny_sd(tmp_path_factory.mktemp("model") / "tiny-sd"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family → a tiny pipeline folder of that family, built once per session on first use.
    ``experts=True``: Wan 2.2 A14B's two-transformer layout (wan)."""
    from raylora.model.tiny import build_tiny

    built = {}

    def get(family: str, experts: bool = False) -> str:
        if (family, experts) not in built:
            name = f"{family}-experts" if experts else family
            built[family, experts] = str(build_tiny(tmp_path_factory.mktemp(name) / name,
                                                    family=family, experts=experts))
        return built[family, experts]

    return get


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> str:
    from raylora.data.demo import write_parquet_shards

    dest = tmp_path_factory.mktemp("data") / "shards"
    write_parquet_shards(dest, n=32, num_shards=2, size=64, seed=1)
    return str(dest)


@pytest.fixture
def base_config(tiny_model, demo_data, tmp_path) -> dict:
    """A small valid config tree (plain dict) for the tiny model and demo shards."""
    return {
        "model": {"pretrained": tiny_model},
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 1e-3},
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": 2},
        "output": {"uri": str(tmp_path / "out")},
    }


@pytest.fixture(scope="session")
def _shared_ray():
    """The local Ray behind ``ray_local``, shut down at the end of the session."""
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local(_shared_ray):
    """A local Ray with 4 logical CPUs in this process. One serves the modules that ask for
    it in a row: starting and stopping one took 5-10 s here, once per module before. A
    module marked ``own_ray`` stops it first (see ``_own_ray``); the next asking module
    starts a fresh one. Its workers' runtime_env is made when it starts, as before."""
    import ray

    from raylora.launch import start_local_ray

    if not ray.is_initialized():
        start_local_ray(num_cpus=4)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--lane", choices=("all", "ray", "free"), default="all",
        help="ray: only the tests that start a Ray (marked integration or own_ray, or using "
             "ray_local); free: only the others. tests/lanes.py (`make test`) runs the two "
             "side by side.")


def starts_ray(item) -> bool:
    """Whether a test starts (or stops) a Ray. Checked for the free lane: a serial run of
    the others started no raylet or gcs_server (pgrep every second)."""
    return (item.get_closest_marker("integration") is not None
            or item.get_closest_marker("own_ray") is not None
            or "ray_local" in getattr(item, "fixturenames", ()))


# The Ray lane's modules that wait the most, run first, while the other lane runs beside
# them: share of both cores idle while each ran in the Ray lane alone (2026-11-29; the lane
# as a whole 20 %): s3 37 % (retries' backoff), faults 26 %, jobs 24 %, cluster_local 22 %,
# compile 34 %, progress 31 %. In file order the CPU-bound ones came first (bad_data,
# buckets, families_cluster), 1.2-1.7x slower beside the other lane than alone.
WAITING_FIRST = ("test_s3.py", "test_faults.py", "test_jobs.py", "test_cluster_local.py",
                 "test_compile.py", "test_progress.py")


def pytest_collection_modifyitems(config, items):
    """The ``own_ray`` modules run after all the others (each keeps its tests in order).
    Each stops the shared Ray, and in file order the next module asking for one started
    another (gcs_server processes of a full run, counted: 19 in file order, 13 in this).

    ``--lane`` keeps one side (tests/lanes.py). Only one lane starts Rays: by
    default every Ray's dashboard agent listens on the same port (52365)."""
    lane = config.getoption("lane")
    if lane != "all":
        keep, dropped = [], []
        for item in items:
            (keep if starts_ray(item) == (lane == "ray") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    first = WAITING_FIRST if lane == "ray" else ()
    items.sort(key=lambda item: (first.index(item.path.name) if item.path.name in first else len(first),
                                 item.get_closest_marker("own_ray") is not None))


@pytest.fixture(scope="module", autouse=True)
def _own_ray(request, _shared_ray):
    """Modules marked ``own_ray`` start their own Ray in this process (another size, a
    cluster of nodes) or check that none runs: the shared one is stopped before them."""
    if request.node.get_closest_marker("own_ray") is not None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    yield


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for the session.

    Only the endpoint is returned; tests decide which processes see AWS_* variables.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def batches(tiny_model, demo_data):
    """8 micro-batches of 2 preprocessed samples (an "epoch"), fixed."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from raylora.data.preprocess import Preprocess, StageSpec

    stage = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))
    table = pq.read_table(os.path.join(demo_data, "part-00000.parquet"))
    out = stage({"image": np.array(table["image"].to_pylist(), dtype=object),
                 "text": np.array(table["text"].to_pylist())})
    return [
        {"pixel_values": torch.from_numpy(out["pixel_values"][i : i + 2]),
         "input_ids": torch.from_numpy(out["input_ids"][i : i + 2])}
        for i in range(0, 16, 2)
    ]


@pytest.fixture(scope="session")
def hub():
    """A Hugging Face hub on 127.0.0.1 for the session (tests/hubemu.py); tests add repos
    (``hub.add``) and point their processes at it with ``HF_ENDPOINT``."""
    import hubemu

    server = hubemu.Hub()
    yield server
    server.stop()


@pytest.fixture
def online(hub, monkeypatch, tmp_path):
    """This process's huggingface_hub pointed at ``hub`` with an empty cache, no token.
    It read HF_ENDPOINT, HF_HUB_OFFLINE (1: conftest) and its paths when imported, so its
    constants are set as those variables would have set them."""
    from huggingface_hub import constants, hf_api

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    # the module-level HfApi (model_info, resolve_revision: diffusers' pipeline download)
    monkeypatch.setattr(hf_api.api, "endpoint", hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)  # its older name, still read
    return constants
