"""Folders as img2dataset writes them, read where they lie: its webdataset output (tars with
a metadata parquet and a ``_stats.json`` beside each), its files output (a folder per
shard) and its parquet output, each detected with ``data.format: auto``. A tar's samples
are counted from its ``_stats.json`` without reading the tar, unless the sidecar cannot be
trusted (missing, unreadable, older than the tar): then the tar is read to count it."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raylora.config import DataSection
from raylora.data import formats
from raylora.data.formats import base, webdataset
from raylora.data.source import plan_data
from raylora.storage import Storage

SHARDS, PER_SHARD, FAILED = 2, 5, 3  # sample FAILED of each shard "failed to download"


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    img = np.random.default_rng(seed).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    Image.fromarray(img).save(buf, "JPEG")
    return buf.getvalue()


def write_tar(path: str, samples: list[tuple[str, bytes, str]]) -> None:
    """A tar as webdataset's TarWriter writes it for img2dataset: KEY.jpg, KEY.txt, KEY.json."""
    with tarfile.open(path, "w") as tar:
        for key, jpg, caption in samples:
            for ext, payload in (("jpg", jpg), ("txt", caption.encode()),
                                 ("json", json.dumps({"key": key, "caption": caption}).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def write_img2dataset(root: str, output: str) -> list[str]:
    """``img2dataset --output_format {output}`` of SHARDS × PER_SHARD urls, FAILED of each
    shard not downloaded, written as img2dataset does (the shard, its metadata parquet,
    then ``_stats.json``). The captions of the written samples, in order."""
    os.makedirs(root, exist_ok=True)
    captions = []
    for s in range(SHARDS):
        name = f"{s:05d}"
        meta, samples = [], []
        for i in range(PER_SHARD):
            key, caption, ok = f"{name}{i:04d}", f"shard {s} sample {i}", i != FAILED
            meta.append({"url": f"http://example.invalid/{key}.jpg", "caption": caption, "key": key,
                         "status": "success" if ok else "failed_to_download",
                         "error_message": None if ok else "404", "width": 24 if ok else None})
            if ok:
                samples.append((key, _jpeg(s * 100 + i), caption))
                captions.append(caption)
        if output == "webdataset":
            write_tar(f"{root}/{name}.tar", samples)
        elif output == "files":
            os.makedirs(f"{root}/{name}")
            for key, jpg, caption in samples:
                open(f"{root}/{name}/{key}.jpg", "wb").write(jpg)
                open(f"{root}/{name}/{key}.txt", "w").write(caption)
                open(f"{root}/{name}/{key}.json", "w").write(json.dumps({"key": key}))
        else:  # parquet: the samples' bytes in a `jpg` column, every url a row
            rows = [{**m, "jpg": jpg, "txt": c} for m, (_, jpg, c) in
                    zip([m for m in meta if m["status"] == "success"], samples)]
            pq.write_table(pa.Table.from_pylist(rows), f"{root}/{name}.parquet")
        if output != "parquet":
            pq.write_table(pa.Table.from_pylist(meta), f"{root}/{name}.parquet")
        with open(f"{root}/{name}_stats.json", "w") as f:
            json.dump({"count": PER_SHARD, "successes": len(samples), "failed_to_download": 1,
                       "failed_to_resize": 0, "duration": 1.5, "status_dict": {"success": 4}}, f)
    return captions


@pytest.mark.parametrize("output,fmt", [("webdataset", "webdataset"), ("files", "captionfolder"),
                                        ("parquet", "parquet")])
def test_each_img2dataset_output_is_read_where_it_lies(tmp_path, output, fmt):
    root = str(tmp_path / output)
    captions = write_img2dataset(root, output)
    store = Storage()
    data = DataSection(uri=root)
    if output == "parquet":  # its columns are jpg and txt: named, with the fix
        with pytest.raises(ValueError) as err:
            plan_data(data, store)
        assert str(err.value).endswith("'error_message', 'width', 'jpg', 'txt'] (try "
                                       "data.image_column=jpg data.caption_column=txt)")
        data = DataSection(uri=root, image_column="jpg", caption_column="txt")
    plan = plan_data(data, store)
    # Before: any parquet in a listing made it parquet, and img2dataset's metadata beside
    # the tars was refused for having no image column.
    assert plan.format == fmt
    assert plan.rows == SHARDS * (PER_SHARD - 1) == len(captions)
    rows = list(formats.get_format(fmt).iter_rows(data, plan.files, store))
    assert [r["text"] for r in rows] == captions
    assert all(Image.open(io.BytesIO(r["image"])).size == (24, 24) for r in rows)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The URIs of every file the driver opens to read through ``Storage.open_input``."""
    seen = []
    real = Storage.open_input

    def record(self, uri):
        seen.append(uri)
        return real(self, uri)

    monkeypatch.setattr(Storage, "open_input", record)
    return seen


def test_tars_are_counted_from_their_stats_without_being_read(tmp_path, opened):
    root = str(tmp_path / "wds")
    write_img2dataset(root, "webdataset")
    store = Storage()
    plan = plan_data(DataSection(uri=root), store)
    assert plan.rows == 8 and plan.file_rows == [4, 4]
    assert opened == []  # no tar read (each was read whole before: every byte of it)
    rows = list(webdataset.WebDataset().iter_rows(DataSection(uri=root), plan.files, store))
    assert len(rows) == plan.rows  # what the stats said is what the tars hold


STATS_CASES = {
    # case: (what _stats.json of shard 1 becomes, seconds the tar is newer, read?)
    "tar rewritten after its stats": (None, 120, "tar newer than its _stats.json"),
    "tar newer within the slack": (None, 30, None),
    "no stats": ("delete", 0, "no _stats.json"),
    "stats not json": ("{", 0, "_stats.json unreadable"),
    "stats without successes": ({"count": 5}, 0, "_stats.json without a sample count"),
    "successes a string": ({"successes": "4"}, 0, "_stats.json without a sample count"),
    "successes over count": ({"count": 2, "successes": 4}, 0, "_stats.json without a sample count"),
    "stats a list": ([4], 0, "_stats.json without a sample count"),
}


@pytest.mark.parametrize("case", list(STATS_CASES))
def test_a_tar_whose_stats_cannot_be_trusted_is_read_to_count_it(tmp_path, opened, caplog,
                                                                 monkeypatch, case):
    """Shard 1's tar holds 2 samples where its stats say 4: the count says which was read."""
    stats, newer, why = STATS_CASES[case]
    root = str(tmp_path / "wds")
    write_img2dataset(root, "webdataset")
    tar, side = f"{root}/00001.tar", f"{root}/00001_stats.json"
    write_tar(tar, [(f"k{i}", _jpeg(i), f"new {i}") for i in range(2)])
    if stats == "delete":
        os.remove(side)
    elif stats is not None:
        with open(side, "w") as f:
            f.write(stats if isinstance(stats, str) else json.dumps(stats))
    if os.path.exists(side):
        t = os.stat(side).st_mtime
        os.utime(tar, (t + newer, t + newer))
    monkeypatch.setattr(webdataset, "SCAN_NOTE_BYTES", 0)
    with caplog.at_level(logging.INFO, logger="raylora.data"):
        plan = plan_data(DataSection(uri=root), Storage())
    if why is None:  # trusted: the stats' 4, and no tar opened
        assert plan.file_rows == [4, 4] and opened == [] and caplog.messages == []
        return
    assert plan.file_rows == [4, 2]  # shard 0 from its stats, shard 1 read
    assert opened == [tar]
    size = os.path.getsize(tar) / 1e9
    assert caplog.messages == [
        f"webdataset: 1 of 2 tar(s) ({size:.1f} GB) read whole to count their samples ({why}: 1); "
        "a manifest.json (raylora shards build) or img2dataset's _stats.json beside them is read "
        "instead"]


def test_files_are_read_at_once_and_the_first_error_in_order_is_raised():
    """Planning opens each file's footer or sidecar: one round trip to the store each, so
    they go at once. Four calls that each wait for all four would hang one at a time."""
    meet = threading.Barrier(4, timeout=30)
    assert base.concurrently(lambda x: (meet.wait(), x * x)[1], range(4)) == [0, 1, 4, 9]

    def fail(x):
        if x in (1, 3):
            raise FileNotFoundError(f"file {x}")
        return x

    with pytest.raises(FileNotFoundError, match="^file 1$"):
        base.concurrently(fail, range(5))


@pytest.fixture
def s3_store(moto_endpoint, monkeypatch):
    """A bucket on the session's S3 server (fake credentials for this test only), and a
    proxy in front of the server that records every request."""
    import boto3

    from tests.faultproxy import FaultProxy

    for k, v in (("AWS_ACCESS_KEY_ID", "AKIARAYLORAFAKE00007"), ("AWS_SECRET_ACCESS_KEY", "fake/secret"),
                 ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket="raylora-i2d")
    requests = []
    with FaultProxy(moto_endpoint, fail_if=lambda method, path, body: requests.append(
            (method, path.split("?")[0])) and False) as proxy:
        yield Storage(endpoint_url=proxy.url), requests


def test_img2dataset_tars_in_s3_are_counted_from_their_stats(tmp_path, s3_store):
    """In the bucket as img2dataset uploads it (each tar, then its sidecars): one listing of
    the folder and a GET per _stats.json, no GET of a tar."""
    store, requests = s3_store
    local = str(tmp_path / "wds")
    write_img2dataset(local, "webdataset")
    uri = "s3://raylora-i2d/laion/out"
    for name in sorted(os.listdir(local), key=lambda n: (n[:5], not n.endswith(".tar"))):
        store.write_bytes(f"{uri}/{name}", open(f"{local}/{name}", "rb").read())
    requests.clear()
    plan = plan_data(DataSection(uri=uri), store)
    assert plan.format == "webdataset" and plan.file_rows == [4, 4]
    gets = sorted(p for m, p in requests if m == "GET" and not p.rstrip("/").endswith("raylora-i2d"))
    assert gets == ["/raylora-i2d/laion/out/00000_stats.json", "/raylora-i2d/laion/out/00001_stats.json"]
    rows = list(webdataset.WebDataset().iter_rows(DataSection(uri=uri), plan.files, store))
    assert len(rows) == 8
    # The shards as WebDataset spells them: found in the folder's listing, no request each.
    requests.clear()
    spelled = plan_data(DataSection(uri=uri + "/{00000..00001}.tar"), store)
    assert spelled.files == plan.files and spelled.file_rows == [4, 4]
    assert [(m, p) for m, p in requests if p.endswith(".tar")] == []
