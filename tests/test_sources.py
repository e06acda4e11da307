"""Caption folders with kohya repeats, and dataset mixes, through real ``raylora train``
runs on a local Ray (one Ray for the module; each run ~30 s on 2 cores)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import numpy as np
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
    images are encoded once and repeated when training reads the cache. In bf16: the
    cache's parts hold bf16 columns (as uint16) and training reads them back."""
    from raylora.launch import run

    out = str(tmp_path / "out")
    tree = {
        "model": {"pretrained": tiny_model},
        "data": {"uri": write_kohya(tmp_path / "kohya", KOHYA), "resolution": 32,
                 "center_crop": True, "cache": "latents", "shuffle_buffer_size": 8},
        "train": {"batch_size": 3, "num_epochs": 1, "learning_rate": 1e-3, "record_samples": True,
                  "mixed_precision": "bf16"},
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
    # A part per image: a folder is cut into runs of equal repeats, and into
    # CAPTIONFOLDER_MIN_PARTS parts while it has that many images.
    assert sorted(manifest["file_repeats"]) == [1, 1, 1, 10, 10, 10]
    assert all(math.isfinite(r["loss"]) for r in metrics_rows(out))
    import pyarrow.parquet as pq
    import ray.data

    ray.data.DataContext.get_current()  # importing ray.data registers the parts' tensor type
    part = pq.read_table(os.path.join(data["cache_uri"], manifest["files"][0]))
    assert {c: part[c].chunks[0].to_numpy().dtype for c in ("latent_params", "prompt_embeds")} == \
        {"latent_params": np.uint16, "prompt_embeds": np.uint16}


def test_a_caption_folder_is_cached_in_a_part_per_worker_past_64(tiny_model, tmp_path):
    """The cache cuts a caption folder into at least 64 parts, or one per worker past 64
    (data.sharding=files deals parts to workers), while it has that many images; runs of up
    to 64 workers share one cache entry."""
    from raylora.data.cache import _work_items, fingerprint
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    folder = write_kohya(tmp_path / "f", {f"img{i:03d}": f"a shape {i}" for i in range(200)})
    store = Storage()

    def cfg(workers: int):
        return validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path)},
                         "data": {"uri": folder, "format": "captionfolder", "cache": "latents",
                                  "center_crop": True, "sharding": "files"},
                         "scaling": {"num_workers": workers}})

    plan = plan_data(cfg(1).data, store)
    parts = {}
    for workers in (1, 64, 100):
        c = cfg(workers)
        items = _work_items(c, plan, store, 256)
        assert sum(it["stop"] for it in items) == 200  # every image once
        parts[workers] = (len(items), fingerprint(c, "sd", tiny_model, plan, store))
    # 200 // 64 = 3 images a part: 67 parts; 200 // 100 = 2: 100 parts.
    assert [n for n, _ in parts.values()] == [67, 67, 100]
    assert parts[1][1] == parts[64][1] != parts[100][1]


@pytest.fixture(scope="module")
def folder8(tmp_path_factory) -> str:
    """A caption folder of 8 images with tag captions."""
    return write_kohya(tmp_path_factory.mktemp("folder8"),
                       {f"img{i}": f"a shape, number {i}, plain" for i in range(8)})


def mix(demo_data: str, folder: str, **data) -> dict:
    """Weights 3:1 over 32 parquet rows (trigger word "sks") and 8 caption-folder images
    (half their captions dropped, tags shuffled but the first): epochs of 40, 30 + 10."""
    return {"sources": [
        {"uri": demo_data, "weight": 3, "caption_prefix": "sks"},
        {"uri": folder, "weight": 1, "caption_dropout": 0.5, "shuffle_tags": True, "keep_tokens": 1},
    ], "resolution": 32, "center_crop": True, **data}


def test_read_stage_mixes_sources_by_weight_with_their_prefixes(ray_local, demo_data, folder8):
    from raylora.config import DataSection
    from raylora.data.source import _read_passes, plan_data
    from raylora.storage import Storage

    data = DataSection(**mix(demo_data, folder8))
    plan = plan_data(data, Storage())
    rows = _read_passes(data, plan, Storage(), seed=3, passes=range(2), shuffle=True).take_all()
    by = {(e, s): [r for r in rows if (r["epoch"], r["source"]) == (e, s)]
          for e in range(2) for s in range(2)}
    assert [len(by[0, s]) for s in range(2)] == [30, 10] == [len(by[1, s]) for s in range(2)]
    assert all(r["text"].startswith("sks, a ") for r in by[0, 0] + by[1, 0])
    assert all(r["text"].startswith("a shape, number ") for r in by[0, 1])
    for e in range(2):
        assert len({r["key"] for r in by[e, 0]}) == 30  # 30 of 32 parquet rows, once each
        assert sorted(Counter(r["key"] for r in by[e, 1]).values()) == [1] * 6 + [2] * 2
    assert {r["key"] for r in by[0, 0]} != {r["key"] for r in by[1, 0]}  # another subset


def test_two_source_mix_trains_and_counts_each_source(ray_local, tiny_model, demo_data, folder8,
                                                        tmp_path):
    """A raylora train run over the 3:1 mix: 20 steps of 2 = one epoch of 40 samples,
    30 and 10 of which each source's rows, as raylora.json and the model card say."""
    from raylora.launch import run

    out = str(tmp_path / "out")
    summary = run(validate({
        "model": {"pretrained": tiny_model},
        "data": mix(demo_data, folder8, shuffle_buffer_size=8),
        "train": {"batch_size": 2, "num_epochs": 1, "learning_rate": 1e-3},
        "checkpoint": {"every_n_steps": 100},
        "output": {"uri": out},
    }))
    assert summary["metrics"]["steps"] == 20 and summary["metrics"]["images_seen"] == 40
    data = json.load(open(os.path.join(out, "adapter", "raylora.json")))["data"]
    assert (data["format"], data["rows"], data["rows_decoded"]) == ("mix", 40, 40)
    a, b = data["sources"]
    assert (a["format"], a["rows"], a["rows_per_epoch"], a["share"]) == ("parquet", 32, 30, 0.75)
    assert (b["format"], b["rows"], b["rows_per_epoch"], b["share"]) == ("captionfolder", 8, 10, 0.25)
    # What the run read, counted per source by the validating decode: 3:1 (±10% asked).
    assert (a["rows_decoded"], b["rows_decoded"]) == (30, 10)
    assert abs(a["rows_decoded"] / b["rows_decoded"] / 3 - 1) <= 0.1
    card = open(os.path.join(out, "adapter", "README.md")).read()
    assert "| source | rows | rows per epoch | share |" in card
    assert f"| {folder8} | 8 | 10 | 25.0% |" in card
