"""``raylora shards build``: an image folder → sized parquet or WebDataset shards on any URI.

Captions come from ``metadata.jsonl`` (``file_name``, ``text``) or from a ``.txt`` file
beside each image. Each shard is written by one Ray task, so a large folder is sharded in
parallel across the cluster; a ``manifest.json`` (count, bytes, schema, per-shard counts)
is written last, when every shard exists.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq

from raylora.data import formats
from raylora.storage import Storage, join, normalize

PARQUET_SCHEMA = pa.schema([("key", pa.string()), ("image", pa.binary()), ("text", pa.string())])


def collect_items(store: Storage, src: str) -> list[dict]:
    """``[{"key", "uri", "text"}]`` for every captioned image under ``src``, sorted by key."""
    src = normalize(src)
    files = store.list_files(src)
    if not files:
        raise FileNotFoundError(f"{src}: no files found")
    if any(posixpath.basename(f) == formats.METADATA for f in files):
        items = formats.imagefolder_rows(store, files, "text")
    else:
        texts = {f[: -len(".txt")] for f in files if f.endswith(".txt")}
        items = []
        for f in files:
            stem, ext = posixpath.splitext(f)
            if ext.lower() in formats.IMAGE_EXTS and stem in texts:
                text = store.read_bytes(stem + ".txt").decode("utf-8").strip()
                items.append({"key": stem, "uri": f, "text": text})
    if not items:
        raise FileNotFoundError(
            f"{src}: no captioned images (need {formats.METADATA} or a .txt beside each image)"
        )
    for it in items:  # keys relative to the source folder, stable across machines
        it["key"] = posixpath.splitext(it["key"][len(src) + 1 :])[0]
    return sorted(items, key=lambda it: it["key"])


def write_shard(store: Storage, dest: str, fmt: str, index: int, items: list[dict]) -> dict:
    """Write one shard; returns ``{"name", "count", "bytes"}``."""
    if fmt == "parquet":
        name = f"shard-{index:05d}.parquet"
        table = pa.table(
            {
                "key": [it["key"] for it in items],
                "image": [store.read_bytes(it["uri"]) for it in items],
                "text": [it["text"] for it in items],
            },
            schema=PARQUET_SCHEMA,
        )
        buf = io.BytesIO()
        pq.write_table(table, buf)
        data = buf.getvalue()
    else:
        name = f"shard-{index:05d}.tar"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, it in enumerate(items):
                # img2dataset-style keys: the sample's index, zero-padded, shard-prefixed.
                key = f"{index:05d}{i:04d}"
                ext = posixpath.splitext(it["uri"])[1].lower()
                for suffix, payload in (
                    (ext, store.read_bytes(it["uri"])),
                    (".txt", it["text"].encode("utf-8")),
                    (".json", json.dumps({"key": it["key"], "caption": it["text"]}).encode()),
                ):
                    info = tarfile.TarInfo(key + suffix)
                    info.size = len(payload)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(payload))
        data = buf.getvalue()
    store.write_bytes(join(dest, name), data)
    return {"name": name, "count": len(items), "bytes": len(data)}


class _WriteShard:
    def __init__(self, endpoint_url, region, dest, fmt):
        self.store = Storage(endpoint_url, region)
        self.dest, self.fmt = dest, fmt

    def __call__(self, row: dict) -> dict:
        return write_shard(self.store, self.dest, self.fmt, int(row["index"]), json.loads(row["items"]))


def build_shards(
    src: str, dest: str, fmt: str, shard_size: int, store: Storage | None = None
) -> dict:
    """Shard ``src`` into ``dest`` with Ray Data (one task per shard); returns the manifest."""
    import ray

    if fmt not in ("parquet", "webdataset"):
        raise ValueError(f"--format: {fmt!r} is not parquet or webdataset")
    if shard_size <= 0:
        raise ValueError(f"--shard-size: must be positive, got {shard_size}")
    store = store or Storage()
    dest = normalize(dest)
    items = collect_items(store, src)
    chunks = [items[i : i + shard_size] for i in range(0, len(items), shard_size)]
    rows = [{"index": i, "items": json.dumps(c)} for i, c in enumerate(chunks)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    stats = ds.map(
        _WriteShard,
        fn_constructor_kwargs=dict(
            endpoint_url=store.endpoint_url, region=store.region, dest=dest, fmt=fmt
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4),
        num_cpus=0.5,
    ).take_all()
    shards = sorted(stats, key=lambda s: s["name"])
    manifest = {
        "format": fmt,
        "count": sum(s["count"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "schema": (
            {"key": "string", "image": "binary (encoded image)", "text": "string"}
            if fmt == "parquet"
            else {"KEY.<image ext>": "encoded image", "KEY.txt": "caption", "KEY.json": "{key, caption}"}
        ),
        "source": normalize(src),
        "shards": shards,
    }
    store.write_bytes(join(dest, formats.MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest
