"""Image-caption shards → a preprocessed, streaming ``ray.data.Dataset``.

The dataset is lazy: nothing is read until training workers iterate their shard, and
Ray Train's default DataConfig splits it across workers with ``streaming_split(equal=True)``
so every worker sees the same number of rows per epoch (needed: DDP steps must line up)
and each row is seen once per epoch (up to ``num_workers - 1`` rows of remainder).
"""

from __future__ import annotations

import pyarrow.parquet as pq
import ray
from ray.data import FileShuffleConfig

from raylora import storage
from raylora.config import DataSection
from raylora.data.preprocess import Preprocess

PARQUET_SUFFIXES = (".parquet", ".pq")


def shard_files(data: DataSection) -> list[str]:
    """Sorted shard paths; raises FileNotFoundError naming the URI that matched nothing."""
    return storage.expand(data.uri, PARQUET_SUFFIXES)


def count_rows(files: list[str]) -> int:
    """Row count from parquet footers, without reading any image bytes."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def check_columns(data: DataSection, files: list[str]) -> None:
    """Fail early, naming the file, when the configured columns are not in a shard."""
    schema = pq.read_schema(files[0])
    missing = [
        f"data.{key}={col!r}"
        for key, col in (("image_column", data.image_column), ("caption_column", data.caption_column))
        if col not in schema.names
    ]
    if missing:
        raise ValueError(
            f"{files[0]}: column(s) not found: {', '.join(missing)}; "
            f"the shard has columns {schema.names}"
        )


def build_dataset(
    data: DataSection,
    files: list[str],
    tokenizer_path: str,
    seed: int,
    num_preprocess_actors: int = 1,
) -> ray.data.Dataset:
    ds = ray.data.read_parquet(
        files,
        columns=[data.image_column, data.caption_column],
        # Shard order changes every epoch; rows inside a file are shuffled by the
        # trainer-side local buffer.
        shuffle=FileShuffleConfig(seed=seed, reseed_after_execution=True),
    )
    return ds.map_batches(
        Preprocess,
        fn_constructor_kwargs=dict(
            tokenizer_path=tokenizer_path,
            resolution=data.resolution,
            center_crop=data.center_crop,
            random_flip=data.random_flip,
            image_column=data.image_column,
            caption_column=data.caption_column,
            seed=seed,
        ),
        batch_size=32,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=num_preprocess_actors),
        num_cpus=0.5,
    )
