"""The shard-format registry: every format picks its files out of a listing, counts its
rows, reads them in the same shape by either reader (plain, and Ray Data), and names
where a bad sample is the same way, as ``{key}: {reason}``."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from raylora.config import DataSection
from raylora.data import formats
from raylora.data.shards import build_shards, collect_items, write_shard
from raylora.data.source import plan_data
from raylora.storage import Storage

N = 6
BAD = 2  # the sample whose image bytes are not an image


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[dict[str, str], list[str]]:
    """The same 6 captioned images (one of them broken) in every format, with a stray file
    beside each, and the captions in source order."""
    from raylora.data.demo import write_imagefolder

    root = tmp_path_factory.mktemp("formats")
    src = write_imagefolder(root / "imagefolder", n=N, size=16, seed=3)
    (src / f"img_{BAD:05d}.png").write_bytes(b"this is no image")
    store = Storage()
    items = collect_items(store, str(src))
    uris = {"imagefolder": str(src)}
    for fmt in formats.writable_formats():
        dest = str(root / fmt)
        write_shard(store, dest, fmt, 0, items[:4])
        write_shard(store, dest, fmt, 1, items[4:])
        uris[fmt] = dest
    for uri in uris.values():
        (root / uri / "notes.json").write_text("{}")  # stray: no format reads it
    return uris, [it["text"] for it in items]


def test_registry_matches_the_config_choices():
    choices = typing.get_args(DataSection.model_fields["format"].annotation)
    assert [c for c in choices if c != "auto"] == list(formats.FORMATS)
    assert formats.writable_formats() == ["parquet", "webdataset"]


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_each_format_lists_counts_and_reads_rows(shards, fmt):
    uris, texts = shards
    plan = plan_data(DataSection(uri=uris[fmt]), Storage())
    assert plan.format == fmt  # detected, with the stray file beside the shards
    assert not any(f.endswith("notes.json") for f in plan.files)
    assert len(plan.files) == {"imagefolder": N + 1}.get(fmt, 2)  # images + metadata.jsonl
    assert plan.rows == N
    assert plan.file_rows == (None if fmt == "imagefolder" else [4, 2])
    rows = list(formats.get_format(fmt).iter_rows(DataSection(uri=uris[fmt]), plan.files, Storage()))
    assert [r["text"] for r in rows] == texts  # file order
    assert all(isinstance(r["image"], bytes) and r["image"] for r in rows)
    keys = [r["key"] for r in rows]
    assert len(set(keys)) == N
    # A key names the file the sample is in (for imagefolder: the image itself).
    assert all(any(k == f or k.startswith(f + "#") for f in plan.files) for k in keys)


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_units_cover_the_rows_in_order(shards, fmt):
    """The latent cache reads a format in units (raylora.data.cache): together they are
    every row once, in source order."""
    uris, texts = shards
    data = DataSection(uri=uris[fmt])
    plan = plan_data(data, Storage())
    entry = formats.get_format(fmt).units(data, plan.files, Storage(), 4)
    assert len(entry) == 2  # two shard files, or 6 imagefolder rows in slices of 4
    got = [r["text"] for u in entry
           for r in formats.get_format(fmt).iter_unit(data, plan.files, Storage(), *u)]
    assert got == texts


@pytest.mark.parametrize("fmt", list(formats.FORMATS))
def test_a_bad_sample_is_reported_at_its_key(shards, tiny_model, fmt):
    from raylora.data.preprocess import Preprocess

    uris, texts = shards
    data = DataSection(uri=uris[fmt])
    plan = plan_data(data, Storage())
    rows = list(formats.get_format(fmt).iter_rows(data, plan.files, Storage()))
    sent = []
    stage = Preprocess(tiny_model, 16, center_crop=True, random_flip=False)
    stage.reporter.send = lambda ok, bad, examples: sent.append((ok, dict(bad), examples))
    out = stage({k: np.array([r[k] for r in rows], dtype=object) for k in ("key", "image", "text")})
    assert out["pixel_values"].shape == (N - 1, 3, 16, 16)
    ((ok, bad, examples),) = sent
    assert (ok, bad) == (N - 1, {"not_an_image": 1})
    (example,) = examples["not_an_image"]
    assert example.startswith(rows[BAD]["key"] + ": not_an_image")
    assert {"parquet": ".parquet#2", "webdataset": ".tar#000000002",
            "imagefolder": f"img_{BAD:05d}.png"}[fmt] in example


def test_ray_reader_gives_the_plain_readers_rows(shards, ray_local):
    from raylora.data.source import read_rows

    uris, texts = shards
    for fmt in formats.FORMATS:
        data = DataSection(uri=uris[fmt])
        plan = plan_data(data, Storage())
        plain = {r["key"]: r["text"] for r in formats.get_format(fmt).iter_rows(data, plan.files, Storage())}
        got = read_rows(data, plan, Storage(), seed=0).take_all()
        assert {"key", "image", "text"} <= set(got[0]), fmt
        assert {r["key"]: r["text"] for r in got} == plain, fmt


def test_formats_without_a_writer_are_refused(shards, tmp_path):
    uris, _ = shards
    with pytest.raises(ValueError, match="imagefolder shards cannot be written"):
        write_shard(Storage(), str(tmp_path), "imagefolder", 0, [])
    with pytest.raises(ValueError, match="--format: 'imagefolder' is not parquet or webdataset"):
        build_shards(uris["imagefolder"], str(tmp_path / "out"), "imagefolder", 2)
    with pytest.raises(ValueError, match="data.format: 'csv' is not one of parquet, webdataset"):
        formats.get_format("csv")
