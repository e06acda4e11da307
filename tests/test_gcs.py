"""gs:// end to end against a real GCS-compatible server on 127.0.0.1 (tests/gcsemu.py, as
test_s3.py runs against moto): the base model, the parquet shards, the latent cache and the
run's output all in a bucket. A worker trains; checkpoints go to the bucket and only the
latest is kept; the adapter is published there and the stock pipeline loads it; the same
config run again resumes from the bucket; a publish over an adapter already there
replaces it. The emulator is reached through ``STORAGE_EMULATOR_HOST``, set for this
module before its Ray starts."""

from __future__ import annotations

import json
import os

import pytest

from raylora.config import validate

# ray_gcs starts its own Ray with the emulator's address in its workers' environment.
pytestmark = [pytest.mark.integration, pytest.mark.own_ray]

BUCKET = "raylora-gcs"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator with this module's bucket; its env set for this module."""
    import gcsemu

    from raylora.storage import GCS_EMULATOR_ENV, filesystem

    proc, endpoint = gcsemu.start()
    env = {GCS_EMULATOR_ENV: endpoint, "GOOGLE_CLOUD_PROJECT": "raylora-test",
           "RAYLORA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        filesystem(f"gs://{BUCKET}")[0].create_dir(BUCKET)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_gcs(gcs):
    """Local Ray started *after* the emulator's variables are set: its workers inherit them."""
    import ray

    from raylora.launch import start_local_ray

    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


def checkpoints(files: list[str]) -> set[str]:
    """The checkpoint folders among a run's files (relative to output.uri)."""
    return {f.split("/")[1] for f in files if f.startswith("train/checkpoint_") and f.count("/") > 1}


def test_a_run_with_model_data_cache_and_output_in_gcs(gcs, ray_gcs, tiny_model, demo_data, tmp_path):
    from stock import stock_image_change

    from raylora.launch import run
    from raylora.storage import Storage

    st = Storage()
    root = f"gs://{BUCKET}"
    st.upload_dir(tiny_model, f"{root}/models/sd")
    st.upload_dir(demo_data, f"{root}/data/demo")
    tree = {
        "model": {"pretrained": f"{root}/models/sd"},
        "data": {"uri": f"{root}/data/demo", "resolution": 64, "center_crop": True,
                 "cache": "latents", "cache_uri": f"{root}/cache"},
        "lora": {"rank": 4},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 5e-3, "seed": 1},
        # One worker: what is checked here is storage; several workers read and write
        # object storage in test_s3.py and test_cluster_local.py.
        "checkpoint": {"every_n_steps": 2, "num_to_keep": 1},
        "output": {"uri": f"{root}/runs/a"},
    }
    summary = run(validate(tree))
    m = summary["metrics"]
    assert m["steps"] == 4 and m["replicas_in_sync"] is True and m["images_seen"] == 4 * 2
    files = [f.removeprefix(f"{root}/runs/a/") for f in st.list_files(f"{root}/runs/a")]
    assert {"adapter/manifest.json", "adapter/pytorch_lora_weights.safetensors",
            "adapter/raylora.json", "adapter/README.md"} <= set(files)
    manifest = json.loads(st.read_bytes(f"{root}/runs/a/adapter/manifest.json"))
    sizes = {n: st.info(f"{root}/runs/a/adapter/{n}").size for n in manifest["files"]}
    assert sizes == manifest["files"], (sizes, manifest)
    # num_to_keep: 1 (Ray Train deletes the older checkpoint folder in the bucket)
    kept = checkpoints(files)
    assert len(kept) == 1, kept
    assert [f for f in st.list_files(f"{root}/cache") if f.endswith(".parquet")]
    assert not [f for f in files if ".staging-" in f]

    # The stock pipeline loads the adapter published in the bucket.
    local = tmp_path / "adapter"
    st.download_dir(f"{root}/runs/a/adapter", str(local))
    assert stock_image_change("sd", tiny_model, str(local)) > 1e-4

    # The same config with more steps resumes from the bucket's checkpoint.
    tree["train"]["max_steps"] = 6
    again = run(validate(tree))["metrics"]
    assert again["resumed_from_step"] == 4 and again["steps"] == 6
    files = [f.removeprefix(f"{root}/runs/a/") for f in st.list_files(f"{root}/runs/a")]
    assert len(checkpoints(files)) == 1 and checkpoints(files) != kept
    assert not [f for f in files if ".staging-" in f]
