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
import ray

from raylora.config import DataSection
from raylora.data.formats import detect_format, get_format
from raylora.data.preprocess import Preprocess, preprocess_batch
from raylora.data.split import KeepSplit
from raylora.data.tokenize import load_specs
from raylora.storage import Storage


# CPUs one read/preprocess task asks for. Training workers hold theirs for the whole run,
# so the cluster must keep some beside them for these tasks (``data_stage_cpus``).
STAGE_CPUS = 0.5


def data_stage_cpus(data: DataSection, num_workers: int) -> tuple[float, float]:
    """(least, enough) CPUs that Ray Data's tasks need beside ``num_workers`` training
    workers. With less than ``least`` no row ever reaches training (the tasks wait for
    CPUs the workers hold: a hang); ``enough`` runs the preprocess tasks that
    ``launch.build_trainer`` allows at once (one per worker)."""
    from raylora.data.cache import CACHED_READ_CPUS

    if data.cache == "latents":  # one read stage, no preprocessing
        per_task = CACHED_READ_CPUS
        least = per_task * (num_workers if data.sharding == "files" else 1)
        return least, per_task * num_workers
    if data.sharding == "files":
        # Every worker runs its own dataset: a preprocess actor, and read tasks beside it.
        return 2 * STAGE_CPUS * num_workers, 2 * STAGE_CPUS * num_workers
    # One fused read+preprocess task at a time still streams rows.
    return STAGE_CPUS, STAGE_CPUS * num_workers


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
    and ``num_cpus`` (see ``raylora.data.parquet_parts.read_parquet_parts``)."""
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
    before = dict(compute=read_compute, num_cpus=STAGE_CPUS)
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
                            num_cpus=STAGE_CPUS, **how)
