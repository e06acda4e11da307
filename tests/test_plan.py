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
    assert "data.uri: 32 rows split over 1 workers is less than one optimizer step" in msg
