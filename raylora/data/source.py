"""Image-caption shards in any storage → a preprocessed, streaming ``ray.data.Dataset``.

The dataset is lazy: nothing is read until training workers iterate their shard. Shard
files are read in parallel in parts (parquet: runs of row groups, ``read_parquet_parts``)
whose order is reshuffled every epoch (seeded), rows pass a
per-worker local shuffle buffer, and Ray Train's default DataConfig splits the stream with
``streaming_split(equal=True)``, so every worker sees the same number of rows per epoch
(DDP steps must line up) and each row is seen once per epoch (up to ``num_workers - 1``
rows of remainder). With ``data.sharding=files`` each worker instead builds a dataset of
its own shard files (``DataPlan.for_rank``) for every epoch, read in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import ray

from raylora.config import DataSection
from raylora.data.formats import detect_format, get_format
from raylora.data.formats.base import process_storage as _storage
from raylora.data.preprocess import Preprocess, preprocess_batch
from raylora.data.split import KeepSplit
from raylora.data.tokenize import load_specs
from raylora.storage import Storage

# Parquet is read by raylora's own row-group tasks, not ``ray.data.read_parquet``. Ray Data
# 2.60's reader re-lists the files every epoch through a new FooterReader actor (a fresh
# Python process per epoch, ~1.4 s of a 10 s epoch on 2 cores, bench/ingest.py), and packs
# row groups into read tasks of up to 128 MiB: ~670 photo rows that one task decodes for
# 6-7 s before its first row reaches training, with the last task running alone. The driver
# already read every footer (plan_data), so it cuts each file into parts of about
# READ_UNIT_ROWS rows; a part is a task that reads its row groups and, fused with the
# preprocessing stage, decodes them (no JPEG bytes through the object store).
READ_UNIT_ROWS = 256


def parquet_parts(files: list[str], file_rows: list[int] | None, unit_rows: int) -> list[dict]:
    """Read units: ``{uri, part, parts}``, ``parts`` per file from its row count (one per
    file where the count is unknown). The row groups of a part are chosen by the task
    (``row_groups_of_part``), which opens the footer anyway."""
    known = file_rows is not None and len(file_rows) == len(files)
    counts = file_rows if known else [0] * len(files)
    return [
        {"uri": f, "part": k, "parts": n}
        for f, rows in zip(files, counts)
        for n in [max(1, -(-rows // unit_rows))]
        for k in range(n)
    ]


def row_groups_of_part(group_rows: list[int], part: int, parts: int) -> list[int]:
    """The row groups of part ``part`` of ``parts``: those whose first row falls in that
    part's share of the file's rows. Every group is in exactly one part, contiguous; a
    group larger than a share leaves later parts empty (a row group is read whole)."""
    total, start, groups = sum(group_rows), 0, []
    for i, n in enumerate(group_rows):
        if total and start * parts // total == part:
            groups.append(i)
        start += n
    return groups


def _read_parts(batch: dict[str, np.ndarray], columns: list[str] | None,
                renames: dict[str, str], with_path: bool, with_key: bool,
                endpoint_url: str | None, region: str | None):
    """map_batches stage: read units → their rows, as Arrow tables of at most 64 rows (a
    part's memory is one row group's, whatever the part size), with ``path``, the file's
    URI, when ``with_path``, and ``key``, ``{uri}#{row in file}``, when ``with_key``."""
    import pyarrow as pa

    storage = _storage(endpoint_url, region)
    for uri, part, parts in zip(batch["uri"], batch["part"], batch["parts"]):
        with storage.open_input(uri) as fh:
            pf = pq.ParquetFile(fh)
            meta = pf.metadata
            group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            groups = row_groups_of_part(group_rows, int(part), int(parts))
            if not groups:
                continue
            row = sum(group_rows[: groups[0]])  # a part's groups are contiguous
            for rb in pf.iter_batches(batch_size=64, row_groups=groups, columns=columns):
                table = pa.Table.from_batches([rb])
                table = table.rename_columns([renames.get(c, c) for c in table.column_names])
                if with_path:
                    table = table.append_column("path", pa.array([str(uri)] * len(table), pa.string()))
                if with_key:
                    keys = [f"{uri}#{r}" for r in range(row, row + len(table))]
                    table = table.append_column("key", pa.array(keys, pa.string()))
                row += len(table)
                yield table


def read_parquet_parts(
    files: list[str], file_rows: list[int] | None, storage: Storage, seed: int, shuffle: bool,
    columns: list[str] | None = None, renames: dict[str, str] | None = None,
    with_path: bool = True, with_key: bool = False, unit_rows: int | None = None, **map_args,
) -> ray.data.Dataset:
    """Rows of parquet ``files`` read in parts (see READ_UNIT_ROWS). ``shuffle``: a new
    part order every epoch, from ``seed`` and the epoch (Ray's execution index), as Ray's
    file shuffle gave; off: file order. ``map_args``: the read stage's ``compute`` and
    ``num_cpus``, the same as the next stage's so that Ray Data fuses the two."""
    from ray.data import RandomSeedConfig

    parts = parquet_parts(files, file_rows, unit_rows or READ_UNIT_ROWS)
    if shuffle:
        # Spread each file's parts over the blocks too (when blocks hold several parts).
        rng = np.random.default_rng(seed)
        parts = [parts[i] for i in rng.permutation(len(parts))]
    # One part per block up to 1024 blocks: the block is what is reshuffled and scheduled.
    ds = ray.data.from_items(parts, override_num_blocks=min(len(parts), 1024))
    if shuffle:
        ds = ds.randomize_block_order(seed=RandomSeedConfig(seed=seed, reseed_after_execution=True))
    return ds.map_batches(
        _read_parts, batch_size=1, batch_format="numpy",
        fn_kwargs={"columns": columns, "renames": renames or {}, "with_path": with_path,
                   "with_key": with_key, "endpoint_url": storage.endpoint_url,
                   "region": storage.region},
        **map_args,
    )


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
    fmt = get_format(detect_format(files) if data.format == "auto" else data.format)
    files = fmt.select(files)
    if not files:
        raise FileNotFoundError(f"{data.uri}: matched no {fmt.name} files")
    rows, file_rows = fmt.count_rows(data, files, storage)
    return DataPlan(fmt.name, files, rows, file_rows)


def read_rows(
    data: DataSection, plan: DataPlan, storage: Storage, seed: int, shuffle: bool = True,
    **map_args,
) -> ray.data.Dataset:
    """Raw rows with columns ``key`` (where the sample is, for bad-row reports), ``image``
    (encoded bytes or struct), ``text``. ``shuffle``: reshuffle the file (parquet: part)
    order every epoch (off: file order). ``map_args``: the parquet read stage's ``compute``
    and ``num_cpus`` (see ``read_parquet_parts``)."""
    return get_format(plan.format).read_dataset(data, plan.files, plan.file_rows, storage,
                                                seed, shuffle, **map_args)


def build_dataset(
    data: DataSection,
    plan: DataPlan,
    storage: Storage,
    model_path: str,
    seed: int,
    num_preprocess_tasks: int = 1,
    family: str = "sd",
    bad_records: str | None = None,
    tokenizer_specs: tuple | None = None,
    epoch: int = 0,
) -> ray.data.Dataset:
    """The training rows, preprocessed. ``bad_records``: the name of the run's counter
    actor (``raylora.data.badrecords``) that rows failing the validating decode go to.
    ``tokenizer_specs``: ``load_specs(model_path, family, storage)`` when the caller
    already has them (one load for all per-worker datasets); else loaded here.

    ``data.sharding=files``: one worker's dataset for one ``epoch``, rows in file order
    (``preserve_order`` is set on it), with crop/flip/dropout draws seeded by the seed and
    the epoch: the same rows and draws in a rebuilt or resumed epoch, new draws in the
    next one. Other modes build one dataset for every epoch and ignore ``epoch``."""
    if data.sharding == "files":
        # Rebuilt for every epoch (Ray's per-execution reseeding would restart at a resume).
        seed = epoch_seed(seed, epoch)
    if data.cache == "latents":
        # plan.files are the cache's parquet files (see raylora.data.cache).
        from raylora.data.cache import read_cached_dataset

        ds = read_cached_dataset(plan.files, plan.file_rows, storage, seed)
    else:
        ds = _preprocessed_rows(data, plan, storage, model_path, seed, num_preprocess_tasks,
                                family, bad_records, tokenizer_specs)
    if data.sharding == "files":
        # A per-dataset copy of the context: other datasets keep Ray's default.
        ds.context.execution_options.preserve_order = True
    return ds


def epoch_seed(seed: int, epoch: int) -> int:
    """The preprocessing draws' seed for ``epoch`` of a ``sharding=files`` run."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _preprocessed_rows(data: DataSection, plan: DataPlan, storage: Storage, model_path: str,
                       seed: int, num_preprocess_tasks: int, family: str, bad_records: str | None,
                       tokenizer_specs: tuple | None) -> ray.data.Dataset:
    """Shard rows read, decoded and preprocessed (build_dataset without a cache)."""
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
        # Read once, on the driver: see raylora.data.tokenize.
        tokenizer_specs=tokenizer_specs or load_specs(model_path, family, storage),
        **data.decode_kwargs(),
    )
    if data.sharding == "files":
        # A new actor per epoch whose random crops and flips start from the epoch's seed:
        # each row gets the same draws in every run whatever the processes or timing, so
        # a resumed run repeats the straight run exactly (the promise of
        # sharding=files). The price is the actor's start-up every epoch. One task in
        # flight: Ray Data lets an actor run its queued tasks out of order, which would
        # hand the draws to the parts in whatever order they ran (a resumed run's sample
        # differed from the straight run's at an epoch start).
        fn, how = Preprocess, dict(fn_constructor_kwargs=stage)
        compute = ray.data.ActorPoolStrategy(size=num_preprocess_tasks,
                                             max_tasks_in_flight_per_actor=1)
        read_compute = ray.data.TaskPoolStrategy(size=num_preprocess_tasks)
    else:
        # Tasks, not an actor pool, so later epochs skip the start-up: see
        # preprocess_batch. Draws then depend on which process gets which batch, which
        # with several preprocess processes they already did.
        fn, how = preprocess_batch, dict(fn_kwargs=stage)
        compute = read_compute = ray.data.TaskPoolStrategy(size=num_preprocess_tasks)
    # The stages before preprocessing take the same task limit and CPUs, so Ray Data fuses
    # them into one task per read part (parquet): read, split, decode, in one process.
    before = dict(compute=read_compute, num_cpus=0.5)
    # sharding=files: the same file order every epoch (the local shuffle buffer, seeded per
    # epoch, still reorders rows), so an epoch's order is a function of the seed and epoch
    # alone and a resumed run can skip exactly the batches it already trained on.
    rows = read_rows(data, plan, storage, seed, shuffle=data.sharding != "files", **before)
    if data.validation_split:
        # Training never sees a held-out row (see raylora.data.split).
        rows = rows.map_batches(KeepSplit(data.validation_split), batch_format="numpy", **before)
    # Parquet: a whole read part per call (about READ_UNIT_ROWS rows). A batch size here
    # would make Ray Data bundle that many *parts* into one fused task (it bundles the
    # fused stage's input, the part list, by the larger batch size of the two stages).
    batch_size = None if plan.format == "parquet" else 32
    return rows.map_batches(fn, batch_size=batch_size, batch_format="numpy", compute=compute,
                            num_cpus=0.5, **how)
