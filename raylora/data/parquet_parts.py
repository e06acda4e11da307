"""raylora's parquet reader for Ray Data: files cut into parts of row groups.

Used for parquet shards (``raylora.data.formats.parquet``) and for the latent cache's
files (``raylora.data.cache``); its own module so that neither imports the other.

Parquet is read by raylora's own row-group tasks, not ``ray.data.read_parquet``. Ray Data
2.60's reader re-lists the files every epoch through a new FooterReader actor (a fresh
Python process per epoch, ~1.4 s of a 10 s epoch on 2 cores, bench/ingest.py), and packs
row groups into read tasks of up to 128 MiB: ~670 photo rows that one task decodes for
6-7 s before its first row reaches training, with the last task running alone. The driver
already read every footer (plan_data), so it cuts each file into parts of about
READ_UNIT_ROWS rows; a part is a task that reads its row groups and, fused with the
preprocessing stage, decodes them (no JPEG bytes through the object store).
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import ray

from raylora.data.formats.base import process_storage
from raylora.storage import Storage

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

    storage = process_storage(endpoint_url, region)
    for uri, part, parts in zip(batch["uri"], batch["part"], batch["parts"]):
        for row, table in part_tables(storage, str(uri), int(part), int(parts), columns):
            table = table.rename_columns([renames.get(c, c) for c in table.column_names])
            if with_path:
                table = table.append_column("path", pa.array([str(uri)] * len(table), pa.string()))
            if with_key:
                keys = [f"{uri}#{r}" for r in range(row, row + len(table))]
                table = table.append_column("key", pa.array(keys, pa.string()))
            yield table


def part_tables(storage: Storage, uri: str, part: int, parts: int, columns: list[str] | None,
                optional: tuple[str, ...] = ()):
    """Part ``part`` of ``parts`` of a parquet file as ``(first row in the file, table of
    at most 64 rows)``. ``optional``: more columns, read where the file has them."""
    import pyarrow as pa

    with storage.open_input(uri) as fh:
        pf = pq.ParquetFile(fh)
        if optional:
            columns = list(columns or []) + [c for c in optional if c in pf.schema_arrow.names]
        meta = pf.metadata
        group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        groups = row_groups_of_part(group_rows, part, parts)
        if not groups:
            return
        row = sum(group_rows[: groups[0]])  # a part's groups are contiguous
        for rb in pf.iter_batches(batch_size=64, row_groups=groups, columns=columns):
            yield row, pa.Table.from_batches([rb])
            row += rb.num_rows


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
