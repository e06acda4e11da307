"""Parquet: an image column of encoded bytes (or a Hugging Face datasets struct
``{bytes, path}``) and a caption column, named by ``data.image_column`` and
``data.caption_column``. A row's key is ``{file}#{row in file}``."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from raylora.data.formats.base import (
    ShardFormat, concurrently, control_names, image_bytes, img2dataset_metadata, item_controls,
    spread, with_mask,
)
from raylora.storage import Storage

if TYPE_CHECKING:
    from raylora.config import DataSection

SCHEMA = pa.schema([("key", pa.string()), ("image", pa.binary()), ("text", pa.string())])


def check_columns(data: DataSection, file: str, schema: pa.Schema) -> None:
    """Fail early, naming the file, when the configured columns are not in a shard, or
    its image column cannot hold encoded images (a column of file paths or URLs, say:
    otherwise every row is dropped as a bad record once the run has started)."""
    names = schema.names
    missing = [
        f"data.{key}={col!r}"
        for key, col in (("image_column", data.image_column), ("caption_column", data.caption_column))
        if col not in names
    ]
    if missing:
        raise ValueError(f"{file}: column(s) not found: {', '.join(missing)}; the shard has "
                         f"{names}{_column_hint(data, schema)}")
    if _listed(schema.field(data.caption_column).type) and \
            (problem := several_captions_problem(data)):
        raise ValueError(f"{file}: {problem}")
    # The image column, and the mask and control columns the shard has (an edit dataset
    # often keeps its input images as paths: they failed inside the plan's sample read).
    keys = {data.mask_column: "mask_column"} | {c: "control_column" for c in data.control_columns()}
    for col, key in [(data.image_column, "image_column")] + [
            (c, keys[c]) for c, _ in extra_columns(data) if c in names]:
        kind = schema.field(col).type
        if _binary(kind) or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
                             and _binary(kind.field("bytes").type)):
            continue
        what = "strings (file paths or URLs?)" if pa.types.is_string(kind) or pa.types.is_large_string(kind) else str(kind)
        raise ValueError(
            f"{file}: data.{key}={col!r} holds {what}, not encoded images: "
            "a shard carries each image's bytes (binary, or the Hugging Face datasets Image "
            "struct {bytes, path}). Images kept as files beside a caption each read as a "
            "folder (data.format captionfolder or imagefolder), or `raylora shards build` "
            "turns that folder into shards")


def several_captions_problem(data: DataSection) -> str | None:
    """Why a caption column of several captions per image (``list<string>``: a preprocess
    stage draws one per read, ``raylora.data.captions.pick_caption``) cannot train with
    ``data``, or None. data.cache=latents encodes one caption per row for good.
    data.validation_split hashes each row's caption, which Ray Data's read stage hands
    over as a numpy array (``raylora.data.source``) and the driver's readers (held-out
    rows, bucket counts) as their joined string: a row held out on the driver could
    train, and a bucket's count be off."""
    col = f"data.caption_column={data.caption_column!r} holds several captions per image"
    if data.cache == "latents":
        return (f"{col}; data.cache: latents encodes one caption per image for good: train "
                "uncached (data.cache: none, a caption drawn per read), or keep one caption "
                "per image")
    if data.validation_split:
        return (f"{col}; data.validation_split cannot hold such rows out consistently: give "
                "the held-out rows as their own files (data.validation_uri)")
    return None


def _listed(kind: pa.DataType) -> bool:
    """A list column type (several values a row)."""
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
        pa.types.is_fixed_size_list(kind) or pa.types.is_list_view(kind) or \
        pa.types.is_large_list_view(kind)


def _stringy(kind: pa.DataType) -> bool:
    """Captions: strings, or a list of strings (several captions per image)."""
    if _listed(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


# Caption columns other tools write: img2dataset's parquet output has ``txt`` (and the
# input's ``caption``), LAION's metadata ``caption``/``TEXT``, many datasets ``prompt``.
CAPTION_NAMES = ("text", "txt", "caption", "TEXT", "prompt")


def _column_hint(data: DataSection, schema: pa.Schema) -> str:
    """Which of a shard's columns could be the missing ones: its binary (or datasets
    Image struct) columns for the image, a caption-like string column for the caption
    (img2dataset's parquet output: data.image_column=jpg data.caption_column=txt)."""
    def kind(n: str) -> pa.DataType:
        return schema.field(n).type

    names = schema.names
    picks = []
    if data.image_column not in names:
        picks += [f"data.image_column={n}" for n in names if _binary(kind(n)) or (
            pa.types.is_struct(kind(n)) and kind(n).get_field_index("bytes") >= 0)][:1]
    if data.caption_column not in names:
        picks += [f"data.caption_column={n}" for n in CAPTION_NAMES
                  if n in names and _stringy(kind(n))][:1]
    return f" (try {' '.join(picks)})" if picks else ""


def _binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def extra_columns(data: DataSection) -> list[tuple[str, str]]:
    """(column, row key) of the images a row carries besides its own that the config
    reads: the mask column (data.masked_loss, ``mask``), each input's control column
    (data.control_images: ``control`` from data.control_columns()[0], ``control_2`` from
    the second, ...)."""
    masks = [(data.mask_column, "mask")] if data.masked_loss else []
    return masks + list(zip(data.control_columns(), control_names(data)))


def read_columns(data: DataSection, names: list[str]) -> list[str]:
    """The columns to read from a shard with columns ``names``: image and caption, and the
    ``extra_columns`` the shard has (a shard without the mask column trains unmasked,
    one without the control column gives every row a missing_control)."""
    return [data.image_column, data.caption_column] + [
        column for column, _ in extra_columns(data) if column in names]


# Bytes of first row groups that ``Parquet.sample_rows`` reads at most, in all.
SAMPLE_BYTES = 128 << 20


def _file_rows(data: DataSection, f: str, pf: pq.ParquetFile, batch_size: int) -> Iterator[dict]:
    cols = read_columns(data, pf.schema_arrow.names)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
        yield from _table_rows(data, f, batch, range(row, row + batch.num_rows))
        row += batch.num_rows


def _table_rows(data: DataSection, f: str, table, places) -> Iterator[dict]:
    """Rows ``{key, image, text}`` (+ ``mask``, ``control``, ...) of a batch or table read
    from ``f``, whose rows are at ``places`` in the file. A column the shard lacks gives
    every row None (unmasked; a missing_control for its input)."""
    # Here, not at the top: raylora.data.captions imports this registry.
    from raylora.data.captions import joined_captions

    d = table.to_pydict()
    nothing = [None] * table.num_rows
    masks = d.get(data.mask_column, nothing)
    names = control_names(data)
    controls = [d.get(c, nothing) for c in data.control_columns()[:len(names)]]
    for j, (row, img, txt, mask) in enumerate(zip(places, d[data.image_column],
                                                  d[data.caption_column], masks)):
        # several captions (list<string>) joined, as an image folder's rows hold them
        out = {"key": f"{f}#{row}", "image": image_bytes(img), "text": joined_captions(txt)}
        yield with_mask(data, out, image_bytes(mask) or None,
                        [image_bytes(c[j]) or None for c in controls])


class Parquet(ShardFormat):
    name = "parquet"
    suffixes = (".parquet", ".pq")
    label = ".parquet"
    writable = True  # manifest.json's schema: ``described`` (the build's columns)

    def detects(self, files):
        # Not img2dataset's metadata beside its tars or folders: those are the data (a
        # folder of its webdataset output was taken for parquet, then refused for having
        # no image column). data.format: parquet still reads them.
        metadata = img2dataset_metadata(files)
        return any(f not in metadata for f in self.select(files))

    def count_rows(self, data, files, storage):
        def rows(i: int) -> int:
            with storage.open_input(files[i]) as fh:
                pf = pq.ParquetFile(fh)
                # Every shard's footer (open anyway): shards written at other times may name
                # their columns otherwise, and a reader failed on the first row of such a
                # shard with a bare KeyError. The first error in file order is the one raised.
                check_columns(data, files[i], pf.schema_arrow)
                return pf.metadata.num_rows

        file_rows = concurrently(rows, range(len(files)))
        return sum(file_rows), file_rows

    def iter_rows(self, data: DataSection, files: list[str], storage: Storage) -> Iterator[dict]:
        for f in files:
            with storage.open_input(f) as fh:
                yield from _file_rows(data, f, pq.ParquetFile(fh), 64)

    def sample_rows(self, data, files, storage, k):
        # pyarrow reads a whole row group's column chunks for its first row (measured: 100
        # MiB read for 4 rows of one 100-row group of 1 MiB images, however the file was
        # opened). So the rows come from files whose first group fits what is left of a
        # budget, spread over that group: a run of bad rows at a file's start is not all
        # it sees, at no extra read.
        budget, chosen = SAMPLE_BYTES, []
        with contextlib.ExitStack() as stack:
            # Each file opened once: the chosen ones stay open until their groups are read.
            for i in spread(len(files), k):
                pf = pq.ParquetFile(stack.enter_context(storage.open_input(files[i])))
                cols = read_columns(data, pf.schema_arrow.names)
                if not pf.metadata.num_row_groups:
                    continue
                group = pf.metadata.row_group(0)
                cost = sum(group.column(j).total_compressed_size for j in range(group.num_columns)
                           if group.column(j).path_in_schema.split(".")[0] in cols)
                if cost <= budget:
                    budget -= cost
                    chosen.append((files[i], pf, cols))
            per = -(-k // max(1, len(chosen)))
            for f, pf, cols in chosen:
                table = pf.read_row_group(0, columns=cols)
                rows = spread(table.num_rows, per)
                yield from _table_rows(data, f, table.take(rows), rows)

    def read_dataset(self, data, files, file_rows, storage, seed, shuffle, **map_args):
        # Imported here: the registry is imported where Ray is not (raylora.data.decode).
        from raylora.data.parquet_parts import read_parquet_parts

        return read_parquet_parts(
            files, file_rows, storage, seed, shuffle,
            columns=[data.image_column, data.caption_column],
            renames={data.image_column: "image", data.caption_column: "text"},
            with_path=False, with_key=True, **map_args,
        )

    def write_shard(self, storage, index, items, schema: pa.Schema | None = None):
        """``schema``: ``shard_schema`` of all the build's items, so that its shards agree
        (absent sidecars null); without it, this shard's own."""
        schema = shard_schema(items) if schema is None else schema
        columns = {"key": [it["key"] for it in items],
                   "image": [storage.read_bytes(it["uri"]) for it in items],
                   "text": shard_captions([it["text"] for it in items],
                                          _listed(schema.field("text").type))}
        sidecars = [_sidecars(it) for it in items]
        for column in schema.names[len(SCHEMA):]:  # mask, control_image, control_image_2, ...
            columns[column] = [storage.read_bytes(s[column]) if s.get(column) else None
                               for s in sidecars]
        buf = io.BytesIO()
        pq.write_table(pa.table(columns, schema=schema), buf)
        return f"shard-{index:05d}.parquet", buf.getvalue()


def shard_schema(items: list[dict]) -> pa.Schema:
    """The columns of the shards of ``items`` (one build's, all of them): ``text`` a
    ``list<string>`` where any item has several captions, and the sidecar columns any item
    has a file for, as data.mask_column and data.control_column name them by default
    (``mask``, ``control_image``, ``control_image_2``, ...; null where an item has none).
    Decided shard by shard, the shards of one build differed (a string ``text`` beside a
    list one, a mask column in some only): pyarrow and datasets refuse to read such a
    folder as one table, or drop the columns its first shard lacks."""
    schema = SCHEMA
    if any(isinstance(it["text"], list) for it in items):
        schema = schema.set(2, pa.field("text", pa.list_(pa.string())))
    present = {c for it in items for c, uri in _sidecars(it).items() if uri}
    for column in _sidecar_columns():
        if column in present:
            schema = schema.append(pa.field(column, pa.binary()))
    return schema


def described(schema: pa.Schema) -> dict[str, str]:
    """``manifest.json``'s ``schema`` for shards written with ``schema``: each column, its
    type and what it holds."""
    what = {"key": "string", "image": "binary (encoded image)",
            "text": "list<string> (the image's captions; a read trains one)"
            if _listed(schema.field("text").type) else "string",
            "mask": "binary (loss mask; null where none)"}
    for k, column in enumerate(_sidecar_columns()[1:], start=1):
        what[column] = ("binary (control image; null where none)" if k == 1 else
                        f"binary (input {k}'s control image; null where none)")
    return {name: what[name] for name in schema.names}


def _sidecar_columns() -> list[str]:
    """The sidecar columns a shard may have, in their order: the loss mask, then each
    input's control image."""
    from raylora.config import MAX_CONTROL_INPUTS, control_key

    return ["mask"] + [control_key("control_image", i) for i in range(MAX_CONTROL_INPUTS)]


def _sidecars(item: dict) -> dict[str, str | None]:
    """A shard item's sidecar files by the column that holds them."""
    from raylora.config import control_key

    return {"mask": item.get("mask_uri"),
            **{control_key("control_image", i): uri for i, uri in item_controls(item)}}


def shard_captions(texts: list, listed: bool | None = None) -> list:
    """A shard's ``text`` column: the captions as they are, or, where the column is
    ``listed`` (default: where any item has several, a list: ``raylora shards build`` of a
    metadata.jsonl with ``"text": [...]``), every one as a list (``list<string>``; ``[]``
    for none), which training draws from per read."""
    if listed is None:
        listed = any(isinstance(t, list) for t in texts)
    if not listed:
        return texts
    return [t if isinstance(t, list) else [t] if t else [] for t in texts]
