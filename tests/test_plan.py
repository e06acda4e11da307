"""Driver preflight: what is checked before Ray starts, and the step arithmetic."""

import pytest

from raylora.config import ConfigError, validate
from raylora.launch import plan, resolve_paths


def test_stream_plan_counts_rows_and_steps(base_config):
    base_config["scaling"]["num_workers"] = 2
    base_config["train"].update(max_steps=None, num_epochs=3, gradient_accumulation_steps=2)
    p = plan(resolve_paths(validate(base_config)))
    assert (p.data_format, p.total_rows, p.file_rows) == ("parquet", 32, [16, 16])
    assert p.rows_per_worker == 16
    assert p.updates_per_epoch == 16 // 2 // 2
    assert p.max_steps == 3 * 4
    assert p.batches_per_epoch is None


@pytest.mark.parametrize("sharding", ["stream", "files"])
def test_num_epochs_trains_every_micro_batch_when_accumulation_does_not_divide_them(base_config, sharding):
    """32 rows, batch 2: 16 micro-batches an epoch; accumulation 3. num_epochs 4 is 64
    micro-batches: 22 optimizer steps (the last group runs 2 past), not 4 × 5 = 20 steps
    (60 micro-batches, 3.75 epochs; 7 images at batch 1 and accumulation 4 trained 57 of
    100 epochs), as diffusers' scripts count ceil(batches / accumulation) per epoch. And
    fewer micro-batches than one group still trains (it was refused)."""
    base_config["data"]["sharding"] = sharding
    base_config["train"].update(max_steps=None, num_epochs=4, gradient_accumulation_steps=3)
    p = plan(resolve_paths(validate(base_config)))
    assert (p.rows_per_worker, p.max_steps) == (32, 22)
    assert p.max_steps * 3 >= 4 * 16 > (p.max_steps - 1) * 3
    base_config["train"].update(num_epochs=1, gradient_accumulation_steps=20)
    assert plan(resolve_paths(validate(base_config))).max_steps == 1


def test_a_warmup_longer_than_the_planned_steps_is_refused(base_config):
    """32 rows, batch 2, 1 epoch: 16 optimizer steps planned from num_epochs. A warmup of
    more never reaches the learning rate; polynomial with a warmup of all 16 divided by
    zero at the last step (diffusers' schedule), before the final checkpoint."""
    base_config["train"].update(max_steps=None, num_epochs=1, lr_warmup_steps=17,
                                lr_scheduler="constant_with_warmup")
    with pytest.raises(ConfigError, match=r"train.lr_warmup_steps: 17 is more than the run's 16 "
                                          r"optimizer steps \(train.num_epochs=1\)"):
        plan(resolve_paths(validate(base_config)))
    base_config["train"].update(lr_warmup_steps=16, lr_scheduler="polynomial")
    with pytest.raises(ConfigError, match=r"train.lr_warmup_steps: 16, all of the run's optimizer "
                                          r"steps \(train.num_epochs=1\): polynomial"):
        plan(resolve_paths(validate(base_config)))
    base_config["train"].update(lr_scheduler="linear")
    assert plan(resolve_paths(validate(base_config))).max_steps == 16
    base_config["train"].update(max_steps=16, lr_scheduler="polynomial")
    with pytest.raises(ConfigError, match=r"steps \(train.max_steps\): polynomial"):
        validate(base_config)


def test_a_place_the_run_writes_inside_its_data_is_refused(base_config, tmp_path):
    """A caption folder with output.uri inside it: the next run (a resume, the same
    command) read loss.png and the previews as training images (40 rows became 43). The
    latent cache and held-out data alike; beside the data is fine."""
    from raylora.launch import write_problems
    from raylora.storage import Storage

    data = base_config["data"]["uri"]
    for override, key in (({"output": {"uri": f"{data}/lora-out"}}, "output.uri"),
                          ({"data": {**base_config["data"], "cache": "latents", "center_crop": True,
                                     "cache_uri": f"{data}/sub/cache"}}, "data.cache_uri")):
        cfg = resolve_paths(validate({**base_config, **override}))
        assert [p.split(" is inside ")[0] for p in write_problems(cfg, Storage())] == \
            [f"{key}: {cfg.output.uri if key == 'output.uri' else cfg.data.cache_uri}"]
    beside = resolve_paths(validate({**base_config, "output": {"uri": str(tmp_path / "out")}}))
    assert write_problems(beside, Storage()) == []


def test_files_sharding_plan_and_its_limits(base_config):
    base_config["scaling"]["num_workers"] = 2
    base_config["data"]["sharding"] = "files"
    p = plan(resolve_paths(validate(base_config)))
    assert p.batches_per_epoch == 16 // 2 and p.rows_per_worker == 16
    base_config["scaling"]["num_workers"] = 3
    with pytest.raises(ConfigError, match=r"data.sharding: 'files' needs at least one shard file per worker"):
        plan(resolve_paths(validate(base_config)))


def test_preflight_names_resolution_and_small_data(base_config):
    base_config["data"]["resolution"] = 63
    base_config["train"]["batch_size"] = 64
    with pytest.raises(ConfigError) as ei:
        plan(resolve_paths(validate(base_config)))
    msg = str(ei.value)
    assert "data.resolution: 63 is not a multiple of 2 (the sd latent grid" in msg
    assert "data.uri: 32 rows split over 1 workers is less than one batch (train.batch_size=64 per worker)" in msg


def test_the_trainer_pickles_without_the_model_libraries(base_config, tmp_path):
    """Ray Train's controller actor unpickles the trainer's function and loop config only
    to pass them on; what it unpickles must not import the model stack (raylora.entry).
    A fresh process unpickles them and gets the same config and plan back."""
    import json
    import subprocess
    import sys

    from ray import cloudpickle

    from raylora.launch import build_trainer

    cfg = resolve_paths(validate(base_config))
    p = plan(cfg)
    trainer = build_trainer(cfg, p, str(tmp_path / "out"), "run")
    blob = tmp_path / "trainer.pkl"
    blob.write_bytes(cloudpickle.dumps((trainer.train_loop_per_worker, trainer.train_loop_config)))
    heavy = ["torch", "diffusers", "transformers", "peft", "bitsandbytes", "raylora.worker"]
    code = (
        "import json, pickle, sys\n"
        f"fn, loop = pickle.load(open({str(blob)!r}, 'rb'))\n"
        "spec = loop['spec']\n"
        f"print(json.dumps({{'loaded': [m for m in {heavy!r} if m in sys.modules],\n"
        "  'fn': fn.__module__ + '.' + fn.__name__, 'config': spec.config.to_dict(),\n"
        "  'max_steps': spec.plan.max_steps, 'rows': spec.plan.total_rows}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["loaded"] == []
    assert got["fn"] == "raylora.entry.train_loop_per_worker"
    assert got["config"] == json.loads(json.dumps(cfg.to_dict()))
    assert (got["max_steps"], got["rows"]) == (p.max_steps, p.total_rows) == (4, 32)


@pytest.mark.parametrize("bucketing", [False, True])
def test_a_latent_cache_holds_the_training_rows_and_is_not_split_again(tmp_path, monkeypatch, bucketing):
    """data.cache=latents + data.validation_split: the cache build drops the held-out rows,
    so its 74 rows are the training rows. Planned over the cache they were scaled by
    (1 - split) again: 56 rows, 28 steps for num_epochs 2 at batch 4 (an e2e run), where
    74 rows make 18 batches an epoch and 36 steps; a Tune trial's replan agrees."""
    from raylora import launch
    from raylora.data import cache
    from raylora.data.plan import DataPlan

    entry = cache.CacheEntry(str(tmp_path), [str(tmp_path / "part-0.parquet")], [74], False,
                             sources=[0], repeats=[1],
                             buckets=[{"0": 30, "1": 44}] if bucketing else None)
    monkeypatch.setattr(cache, "ensure_cache", lambda *a, **k: entry)
    cfg = validate({"model": {"pretrained": str(tmp_path / "model")}, "output": {"uri": str(tmp_path)},
                    "data": {"uri": str(tmp_path), "resolution": 64, "center_crop": True,
                             "cache": "latents", "validation_split": 0.25, "bucketing": bucketing},
                    "train": {"batch_size": 4, "num_epochs": 2}})
    before = launch._arithmetic(cfg, "m", DataPlan("parquet", ["x"], 100, [100]) if not bucketing
                                else entry.plan(cfg.data), [], [])
    p = launch.apply_cache(cfg, before)
    assert p.rows_per_worker == (74 if not bucketing else 72)  # buckets: 7 + 11 batches of 4
    assert p.rows_per_worker // 4 == 18 and p.max_steps == 36
    if bucketing:
        assert p.bucket_steps == {0: 7, 1: 11}
    else:
        assert p.total_rows == 74
    again = launch.replan(cfg, p)
    assert (again.rows_per_worker, again.max_steps) == (p.rows_per_worker, 36)
