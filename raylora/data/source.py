"""Image-caption shards in any storage → preprocessed training batches, every epoch of a
run from one streaming ``ray.data.Dataset``.

The dataset is lazy and holds the passes over the data of every epoch the run trains
(``build_dataset(epoch=, epochs=)``): one execution streams them, each row tagged with its
pass (``epoch`` column), so an epoch boundary is a row in the stream, not a pipeline start:
the next epoch's rows are read and preprocessed while the current one ends. Shard files
are read in parts (parquet: runs of row groups; other formats: the registry's read units)
whose order is reshuffled every pass (seeded by the pass), and rows come out in pass order
(``preserve_order``). With ``data.sharding=files`` every worker builds one of its own
shard files (``DataPlan.for_rank``), read in order; under ``data.sharding=stream`` one
worker reads them all, and several workers take each pass from a dataset of its own, split
over them with ``streaming_split(equal=True)`` (by an actor rank 0 starts:
raylora.data.passes), so that each gets the same share of every pass;
``pass_blocks`` chains the passes, the next one started while the current one ends.

On a worker, ``pass_batches`` turns the rows into batches, each pass shuffled on its own
through a local buffer, and ``EpochStream`` hands the training loop one epoch at a time
(``LoopHooks.epoch_batches``), prefetching in a background thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import ray

from raylora.config import DataSection
from raylora.data.formats import get_format
from raylora.data.plan import DataPlan, pass_items, plan_data, read_units
from raylora.data.preprocess import Preprocess, StageSpec, preprocess_batch, stage_kwargs
from raylora.data.split import KeepSplit
from raylora.data.tokenize import load_specs
from raylora.storage import Storage


__all__ = ["DataPlan", "EpochStream", "build_dataset", "global_share", "data_stage_cpus", "epoch_seed",
           "pass_batches", "pass_blocks", "plan_data", "read_rows"]

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
    epochs: int = 1,
    revision: str | None = None,
) -> ray.data.Dataset:
    """The training rows of passes ``epoch`` .. ``epoch + epochs - 1`` over the data,
    preprocessed, in pass order, each with its pass in an int32 ``epoch`` column: one
    execution streams them all. ``bad_records``: the name of the run's actor
    (``raylora.desk``) whose tally counts the rows failing the validating decode.
    ``tokenizer_specs``: ``load_specs(model_path, family, storage)`` when the caller
    already has them; else loaded here (a hub model's at ``revision``).

    A pass's read order and draws depend on the seed and the pass alone, not on where the
    dataset started: a dataset built from a resumed run's epoch repeats that epoch. With
    ``data.sharding=files`` exactly (rows in file order; crop/flip/dropout draws of one
    preprocess actor restarted from the pass's seed at the pass's first row); otherwise
    the part order (and the cached rows' order) is, while draws depend on which preprocess
    process gets which rows, as they did with several processes."""
    passes = range(epoch, epoch + epochs)
    if data.cache == "latents":
        # plan.files are the cache's parquet files (see raylora.data.cache).
        from raylora.data.cache import CACHED_READ_CPUS

        # sharding=files: the parts in file order every pass, as the uncached rows (below),
        # so a cached run trains the uncached run's batches (a caption folder's cache has a
        # part per few images: a shuffled part order was another row order).
        ds = _read_passes(data, plan, storage, seed, passes, shuffle=data.sharding != "files",
                          cached=True, num_cpus=CACHED_READ_CPUS)
    else:
        ds = _preprocessed_rows(data, plan, storage, model_path, seed, passes,
                                num_preprocess_tasks, family, bad_records, tokenizer_specs, revision)
    # Pass after pass. A per-dataset copy of the context: other datasets keep Ray's default.
    ds.context.execution_options.preserve_order = True
    return ds


def epoch_seed(seed: int, epoch: int) -> int:
    """The preprocessing draws' seed for ``epoch`` of a ``sharding=files`` run."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _read_passes(data: DataSection, plan: DataPlan, storage: Storage, seed: int,
                 passes: range, shuffle: bool, cached: bool = False,
                 **map_args) -> ray.data.Dataset:
    """Raw rows of every pass, each with its ``epoch``: a latent cache's columns, or
    ``key``, ``image`` (encoded bytes), ``text`` (the source's caption prefix applied) and
    ``source`` (its place in ``data.sources``). One read item per (pass, read unit copy)
    (``raylora.data.plan``): parquet files in parts of about READ_UNIT_ROWS rows, other
    formats in the registry's units, each as often as its rows count; ``shuffle``: a new
    item order every pass, from the seed and the pass. ``map_args``: the read stage's
    ``compute`` and ``num_cpus``."""
    from raylora.data.parquet_parts import READ_UNIT_ROWS

    units = read_units(data, plan, storage, READ_UNIT_ROWS, cached)
    items = [item for e in passes for item in pass_items(units, seed, e, shuffle)]
    sections = data.source_sections()
    kwargs = dict(sections=[sections[s.index].model_dump() for s in plan.sources],
                  files=[s.files for s in plan.sources], formats=[s.format for s in plan.sources],
                  cached=cached, endpoint_url=storage.endpoint_url, region=storage.region)
    # One item per block up to 1024 blocks: the block is what is scheduled.
    ds = ray.data.from_items(items, override_num_blocks=min(len(items), 1024))
    return ds.map_batches(_read_items, batch_size=1, batch_format="numpy", fn_kwargs=kwargs,
                          **map_args)


def _tagged(table, epoch: int):
    import pyarrow as pa

    return table.append_column("epoch", pa.array(np.full(len(table), epoch, np.int32)))


def _read_items(batch: dict[str, np.ndarray], sections: list[dict], files: list[list[str]],
                formats: list[str], cached: bool, endpoint_url: str | None,
                region: str | None):
    """Read stage: (pass, read unit copy) items → the rows they read, tagged with the pass."""
    from raylora.data.formats.base import process_storage

    store = process_storage(endpoint_url, region)
    for i in range(len(batch["epoch"])):
        item = {k: v[i] for k, v in batch.items()}
        k = int(item["k"])
        section = DataSection.model_validate(sections[k])
        tables = _part_tables(item, section, cached, store) if item["kind"] == "parquet" \
            else _unit_tables(item, section, formats[k], files[k], store)
        for table in tables:
            if not cached:
                table = _as_source(table, section, int(item["source"]))
            yield _tagged(table, int(item["epoch"]))


def _as_source(table, section: DataSection, source: int):
    """Rows of source ``source``: its caption prefix put in, its index in a ``source``
    column (the preprocess stage's per-source captions and counts)."""
    import pyarrow as pa

    from raylora.data.captions import with_prefix

    if section.caption_prefix:
        texts = [with_prefix(section.caption_prefix, t) for t in table["text"].to_pylist()]
        table = table.set_column(table.column_names.index("text"), "text",
                                 pa.array(texts, pa.string()))
    return table.append_column("source", pa.array(np.full(len(table), source, np.int32)))


def _part_tables(item: dict, data: DataSection, cached: bool, store: Storage):
    """The rows of a parquet part that the item keeps: a cache's columns as they are, else
    ``key`` (``{uri}#{row}``), ``image`` (bytes, also from a ``{bytes, path}`` struct) and
    ``text`` (and ``mask`` with data.masked_loss, ``control``, ``control_2``, ... with
    data.control_images)."""
    import pyarrow as pa

    from raylora.data.formats.parquet import extra_columns
    from raylora.data.parquet_parts import part_tables
    from raylora.data.plan import keep_rows

    columns = None if cached else [data.image_column, data.caption_column]
    extras = [] if cached else extra_columns(data)
    optional = tuple(column for column, _ in extras)
    for first, table in part_tables(store, str(item["uri"]), int(item["part"]),
                                    int(item["parts"]), columns, optional):
        rows = np.arange(first, first + len(table))
        keep = keep_rows(int(item["offset"]) + rows, item)
        if not keep.all():
            table, rows = table.filter(pa.array(keep)), rows[keep]
        if cached:
            yield table
            continue
        out = {"image": _bytes_column(table[data.image_column]), "text": table[data.caption_column],
               "key": pa.array([f"{item['uri']}#{r}" for r in rows], pa.string())}
        # A shard without the column: every row unmasked, or without a control image.
        for column, name in extras:
            out[name] = _bytes_column(table[column]) if column in table.column_names \
                else pa.nulls(len(table), pa.binary())
        yield pa.table(out)


def _bytes_column(column):
    """An encoded-image column as binary: a datasets ``{bytes, path}`` struct's bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.struct_field(column, "bytes") if pa.types.is_struct(column.type) else column


def _unit_tables(item: dict, data: DataSection, fmt: str, files: list[str], store: Storage,
                 rows_per_table: int = 64):
    """The ``{key, image, text}`` rows (+ ``mask``, ``control``, ``control_2``, ... where
    the config reads them) of a registry unit (``ShardFormat.iter_unit``) that the item
    keeps."""
    import itertools

    import pyarrow as pa

    from raylora.data.formats.base import control_names, image_bytes
    from raylora.data.plan import unit_keep

    rows = get_format(fmt).iter_unit(data, files, store, int(item["index"]),
                                     int(item["start"]), int(item["stop"]), unit_keep(item))
    while chunk := list(itertools.islice(rows, rows_per_table)):
        yield pa.table({
            "key": pa.array([str(r["key"]) for r in chunk], pa.string()),
            "image": pa.array([image_bytes(r["image"]) for r in chunk], pa.binary()),
            "text": pa.array([None if r["text"] is None else str(r["text"]) for r in chunk],
                             pa.string()),
            **({"mask": pa.array([r["mask"] or None for r in chunk], pa.binary())}
               if data.masked_loss else {}),
            **{name: pa.array([image_bytes(r[name]) or None for r in chunk], pa.binary())
               for name in control_names(data)},
        })


def _by_pass(batch: dict[str, np.ndarray], fn: Callable) -> dict[str, np.ndarray]:
    """``fn(rows, pass)`` on the rows of each pass in ``batch``, in order; their ``epoch``
    column is carried over to what ``fn`` returns (which may drop rows)."""
    tags = batch["epoch"]
    rows = {k: v for k, v in batch.items() if k != "epoch"}
    outs = []
    for e in dict.fromkeys(tags.tolist()) or [None]:  # None: an empty batch
        sel = tags == e
        out = fn({k: v[sel] for k, v in rows.items()} if e is not None else rows, e)
        n = len(next(iter(out.values())))
        outs.append({**out, "epoch": np.full(n, -1 if e is None else e, np.int32)})
    return outs[0] if len(outs) == 1 else {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


def _preprocess_passes(batch: dict[str, np.ndarray], **stage) -> dict[str, np.ndarray]:
    """Stream mode's preprocess task: ``preprocess_batch`` per pass, passes kept."""
    return _by_pass(batch, lambda rows, e: preprocess_batch(rows, **stage))


class _PassPreprocess:
    """sharding=files' preprocess actor: one ``Preprocess`` for the whole run whose random
    draws restart from ``epoch_seed(seed, pass)`` at the first row of every pass. It gets
    the rows in order (one task in flight), so each row's crop, flip and caption dropout
    depend on the seed, the pass and the row's place in it alone: a dataset built from a
    resumed epoch repeats the straight run's draws."""

    def __init__(self, **stage):
        self.seed = stage["seed"]
        self.stage = Preprocess(StageSpec(**stage))
        self.current = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _by_pass(batch, self._pass)

    def _pass(self, rows: dict[str, np.ndarray], e: int | None) -> dict[str, np.ndarray]:
        if e is not None and e != self.current:
            self.stage.rng = np.random.default_rng(epoch_seed(self.seed, e))
            self.current = e
        return self.stage(rows)


def _preprocessed_rows(data: DataSection, plan: DataPlan, storage: Storage, model_path: str,
                       seed: int, passes: range, num_preprocess_tasks: int, family: str,
                       bad_records: str | None, tokenizer_specs: tuple | None,
                       revision: str | None = None) -> ray.data.Dataset:
    """Shard rows read, decoded and preprocessed (build_dataset without a cache)."""
    # Read once, on the driver: see raylora.data.tokenize.
    specs = tokenizer_specs or load_specs(model_path, family, storage, revision=revision,
                                          references=data.references())
    stage = stage_kwargs("train", data, model_path=model_path, family=family, storage=storage,
                         tokenizer_specs=specs, seed=seed, bad_records=bad_records,
                         revision=revision)
    if data.sharding == "files":
        # One actor for the run (the dataset spans every epoch, so it starts once), one
        # task in flight: Ray Data lets an actor run its queued tasks out of order, which
        # would hand the draws to the parts in whatever order they ran.
        fn, how = _PassPreprocess, dict(fn_constructor_kwargs=stage)
        compute = ray.data.ActorPoolStrategy(size=num_preprocess_tasks,
                                             max_tasks_in_flight_per_actor=1)
        read_compute = ray.data.TaskPoolStrategy(size=num_preprocess_tasks)
    else:
        # Tasks, so that Ray Data fuses read and preprocessing into one task per read
        # part (no encoded images through the object store); each task process keeps
        # its Preprocess (preprocess_batch). Draws depend on which process gets which
        # batch, which with several preprocess processes they already did.
        fn, how = _preprocess_passes, dict(fn_kwargs=stage)
        compute = read_compute = ray.data.TaskPoolStrategy(size=num_preprocess_tasks)
    # The stages before preprocessing take the same task limit and CPUs, so Ray Data fuses
    # them into one task per read part (parquet): read, split, decode, in one process.
    before = dict(compute=read_compute, num_cpus=STAGE_CPUS)
    # sharding=files: the same file order every pass (the local shuffle buffer, seeded per
    # epoch, still reorders rows), so an epoch's order is a function of the seed and epoch
    # alone and a resumed run can skip exactly the batches it already trained on.
    rows = _read_passes(data, plan, storage, seed, passes, shuffle=data.sharding != "files",
                        **before)
    if data.validation_split:
        # Training never sees a held-out row (see raylora.data.split).
        rows = rows.map_batches(KeepSplit(data.validation_split), batch_format="numpy", **before)
    # Parquet: a whole read part per call (about READ_UNIT_ROWS rows). A batch size here
    # would make Ray Data bundle that many *parts* into one fused task (it bundles the
    # fused stage's input, the part list, by the larger batch size of the two stages).
    batch_size = None if plan.format == "parquet" else 32
    return rows.map_batches(fn, batch_size=batch_size, batch_format="numpy", compute=compute,
                            num_cpus=STAGE_CPUS, **how)


def pass_batches(blocks: Iterable[dict[str, np.ndarray]], batch_size: int, buffer_rows: int,
                 seed: Callable[[int], int],
                 pass_rows: int | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Rows in pass order (blocks with an ``epoch`` column, as ``build_dataset`` makes them)
    → ``(pass, batch of batch_size rows)``. Each pass is shuffled on its own through a
    buffer of ``buffer_rows`` rows seeded by ``seed(pass)`` (0: rows in order): once it
    holds ``buffer_rows + batch_size`` rows a batch is drawn from it at random; at the end
    of the pass (the next pass's first row) the rest is shuffled and the rows that do not
    fill a batch are dropped; a None in ``blocks`` (``pass_blocks``) ends the pass there,
    without waiting for the next pass's first row. ``pass_rows``: the rows a pass is
    expected to bring; a buffer that would hold all of them draws its first batch on the
    last of them. The batches depend on the rows' order alone, not on how they were cut
    into blocks."""
    from raylora.data.captions import stack_rows

    if pass_rows is not None:
        buffer_rows = min(buffer_rows, max(0, pass_rows - batch_size))
    current, rng, buf = None, None, []  # buf: (block, row) of the rows held

    def draw(n: int) -> dict[str, np.ndarray]:
        if buffer_rows:
            picks = rng.choice(len(buf), n, replace=False)
            rows = [buf[j] for j in picks]
            for j in sorted(picks, reverse=True):  # swap-remove, largest index first
                buf[j] = buf[-1]
                buf.pop()
        else:
            rows = buf[:n]
            del buf[:n]
        return {k: stack_rows(k, [b[k][r] for b, r in rows]) for k in rows[0][0] if k != "epoch"}

    def rest():
        if buffer_rows and buf:
            buf[:] = [buf[j] for j in rng.permutation(len(buf))]
        while len(buf) >= batch_size:
            yield current, draw(batch_size)

    for block in blocks:
        if block is None:  # the pass's last row is here: its last batches now
            yield from rest()
            buf = []
            continue
        for i, e in enumerate(block["epoch"].tolist()):
            if e != current:
                yield from rest()
                current, rng, buf = e, np.random.default_rng(seed(e)), []
            buf.append((block, i))
            if len(buf) >= buffer_rows + batch_size:
                yield current, draw(batch_size)
    yield from rest()


def pass_blocks(first: int, blocks_of: Callable[[int], Iterable | None], ahead: int = 4
                ) -> Iterator[dict | None]:
    """The blocks of passes ``first``, ``first + 1``, ... each pass from a dataset of its
    own (``blocks_of(p)``; None: pass ``p`` is not there, and the stream ends before it),
    with a None after each pass's last block (``pass_batches`` draws the pass's last
    batches on it). The next pass is started (``ahead`` of its blocks fetched in a thread)
    as soon as the current one's last block is here, so that its execution starts up
    while the current pass's last batches are drawn and trained, not after them."""
    p, blocks = first, blocks_of(first)
    try:
        while blocks is not None:
            for block in blocks:
                yield block
            following = blocks_of(p + 1)
            blocks = None if following is None else _Prefetched(iter(following), lambda b: b, ahead)
            yield None
            p += 1
    finally:
        if isinstance(blocks, _Prefetched):
            # Not waited for long: a started pass may wait at its split's barrier for
            # workers that stopped before it (the thread ends the iteration when it can).
            blocks.close(timeout=5.0)
        elif hasattr(blocks, "close"):
            blocks.close()


def global_share(items: Iterable[tuple[int, dict]], rank: int, world: int
                 ) -> Iterator[tuple[int, dict]]:
    """An elastic run's worker ``rank`` of ``world``: from the ``(pass, batch)`` stream
    that every worker reads alike (one seeded order of the whole data), micro-batch ``i``
    of a pass is this worker's when ``i % world == rank``. An optimizer step is then the
    next ``accumulation × world`` micro-batches of the pass whatever ``world`` is (the
    accumulation makes the product constant), so a position counted in them resumes at
    the same sample on any number of workers. The micro-batches are dealt in rounds of
    ``world``: a pass's last, incomplete round goes to nobody, so every worker gets the
    same count (their DDP steps line up)."""
    current, held = None, []
    for e, batch in items:
        if e != current:
            current, held = e, []
        held.append(batch)
        if len(held) == world:
            yield e, held[rank]
            held = []


class EpochStream:
    """``epoch -> that epoch's batches`` (what ``LoopHooks.epoch_batches`` wants), every
    epoch from one stream of ``(pass, batch)``: ``open(epoch)`` starts one (passes
    ``epoch``, ``epoch + 1``, ... through ``pass_batches``) and it runs on across epoch
    boundaries; it is opened again only when the loop asks for an epoch out of turn (a
    resumed run's first) or the passes ran out.

    Every epoch is at most ``batches_per_epoch`` batches, the same number on every worker
    so that DDP steps line up. ``per_pass``: an epoch is the batches of one pass (those
    past ``batches_per_epoch`` dropped), so each row is trained at most once an epoch and
    a stream opened at a resumed epoch starts at its pass; else the next
    ``batches_per_epoch`` batches whatever their pass. ``convert`` (e.g. to tensors on
    the accelerator) runs in a background thread that keeps ``prefetch`` batches ready."""

    def __init__(self, open: Callable[[int], Iterator[tuple[int, dict]]], batches_per_epoch: int,
                 per_pass: bool, convert: Callable[[dict], dict] = lambda b: b, prefetch: int = 4):
        self._open, self.batches_per_epoch, self.per_pass = open, batches_per_epoch, per_pass
        self._convert, self._prefetch = convert, prefetch
        self._stream: _Prefetched | None = None
        self._next_epoch: int | None = None  # the epoch the open stream goes on with
        self._held = None  # per_pass: the first batch of the next pass, already taken
        self._owed = 0  # not per_pass: batches of the epoch being trained not taken yet
        self.opened = 0  # streams opened: 1 for a run that never restarted its data

    def start(self, epoch: int) -> None:
        """Open the stream for ``epoch`` now (its first batches are fetched from here on),
        before the loop asks for it."""
        self._restart(epoch)
        self._next_epoch = epoch

    def __call__(self, epoch: int) -> Iterator[dict]:
        if self._stream is None or epoch != self._next_epoch:
            self._restart(epoch)
        self._next_epoch = epoch + 1
        return self._epoch(epoch)

    def _restart(self, epoch: int) -> None:
        self.close()
        convert = self._convert
        self._stream = _Prefetched(self._open(epoch), lambda item: (item[0], convert(item[1])),
                                   self._prefetch)
        self._held, self._owed, self.opened = None, 0, self.opened + 1

    def _epoch(self, epoch: int) -> Iterator[dict]:
        n = 0
        for n, batch in enumerate(self._batches(epoch), 1):
            yield batch
        if n == 0 and self._next_epoch is None:  # the passes ran out before this epoch
            self._restart(epoch)
            self._next_epoch = epoch + 1
            yield from self._batches(epoch)

    def _take(self):
        """The stream's next ``(pass, batch)``; None at its end (the next epoch reopens)."""
        item = next(self._stream, None)
        if item is None:
            self._next_epoch = None
        return item

    def _batches(self, epoch: int) -> Iterator[dict]:
        if self.per_pass:
            n = 0
            while n < self.batches_per_epoch:
                item, self._held = self._held or self._take(), None
                if item is None or item[0] > epoch:
                    self._held = item
                    return
                if item[0] == epoch:  # earlier passes: the rest past a previous epoch's cap
                    n += 1
                    yield item[1]
            return
        # An epoch the loop left early does not spill into this one.
        while self._owed and self._take() is not None:
            self._owed -= 1
        self._owed = self.batches_per_epoch
        while self._owed:
            item = self._take()
            if item is None:
                return
            self._owed -= 1
            yield item[1]

    def close(self) -> None:
        """Stop the stream (and the dataset execution behind it)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class _Prefetched:
    """``convert(item)`` for each item of ``source``, computed ``depth`` items ahead in a
    daemon thread (which also closes ``source``); errors are raised where the item would
    have been."""

    _END = object()

    def __init__(self, source: Iterator, convert: Callable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(source, convert), daemon=True,
                                        name="raylora-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterator, convert: Callable) -> None:
        try:
            for item in source:
                if not self._put(convert(item)):
                    break
        except BaseException as exc:  # handed to the consumer
            self._put(exc)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()  # ends the Ray Data iteration (and its execution) in this thread
            self._put(self._END)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread, which closes ``source`` (waiting at most ``timeout`` s for it to
        hand over the item it is computing)."""
        import time

        self._stop.set()
        self._done = True
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a put
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
