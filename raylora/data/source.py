"""Image-caption shards in any storage → a preprocessed, streaming ``ray.data.Dataset``.

The dataset is lazy: nothing is read until training workers iterate their shard. Shard
files are read in parallel with their order reshuffled every epoch (seeded), rows pass a
per-worker local shuffle buffer, and Ray Train's default DataConfig splits the stream with
``streaming_split(equal=True)``, so every worker sees the same number of rows per epoch
(DDP steps must line up) and each row is seen once per epoch (up to ``num_workers - 1``
rows of remainder). With ``data.sharding=files`` the driver instead builds one dataset per
worker from that worker's shard files (``DataPlan.for_rank``), read in order.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import ray
from ray.data import FileShuffleConfig

from raylora.config import DataSection
from raylora.data import formats
from raylora.data.preprocess import Preprocess, preprocess_batch
from raylora.data.split import KeepSplit
from raylora.data.tokenize import load_specs
from raylora.storage import Storage, fs_path

# Ray Data 2.60 lists parquet files through a pool of FooterReader actors, 32 of them by
# default: 32 new Python processes for every read, whatever the number of files. On small
# nodes starting them is most of a job's start-up (a 4-step run on 2 cores: 47 s → 34 s
# with one). One reader per 512 files (each does up to 128 footer reads at once), 1–32;
# a value the user set in the environment wins.
FOOTER_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


def footer_readers(num_files: int) -> int:
    return max(1, min(32, -(-num_files // 512)))


def read_parquet(paths: list[str], **kwargs) -> ray.data.Dataset:
    """``ray.data.read_parquet`` with the footer-reader pool sized to the file count (the
    reader reads the variable once, when the dataset is created here on the driver)."""
    if os.environ.get(FOOTER_ENV):
        return ray.data.read_parquet(paths, **kwargs)
    os.environ[FOOTER_ENV] = str(footer_readers(len(paths)))
    try:
        return ray.data.read_parquet(paths, **kwargs)
    finally:
        os.environ.pop(FOOTER_ENV, None)


SUFFIXES = {
    "parquet": formats.PARQUET_EXTS,
    "webdataset": formats.TAR_EXTS,
    "imagefolder": formats.IMAGE_EXTS + (formats.METADATA,),
}


@dataclass
class DataPlan:
    """What the driver learned about the data before any worker starts."""

    format: str
    files: list[str]
    rows: int
    file_rows: list[int] | None = None  # rows per file, where known (parquet, webdataset)

    def for_rank(self, rank: int, world: int) -> "DataPlan":
        """The shard files of one worker under ``data.sharding=files``."""
        files = self.files[rank::world]
        counts = (self.file_rows or [])[rank::world]
        return DataPlan(self.format, files, sum(counts), counts)


def plan_data(data: DataSection, storage: Storage) -> DataPlan:
    """Resolve URIs, detect the format, check columns and count rows.

    Raises FileNotFoundError / ValueError / OSError naming the URI or file at fault.
    """
    files = storage.expand(data.uri)
    fmt = formats.detect_format(files) if data.format == "auto" else data.format
    files = [f for f in files if f.lower().endswith(SUFFIXES[fmt])]
    if not files:
        raise FileNotFoundError(f"{data.uri}: matched no {fmt} files")
    file_rows = None
    if fmt == "parquet":
        file_rows = []
        for f in files:
            with storage.open_input(f) as fh:
                pf = pq.ParquetFile(fh)
                if not file_rows:
                    check_columns(data, f, pf.schema_arrow.names)
                file_rows.append(pf.metadata.num_rows)
        rows = sum(file_rows)
    elif fmt == "webdataset":
        file_rows = _count_webdataset(storage, files)
        rows = sum(file_rows)
    else:
        rows = len(formats.imagefolder_rows(storage, files, data.caption_column))
    return DataPlan(fmt, files, rows, file_rows)


def _count_webdataset(storage: Storage, files: list[str]) -> list[int]:
    """Samples per tar: from the shard builder's manifest when present, else by scanning
    tar headers."""
    roots = {f.rsplit("/", 1)[0] for f in files}
    if len(roots) == 1:
        manifest = formats.read_manifest(storage, roots.pop())
        if manifest and manifest.get("format") == "webdataset":
            listed = {s["name"]: s["count"] for s in manifest.get("shards", [])}
            names = [f.rsplit("/", 1)[1] for f in files]
            if all(n in listed for n in names):
                return [listed[n] for n in names]
    counts = []
    for f in files:
        with storage.open_input(f) as fh:
            counts.append(formats.count_tar_samples(fh))
    return counts


def check_columns(data: DataSection, file: str, names: list[str]) -> None:
    """Fail early, naming the file, when the configured columns are not in a shard."""
    missing = [
        f"data.{key}={col!r}"
        for key, col in (("image_column", data.image_column), ("caption_column", data.caption_column))
        if col not in names
    ]
    if missing:
        raise ValueError(f"{file}: column(s) not found: {', '.join(missing)}; the shard has {names}")


def _tar_rows(row: dict) -> list[dict]:
    """flat_map stage: one tar file's bytes → its samples."""
    import io

    return list(formats.iter_tar_samples(io.BytesIO(row["bytes"]), row["path"]))


@functools.lru_cache(maxsize=4)
def _storage(endpoint_url: str | None, region: str | None) -> Storage:
    """One per process and endpoint: it keeps its filesystem client between tasks."""
    return Storage(endpoint_url, region)


def _read_images(batch: dict[str, np.ndarray], endpoint_url: str | None,
                 region: str | None) -> dict[str, np.ndarray]:
    """map_batches stage for imagefolder rows: image URI → image bytes. A task, not an
    actor pool, for the reason given at ``preprocess_batch``."""
    storage = _storage(endpoint_url, region)
    images = [storage.read_bytes(u) for u in batch["uri"]]
    return {"key": batch["key"], "image": np.array(images, dtype=object), "text": batch["text"]}


def read_rows(
    data: DataSection, plan: DataPlan, storage: Storage, seed: int, shuffle: bool = True
) -> ray.data.Dataset:
    """Raw rows with columns ``key``, ``image`` (encoded bytes or struct), ``text``.
    ``shuffle``: reshuffle the file order every epoch (off: file order, for the cache)."""
    shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True) if shuffle else None
    fs, _ = storage.fs(plan.files[0])
    paths = [fs_path(f) for f in plan.files]
    if plan.format == "parquet":
        ds = read_parquet(
            paths, filesystem=fs, columns=[data.image_column, data.caption_column], shuffle=shuffle,
            include_paths=True,  # "path": where a bad row came from, for the report
        )
        return ds.rename_columns({data.image_column: "image", data.caption_column: "text"})
    if plan.format == "webdataset":
        ds = ray.data.read_binary_files(paths, filesystem=fs, include_paths=True, shuffle=shuffle)
        return ds.flat_map(_tar_rows)
    rows = formats.imagefolder_rows(storage, plan.files, data.caption_column)
    if shuffle is not None:
        rng = np.random.default_rng(seed)
        rows = [rows[i] for i in rng.permutation(len(rows))]
    blocks = max(1, min(64, len(rows) // 64))
    ds = ray.data.from_items(rows, override_num_blocks=blocks)
    return ds.map_batches(
        _read_images,
        fn_kwargs={"endpoint_url": storage.endpoint_url, "region": storage.region},
        batch_size=64,
        # No more than there are blocks: Ray Data warns about a limit it cannot reach.
        compute=ray.data.TaskPoolStrategy(size=min(2, blocks)),
        num_cpus=0.25,
    )


def build_dataset(
    data: DataSection,
    plan: DataPlan,
    storage: Storage,
    model_path: str,
    seed: int,
    num_preprocess_tasks: int = 1,
    family: str = "sd",
    bad_records: str | None = None,
) -> ray.data.Dataset:
    """The training rows, preprocessed. ``bad_records``: the name of the run's counter
    actor (``raylora.data.badrecords``) that rows failing the validating decode go to."""
    if data.cache == "latents":
        # plan.files are the cache's parquet files (see raylora.data.cache).
        from raylora.data.cache import read_cached_dataset

        return read_cached_dataset(plan.files, storage, seed)
    # sharding=files: the same file order every epoch (the local shuffle buffer, seeded per
    # epoch, still reorders rows), so an epoch's order is a function of the seed and epoch
    # alone and a resumed run can skip exactly the batches it already trained on.
    rows = read_rows(data, plan, storage, seed, shuffle=data.sharding != "files")
    if data.validation_split:
        # Training never sees a held-out row (see raylora.data.split).
        rows = rows.map_batches(KeepSplit(data.validation_split), batch_format="numpy")
    stage = dict(
        tokenizer_path=model_path,
        resolution=data.resolution,
        center_crop=data.center_crop,
        random_flip=data.random_flip,
        image_column="image",
        caption_column="text",
        seed=seed,
        endpoint_url=storage.endpoint_url,
        region=storage.region,
        caption_dropout=data.caption_dropout,
        family=family,
        bad_records=bad_records,
        # Read here, once, on the driver: see raylora.data.tokenize.
        tokenizer_specs=load_specs(model_path, family, storage),
        **data.decode_kwargs(),
    )
    if data.sharding == "files":
        # A new actor per epoch whose random crops and flips start from the seed again:
        # each row gets the same draws in every run whatever the processes or timing, so
        # a resumed run repeats the straight run exactly (the promise of
        # sharding=files). The price is the actor's start-up every epoch.
        how = dict(fn_constructor_kwargs=stage,
                   compute=ray.data.ActorPoolStrategy(size=num_preprocess_tasks))
        fn = Preprocess
    else:
        # Tasks, not an actor pool, so later epochs skip the start-up: see
        # preprocess_batch. Draws then depend on which process gets which batch, which
        # with several preprocess processes they already did.
        how = dict(fn_kwargs=stage, compute=ray.data.TaskPoolStrategy(size=num_preprocess_tasks))
        fn = preprocess_batch
    return rows.map_batches(fn, batch_size=32, batch_format="numpy", num_cpus=0.5, **how)
