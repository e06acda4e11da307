"""Caption folders with kohya repeats, and dataset mixes, through real ``raylora train``
runs on a local Ray (one Ray for the module; each run ~30 s on 2 cores)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from raylora.config import validate
from test_formats import KOHYA, write_kohya

pytestmark = pytest.mark.integration


def metrics_rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_caption_folder_with_repeats_trains_from_cached_latents(ray_local, tiny_model, tmp_path):
    """6 images, 3 of them in 10_mychar (one without a caption file: it trains on
    "mychar"): an epoch is 33 samples, 11 steps of 3, in which each mychar image is
    trained on 10 times and the others once. Through the latent cache: the 6 distinct
    images are encoded once and repeated when training reads the cache."""
    from raylora.launch import run

    out = str(tmp_path / "out")
    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": write_kohya(tmp_path / "kohya", KOHYA), "resolution": 32,
                 "center_crop": True, "cache": "latents", "shuffle_buffer_size": 8},
        "train": {"batch_size": 3, "num_epochs": 1, "learning_rate": 1e-3, "record_samples": True},
        "checkpoint": {"every_n_steps": 100},
        "output": {"uri": out},
    }
    summary = run(validate(tree))
    assert summary["metrics"]["steps"] == 11 and summary["metrics"]["images_seen"] == 33
    meta = json.load(open(os.path.join(out, "adapter", "raylora.json")))
    data = meta["data"]
    assert data["cache_reused"] is False and data["rows"] == 33
    assert data["rows_decoded"] == 6 and data["bad_records"] == {}  # each image encoded once
    (source,) = data["sources"]
    assert (source["rows"], source["rows_per_epoch"]) == (6, 33)
    assert source["rows_by_repeats"] == {"1": 3, "10": 3}
    seen = Counter(s for r in metrics_rows(out) for s in r["samples"])
    assert sorted(seen.values()) == [1, 1, 1, 10, 10, 10]
    manifest = json.load(open(os.path.join(data["cache_uri"], "manifest.json")))
    assert sorted(manifest["file_repeats"]) == [1, 10]  # one part per run of equal repeats
