"""#6 on Ray: a tiny SDXL run (text encoders trained too) with validation grids and
tracking, and cached-latent training that reproduces uncached training step for step."""

import json
import os
import struct
import time

import numpy as np
import pytest
import torch
from PIL import Image

from raylora.config import validate
from raylora.data.preprocess import transform_image_coords
from stock import stock_load


def test_sdxl_crop_coordinates_follow_resize_crop_and_flip():
    """Original size and crop top-left as SDXL is conditioned on them (diffusers' script:
    coordinates in the resized image; a flip measures the left edge from the other side)."""
    img = Image.new("RGB", (100, 60), "red")  # w=100, h=60 → resized to 107×64
    rng = np.random.default_rng(0)
    arr, orig, crop = transform_image_coords(img, 64, True, False, rng)
    assert arr.shape == (3, 64, 64) and orig == (60, 100) and crop == (0, (107 - 64) // 2)
    seen = set()
    for s in range(40):
        _, _, (top, left) = transform_image_coords(img, 64, False, False, np.random.default_rng(s))
        assert top == 0 and 0 <= left <= 43
        seen.add(left)
    assert len(seen) > 10
    # Same rng stream with a flip: the crop is taken at `left`, then mirrored, so in the
    # flipped image its left edge sits at 107 - 64 - left.
    flips = [transform_image_coords(img, 64, False, True, np.random.default_rng(s)) for s in range(20)]
    plain = [transform_image_coords(img, 64, False, False, np.random.default_rng(s)) for s in range(20)]
    flipped = [p[2][1] != f[2][1] for p, f in zip(plain, flips)]
    assert any(flipped) and not all(flipped)
    for p, f, was in zip(plain, flips, flipped):
        if was:
            assert f[2][1] == 107 - 64 - p[2][1]


def test_sdxl_time_ids_layout():
    from raylora.model.families.sdxl import time_ids

    ids = time_ids({"original_size": torch.tensor([[60, 100]]), "crop_top_left": torch.tensor([[0, 21]]),
                    "target_size": torch.tensor([[64, 48]])})
    assert ids.tolist() == [[60.0, 100.0, 0.0, 21.0, 64.0, 48.0]]


@pytest.fixture(scope="module")
def tiny_sdxl(tiny):
    return tiny("sdxl")


def _tb_events(directory: str) -> list:
    """Every event in the tensorboard files under ``directory`` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for root, _, files in os.walk(directory):
        for name in files:
            if "tfevents" not in name:
                continue
            data = open(os.path.join(root, name), "rb").read()
            pos = 0
            while pos < len(data):
                (n,) = struct.unpack("<Q", data[pos : pos + 8])
                events.append(Event.FromString(data[pos + 12 : pos + 12 + n]))
                pos += 12 + n + 4
    return events


@pytest.mark.integration
def test_tiny_sdxl_trains_renders_grids_tracks_and_loads_in_stock_pipeline(
    ray_local, tiny_sdxl, demo_data, tmp_path
):
    from raylora.launch import run

    out = tmp_path / "out"
    tree = {
        "model": {"pretrained": tiny_sdxl},  # family auto-detected from model_index.json
        "data": {"uri": demo_data, "resolution": 64, "center_crop": True},
        "train": {"batch_size": 2, "max_steps": 4, "learning_rate": 5e-3},
        # Both text encoders train too, on 2 DDP workers: their LoRA gradients are averaged
        # outside DDP (encoder 1's last layer gets none, SDXL reads its penultimate layer).
        "lora": {"train_text_encoder": True},
        "scaling": {"num_workers": 2},
        "validation": {"prompts": ["a red circle", "a blue square"], "every_n_steps": 2,
                       "num_inference_steps": 2, "seed": 3},
        "tracking": {"backend": "tensorboard"},
        "checkpoint": {"every_n_steps": 4},
        "output": {"uri": str(out)},
    }
    summary = run(validate(tree))
    meta = json.loads((out / "adapter" / "raylora.json").read_text())
    assert meta["data"]["family"] == "sdxl"
    assert summary["metrics"]["replicas_in_sync"] is True
    from safetensors.torch import load_file

    keys = load_file(str(out / "adapter" / "pytorch_lora_weights.safetensors")).keys()
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}
    # Validation grids before training and at every evaluation step: 2 prompts → 2×1 grid.
    grids = sorted(os.listdir(out / "validation"))
    assert grids == ["step_000000.png", "step_000002.png", "step_000004.png"]
    first, last = (np.asarray(Image.open(out / "validation" / g), dtype=np.float32) for g in (grids[0], grids[-1]))
    assert first.shape == (64, 128, 3)
    assert np.abs(first - last).max() > 0  # the adapter changed what the pipeline draws
    # metrics.jsonl: one row per optimizer step with loss and lr.
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["lr"] == pytest.approx(5e-3) for r in rows)
    assert summary["metrics"]["train_loss_last"] == rows[-1]["loss"]
    # Tensorboard got the same losses and the validation images.
    events = _tb_events(str(out / "tracking" / "tensorboard"))
    tb_loss = {e.step: v.simple_value for e in events for v in e.summary.value if v.tag == "loss"}
    assert tb_loss == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in rows}
    images = [(e.step, v.image.width) for e in events for v in e.summary.value if v.HasField("image")]
    assert sorted(images) == [(s, 64) for s in (0, 0, 2, 2, 4, 4)]
    # The adapter loads in stock diffusers' SDXL pipeline and changes its output.
    work = tmp_path / "stock"
    work.mkdir()
    res = stock_load(tiny_sdxl, str(out / "adapter"), work, family="sdxl")
    assert res["pipeline"] == "StableDiffusionXLPipeline" and not res["raylora_imported"]
    assert res["finite"] and res["max_abs_diff"] > 1e-4


@pytest.mark.integration
def test_latent_cache_build_reuse_and_training(ray_local, tiny_model, tmp_path):
    """The cache holds what the encoders compute for every source row, in source order;
    cached training repeats uncached training step for step (same seed, no augmentation),
    never loads the encoders; a second run, with caption dropout, builds an entry of its
    own (dropout keeps uncaptioned rows, so it is part of an entry), leaves the first as it
    was, and repeats uncached training with the same dropout."""
    import pyarrow.parquet as pq
    import ray.data

    from raylora.data.cache import MANIFEST, EncodeStage
    from raylora.data.demo import write_parquet_shards
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.launch import run

    data, held = tmp_path / "data", tmp_path / "held"
    write_parquet_shards(data, n=16, num_shards=1, size=64, seed=5)
    write_parquet_shards(held, n=4, num_shards=1, size=64, seed=6)

    def tree(name: str, cache: str, caption_dropout: float = 0.0) -> dict:
        return {
            "model": {"pretrained": tiny_model},
            "data": {"uri": str(data), "resolution": 64, "center_crop": True, "cache": cache,
                     **({"cache_uri": str(tmp_path / "cache")} if cache == "latents" else {}),
                     "sharding": "files",
                     "shuffle_buffer_size": 0, "validation_uri": str(held),
                     "caption_dropout": caption_dropout},
            "train": {"batch_size": 2, "max_steps": 6, "learning_rate": 1e-3, "seed": 7},
            "validation": {"num_timesteps": 2},
            "checkpoint": {"every_n_steps": 6},
            "output": {"uri": str(tmp_path / name)},
        }

    plain = run(validate(tree("plain", "none")))
    # The entry as another run's build left it: one still building (a part written just
    # now) and one that died eight days ago, in the folder layout of builds before this.
    from raylora.data.cache import fingerprint
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    cfg = validate(tree("cached", "latents"))
    entry_dir = tmp_path / "cache" / fingerprint(cfg, "sd", tiny_model, plan_data(cfg.data, Storage()), Storage())
    (entry_dir / "parts-live").mkdir(parents=True)
    (entry_dir / "parts-live" / "part-000000-0000.parquet").write_bytes(b"being written")
    (entry_dir / "parts").mkdir()
    (entry_dir / "parts" / "part-000000-0000.parquet").write_bytes(b"died")
    os.utime(entry_dir / "parts" / "part-000000-0000.parquet", (time.time() - 8 * 86400,) * 2)
    cached = run(cfg)

    def losses(name):
        return [json.loads(x)["loss"] for x in open(tmp_path / name / "metrics.jsonl")]

    assert len(losses("cached")) == 6 and all(np.isfinite(losses("cached")))
    # The trajectory of uncached training. Not bit-equal: the VAE's numerics depend a
    # little on its batch size (8 rows when caching, 2 when training).
    np.testing.assert_allclose(losses("cached"), losses("plain"), rtol=1e-4)
    m_plain, m_cached = plain["metrics"], cached["metrics"]
    # Held-out loss before training: the driver-encoded held-out rows equal the worker's.
    assert m_cached["eval_loss_base"] == pytest.approx(m_plain["eval_loss_base"], rel=1e-6)
    assert m_plain["encoders_on_worker"] is True and m_cached["encoders_on_worker"] is False

    meta = json.loads((tmp_path / "cached" / "adapter" / "raylora.json").read_text())["data"]
    assert meta["cache_reused"] is False
    assert meta["cache_uri"].startswith(str(tmp_path / "cache"))
    manifest = json.loads(open(os.path.join(meta["cache_uri"], MANIFEST)).read())
    assert sum(manifest["file_rows"]) == 16 and meta["rows"] == 16
    files = [os.path.join(meta["cache_uri"], f) for f in manifest["files"]]
    written = [*files, os.path.join(meta["cache_uri"], MANIFEST)]
    # This run's build went to a folder of its own: the live build's part is as it was
    # (deleting it failed that run on a part its manifest names), the dead one is gone.
    assert meta["cache_uri"] == str(entry_dir)
    assert {f.split("/")[0] for f in manifest["files"]} not in ({"parts"}, {"parts-live"})
    assert len({f.split("/")[0] for f in manifest["files"]}) == 1
    assert (entry_dir / "parts-live" / "part-000000-0000.parquet").read_bytes() == b"being written"
    assert not (entry_dir / "parts").exists()
    # A run that reuses the entry deletes a build folder no manifest names once it is stale
    # (that build died, or its manifest was overwritten), and nothing the manifest names.
    from raylora.data.cache import ensure_cache

    os.utime(entry_dir / "parts-live" / "part-000000-0000.parquet", (time.time() - 8 * 86400,) * 2)
    assert ensure_cache(cfg, "sd", tiny_model, plan_data(cfg.data, Storage()), Storage()).reused
    assert not (entry_dir / "parts-live").exists() and all(os.path.exists(f) for f in files)
    stamps = {f: os.stat(f).st_mtime_ns for f in written}

    # A second cached run of the same data, now with caption dropout: an entry of its own
    # (with dropout on, a row without a caption is kept as the empty prompt, so the rows
    # can differ; any rate above 0 shares it: test_the_cache_fingerprint_follows_...), the
    # first rewritten in nothing. The driver encodes the empty prompt once; the workers swap
    # it in for the dropped rows' captions. At p=0.999 every row of both runs is dropped
    # (their draws differ), so it repeats uncached training with the same dropout step for
    # step: the empty prompt's cached embedding is the one the uncached step computes.
    dropped = run(validate(tree("again", "latents", caption_dropout=0.999)))
    run(validate(tree("plain_dropped", "none", caption_dropout=0.999)))
    again = json.loads((tmp_path / "again" / "adapter" / "raylora.json").read_text())["data"]
    assert again["cache_reused"] is False and again["cache_uri"] != meta["cache_uri"]
    assert again["cache_uri"].startswith(str(tmp_path / "cache"))
    assert {f: os.stat(f).st_mtime_ns for f in written} == stamps
    assert dropped["metrics"]["encoders_on_worker"] is False
    np.testing.assert_allclose(losses("again"), losses("plain_dropped"), rtol=1e-4)
    assert np.abs(np.array(losses("again")) - losses("cached")).max() > 1e-3 * max(losses("cached"))

    # Row for row, in source order, the cache is what the encoders give for the source rows.

    ray.data.DataContext.get_current()  # importing ray.data registers the parts' tensor type

    def column(name: str) -> np.ndarray:
        return np.concatenate([c.to_numpy() for f in files for c in pq.read_table(f)[name].chunks])

    table = pq.read_table(data / "part-00000.parquet")
    pre = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))
    raw = pre({"image": np.array(table["image"].to_pylist(), dtype=object),
               "text": np.array(table["text"].to_pylist(), dtype=object)})
    enc = EncodeStage(tiny_model, "sd", "float32", resolution=64)(dict(raw))
    assert column("latent_params").shape == (16, 8, 32, 32)  # mean ‖ logvar, 4 ch, 64/2 px
    np.testing.assert_allclose(column("latent_params"), enc["latent_params"], atol=1e-5)
    np.testing.assert_allclose(column("prompt_embeds"), enc["prompt_embeds"], atol=1e-6)


def test_the_cache_fingerprint_follows_what_the_decode_keeps_and_caption_dropout(tiny_model, tmp_path):
    """A cache entry holds the rows the decode kept, with the pixels it composited: a rerun
    that changes data.min_size, small_images, max_image_pixels or background_color, or turns
    caption dropout on (which keeps uncaptioned rows as the empty prompt) or off, is a new
    entry (they all shared one before). Dropout at another rate above 0 keeps the same
    rows, so the same entry; settings at their defaults leave the fingerprint as it was."""
    from raylora.data.cache import fingerprint
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    (tmp_path / "d").mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "d" / "x.png")
    (tmp_path / "d" / "x.txt").write_text("a")
    store = Storage()

    def fp(**data):
        cfg = validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "o")},
                        "data": {"uri": str(tmp_path / "d"), "resolution": 64, "center_crop": True,
                                 "cache": "latents", **data}})
        return fingerprint(cfg, "sd", tiny_model, plan_data(cfg.data, store), store)

    base = fp()
    assert fp(min_size=0, small_images="skip", background_color=[255, 255, 255],
              caption_dropout=0.0) == base
    changed = {"min_size": fp(min_size=48), "small_images": fp(min_size=48, small_images="upscale"),
               "max_image_pixels": fp(max_image_pixels=10**6),
               "background_color": fp(background_color=[0, 0, 0]),
               "caption_dropout": fp(caption_dropout=0.1)}
    assert len({base, *changed.values()}) == 1 + len(changed), changed
    assert fp(caption_dropout=0.3) == changed["caption_dropout"]

    # A source's own control or mask column: another column's images are another entry
    # (one input: the key held data.control_column alone, and a source's was read from
    # the entry of the first)
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = (tmp_path / "d" / "x.png").read_bytes()
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"image": [png], "text": ["a"], **{c: [png] for c in ("before", "after", "m1", "m2")}}),
                   tmp_path / "p" / "part-0.parquet")

    def sources(**src):
        return fp(uri=None, sources=[{"uri": str(tmp_path / "p"), **src}],
                  **({"control_images": True} if "control_column" in src else {"masked_loss": True}))

    assert sources(control_column="before") != sources(control_column="after")
    assert sources(mask_column="m1") != sources(mask_column="m2")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_cache_stores_each_tensor_in_the_dtype_the_encoders_computed_it_in(tiny_model, dtype):
    """A bf16 run's cache holds the encoders' bf16 output bit for bit (as uint16: numpy
    and Arrow have no bfloat16) in half the bytes of fp32, and reads back as the tensors
    uncached training feeds the denoiser; fp16 and fp32 outputs are stored as they are."""
    from raylora.data.cache import EncodeStage, from_column
    from raylora.data.demo import make_samples
    from raylora.data.preprocess import Preprocess, StageSpec
    from raylora.model.families import get as get_family
    from raylora.train.encode import batch_condition, vae_posterior

    samples = make_samples(4, size=64, seed=2)
    pre = Preprocess(StageSpec(tiny_model, 64, center_crop=True, random_flip=False))
    raw = pre({"image": np.array([img for img, _ in samples], dtype=object),
               "text": np.array([text for _, text in samples], dtype=object)})
    enc = EncodeStage(tiny_model, "sd", dtype, resolution=64)
    out = enc(dict(raw))

    # The text encoder runs in the run's dtype; the VAE too, except in fp16 (SD's VAE
    # overflows there: it is kept in fp32, as diffusers' scripts keep it).
    embeds = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[dtype]
    latents = np.float32 if dtype == "float16" else embeds
    assert (out["prompt_embeds"].dtype, out["latent_params"].dtype) == (embeds, latents)
    # What uncached training computes from the same batch, in the same dtype.
    family = get_family("sd")
    batch = {k: torch.from_numpy(v) for k, v in raw.items()}
    with torch.no_grad():
        params = vae_posterior(family, enc.vae, batch["pixel_values"])
        cond = batch_condition(family, enc.text_encoders, batch)
    for name, want in (("latent_params", params), ("prompt_embeds", cond["prompt_embeds"])):
        got = from_column(out[name])
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert out[name].nbytes == want.numel() * want.element_size()  # 2 bytes for bf16


def _encode_here(cfg, model: str, plan, store, rows_per_part: int):
    """``ensure_cache``'s build without Ray Data: ``EncodeFiles`` over every work item in
    this process, into the entry's folder. (uri, items, its output rows)."""
    from raylora import storage
    from raylora.data.cache import EncodeFiles, _stage_kwargs, _work_items, cache_root, fingerprint

    uri = storage.join(cache_root(cfg), fingerprint(cfg, "sd", model, plan, store))
    items = _work_items(cfg, plan, store, rows_per_part)
    pre, enc = _stage_kwargs(cfg, model, "sd", store)
    stage = EncodeFiles(cfg.data.model_dump(), [s.format for s in plan.sources],
                        [s.files for s in plan.sources], storage.join(uri, "parts"), pre, enc,
                        rows_per_part, 8)
    out = stage({k: np.array([it[k] for it in items])
                 for k in ("item", "k", "source", "index", "start", "stop")})
    return uri, items, [{k: v[i] for k, v in out.items()} for i in range(len(out["name"]))]


def test_a_shard_file_cut_into_parts_goes_to_the_worker_that_reads_it_uncached(tiny_model, tmp_path):
    """data.sharding=files dealt a latent cache's parts as if each were a shard file: a
    file cut into parts (of 256 rows in a run: two files of 300 rows made parts of 256, 44,
    256, 44, i.e. 512 and 88 rows a worker, and num_epochs=1 planned 22 steps for the
    uncached run's 75). Here two files of 6 rows in parts of 4: 8 and 4 rows a worker, 2
    steps for 3. Each part now goes to the worker that reads its file uncached: the same
    rows in the same order, the same steps. An entry built before its manifest recorded
    that is dealt so too (from its parts' names); a build records it."""
    from dataclasses import replace

    from raylora.data.cache import MANIFEST, ensure_cache
    from raylora.data.demo import write_parquet_shards
    from raylora.data.plan import plan_data
    from raylora.launch import _arithmetic
    from raylora.storage import Storage

    write_parquet_shards(tmp_path / "data", n=12, num_shards=2, size=32, seed=1)
    cfg = validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "o")},
                    "data": {"uri": str(tmp_path / "data"), "resolution": 32, "center_crop": True,
                             "cache": "latents", "cache_uri": str(tmp_path / "cache"),
                             "sharding": "files"},
                    "scaling": {"num_workers": 2}, "train": {"batch_size": 2, "num_epochs": 1}})
    store = Storage()
    plan = plan_data(cfg.data, store)
    assert plan.file_rows == [6, 6]
    uri, items, written = _encode_here(cfg, tiny_model, plan, store, 4)
    names = [r["name"] for r in written]
    assert [int(r["rows"]) for r in written] == [4, 2, 4, 2]
    uncached = _arithmetic(cfg, tiny_model, plan, [], [])
    assert uncached.max_steps == 3

    def dealt_as_uncached(entry):
        cached = replace(entry.plan(cfg.data), heldout_dropped=True)  # as apply_cache
        for rank in range(2):
            mine = cached.for_rank(rank, 2)
            assert mine.rows == plan.for_rank(rank, 2).rows == 6
            # its file's two parts, in order
            assert [f.rsplit("/", 1)[1] for f in mine.files] == names[2 * rank: 2 * rank + 2]
        assert _arithmetic(cfg, tiny_model, cached, [], []).max_steps == 3

    # As builds wrote the manifest before: reused, its parts dealt by the items in their names
    old = {"version": 2, "family": "sd", "files": [f"parts/{n}" for n in names],
           "file_rows": [4, 2, 4, 2], "file_sources": [0] * 4, "file_repeats": [1] * 4}
    with open(os.path.join(uri, MANIFEST), "w") as f:
        json.dump(old, f)
    entry = ensure_cache(cfg, "sd", tiny_model, plan, store, rows_per_part=4)
    assert entry.reused
    dealt_as_uncached(entry)

    # A build records each part's place (its file's), and a rerun reuses it so
    from raylora.data.cache import record_build

    built = record_build(cfg, "sd", plan, items, written, uri, store)
    manifest = json.loads(open(os.path.join(uri, MANIFEST)).read())
    assert manifest["file_deals"] == built.deals == [0, 0, 1, 1]
    dealt_as_uncached(built)
    dealt_as_uncached(ensure_cache(cfg, "sd", tiny_model, plan, store, rows_per_part=4))


def test_the_cache_records_what_its_build_decoded(tiny_model, tmp_path):
    """The rows a build dropped were counted only as it ran (in the run's counter), so a
    rerun reusing the entry had none to judge. Each build unit's counts come back with
    its parts (a unit none of whose rows was kept, too) and the manifest records the
    whole build's, examples in source order: what a fresh build's run judges."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylora.data.cache import MANIFEST, read_entry, record_build
    from raylora.data.demo import make_samples
    from raylora.data.plan import plan_data
    from raylora.storage import Storage

    samples = make_samples(12, size=32, seed=3)
    (tmp_path / "data").mkdir()
    for f, rows in enumerate((samples[:8], samples[8:])):
        images = [img if f == 0 and i % 3 else b"not an image" for i, (img, _) in enumerate(rows)]
        pq.write_table(pa.table({"image": images, "text": [t for _, t in rows]}),
                       tmp_path / "data" / f"part-{f}.parquet")
    cfg = validate({"model": {"pretrained": tiny_model}, "output": {"uri": str(tmp_path / "o")},
                    "data": {"uri": str(tmp_path / "data"), "resolution": 32, "center_crop": True,
                             "cache": "latents", "cache_uri": str(tmp_path / "cache")}})
    store = Storage()
    plan = plan_data(cfg.data, store)
    uri, items, written = _encode_here(cfg, tiny_model, plan, store, 256)
    # file 0: rows 0, 3, 6 bad; file 1: all 4 bad, no part, its counts in a row of its own
    assert [(r["name"], int(r["rows"])) for r in written] == [("part-000000-0000.parquet", 5), ("", 0)]
    assert [json.loads(r["counts"])["bad_records"] for r in written] == [{"not_an_image": 3},
                                                                         {"not_an_image": 4}]
    entry = record_build(cfg, "sd", plan, items, written, uri, store)
    f0, f1 = plan.files
    want = {"rows_ok": 5, "bad_records": {"not_an_image": 7}, "bad_fraction": 7 / 12,
            "rows_seen": 12, "rows_ok_by_source": {"0": 5},
            "bad_examples": {"not_an_image": [
                f"{f0}#{i}: not_an_image: no image format PIL reads starts b'not an i'"
                for i in (0, 3, 6)]}}
    assert entry.counts == want and entry.files == [f"{uri}/parts/part-000000-0000.parquet"]
    assert json.loads(open(os.path.join(uri, MANIFEST)).read())["decode_counts"] == want
    assert read_entry(uri, store).counts == want
