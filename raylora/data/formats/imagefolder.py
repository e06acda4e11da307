"""Image folder (Hugging Face imagefolder): images plus ``metadata.jsonl`` lines
``{"file_name": ..., "text": ...}`` (or a ``metadata.csv`` with those columns) in the same
folder or a parent. A row's key is the image's URI."""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import posixpath

import numpy as np

from raylora.data.formats.base import (
    IMAGE_EXTS, ShardFormat, process_storage, spread, with_sidecars,
)

log = logging.getLogger("raylora.data")

METADATA = "metadata.jsonl"
# The metadata files Hugging Face's imagefolder reads besides JSON lines (its parquet
# metadata would be taken for a parquet shard: not read).
METADATA_FILES = (METADATA, "metadata.csv")


def is_metadata(uri: str) -> bool:
    return posixpath.basename(uri) in METADATA_FILES


def _records(meta: str, text: str):
    """The records of a metadata file: JSON lines, or CSV rows under a header."""
    if meta.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text))
        if "file_name" not in (reader.fieldnames or []):
            raise ValueError(f"{meta}: no file_name column (its header: {reader.fieldnames})")
        yield from reader
        return
    # JSON lines end at "\n" only: splitlines() also split a caption at U+2028, which
    # json.dumps(ensure_ascii=False) leaves unescaped (pyarrow's reader, HF's, keeps it)
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["file_name"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{meta}:{i + 1}: not a JSON line with a file_name") from None
        yield rec


def metadata_text(storage, meta: str) -> str:
    """A metadata file's text: UTF-8 (a leading byte-order mark dropped), else a ValueError
    naming the file (Excel saves CSV in the Windows code page: a bare UnicodeDecodeError
    named neither the file nor the fix)."""
    try:
        return storage.read_bytes(meta).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{meta}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "save it as UTF-8") from None


def _caption(value):
    """A metadata line's caption: several (a JSON list, as Hugging Face's imagefolder
    takes them) joined into one string (``raylora.data.captions.joined_captions``: the
    preprocess stage draws one per read); any other value as its text, "" for none."""
    from raylora.data.captions import caption_list, joined_captions

    return joined_captions(value) if caption_list(value) is not None else str(value or "")


def imagefolder_rows(storage, files: list[str], caption_key: str,
                     missing: list[tuple[str, str]] | None = None,
                     key_name: str | None = "data.caption_column",
                     several: list[tuple[str, str]] | None = None) -> list[dict]:
    """(image URI, caption) rows of an imagefolder, from its metadata.jsonl (or .csv)
    file(s).

    ``file_name`` is relative to the folder holding the metadata file. Images without a
    metadata line are not training data (no caption) and are left out; so are lines whose
    image is not among ``files`` (an image deleted, its line kept), as Hugging Face's
    imagefolder leaves them out: ``(metadata file, file_name)`` of each is appended to
    ``missing`` (``ImageFolder.count_rows`` judges them before Ray starts).
    ``key_name``: how a ``caption_key`` that no line of a metadata file has is named in
    the error; None: captions are optional (class images take their prompt).
    A line's list of captions is one joined string (``_caption``); ``(metadata file,
    file_name)`` of each line with two or more is appended to ``several``.
    """
    from raylora.data.captions import caption_list

    metas = [f for f in files if is_metadata(f)]
    if not metas:
        raise FileNotFoundError(
            f"{posixpath.dirname(files[0])}: imagefolder without {METADATA} "
            "(lines of {\"file_name\": ..., \"text\": ...}) or metadata.csv; for a .txt "
            "caption beside each image use data.format: captionfolder"
        )
    folders = [posixpath.dirname(m) for m in metas]
    both = sorted({d for d in folders if folders.count(d) > 1})
    if both:  # as Hugging Face's imagefolder refuses them: every image would be read twice
        raise ValueError(f"{both[0]}: both metadata.jsonl and metadata.csv; keep one")
    listed = set(files)
    rows = []
    for meta in metas:
        base = posixpath.dirname(meta)
        keys: set[str] = set()
        for rec in _records(meta, metadata_text(storage, meta)):
            keys.update(rec)
            # a Windows-made file's "train\\a.png", as Hugging Face reads it
            name = str(rec["file_name"]).replace("\\", "/")
            uri = posixpath.join(base, posixpath.normpath(name))
            if uri not in listed:
                if missing is not None:
                    missing.append((meta, name))
                continue
            text = _caption(rec.get(caption_key))
            if several is not None and caption_list(text) is not None:
                several.append((meta, name))
            rows.append({"key": uri, "uri": uri, "text": text})
        if keys and caption_key not in keys and key_name is not None:
            # every row would train on the empty caption (with caption dropout on, no
            # warning either): a column name the metadata does not use
            from raylora.config import ConfigError

            raise ConfigError([f"{key_name}: {caption_key!r} is in no line of {meta} "
                               f"(its keys: {', '.join(sorted(keys))})"])
    return rows


# Parsed metadata kept per process, newest last: a worker reads an epoch's units one
# after another, and each of them (256 rows) read and parsed the whole file again.
_PARSED: dict[tuple, tuple[list[dict], list, list]] = {}
PARSED_KEPT = 4


def _data_rows(data, storage, files: list[str], missing: list | None = None,
               several: list | None = None) -> list[dict]:
    """``imagefolder_rows`` with ``data``'s caption column; a column no line has is an
    error naming data.caption_column, except for class images (their prompt stands in).
    Parsed once per process for the same listing, caption column and metadata files (by
    size and modification time: a file written again is read again)."""
    versions = []
    for meta in (f for f in files if is_metadata(f)):
        info = storage.info(meta)
        versions.append((info.size, info.mtime_ns))
    key = (storage.endpoint_url, storage.region, tuple(files), data.caption_column,
           data.captions_optional, tuple(versions))
    if key in _PARSED:
        _PARSED[key] = _PARSED.pop(key)  # newest last
    else:
        bad: list = []
        many: list = []
        rows = imagefolder_rows(storage, files, data.caption_column, bad,
                                None if data.captions_optional else "data.caption_column", many)
        while len(_PARSED) >= PARSED_KEPT:
            _PARSED.pop(next(iter(_PARSED)))  # the least recently used
        _PARSED[key] = (rows, bad, many)
    rows, bad, many = _PARSED[key]
    if missing is not None:
        missing.extend(bad)
    if several is not None:
        several.extend(many)
    return rows


def cached_captions_problem(data, several: list[tuple[str, str]]) -> str | None:
    """Why the lines with several captions (``(metadata file, file_name)``) cannot train
    with ``data``: data.cache=latents encodes each row's caption once, for good (one
    drawn when the cache was built, the others never trained), so it is refused; None
    when there are none or the run is uncached (a caption is drawn per read)."""
    if not several or data.cache != "latents":
        return None
    meta, name = several[0]
    return (f"data.caption_column={data.caption_column!r}: {len(several)} line(s) of {meta}"
            f"{' and the other metadata files' if len({m for m, _ in several}) > 1 else ''} "
            f"hold several captions (e.g. {name!r}); data.cache: latents encodes one caption "
            "per image for good: train uncached (data.cache: none, a caption drawn per read), "
            "or keep one caption per image")


def _row(data, storage, row: dict) -> dict:
    """A metadata row → ``{key, image, text}`` (+ its sidecar ``mask`` and ``control``),
    image bytes read."""
    out = {"key": row["key"], "image": storage.read_bytes(row["uri"]), "text": row["text"]}
    return with_sidecars(data, out, storage, row["uri"])


def _read_images(batch: dict[str, np.ndarray], endpoint_url: str | None,
                 region: str | None) -> dict[str, np.ndarray]:
    """map_batches stage: image URI → image bytes. A task, not an actor pool, for the
    reason given at ``raylora.data.preprocess.preprocess_batch``."""
    storage = process_storage(endpoint_url, region)
    images = [storage.read_bytes(u) for u in batch["uri"]]
    return {"key": batch["key"], "image": np.array(images, dtype=object), "text": batch["text"]}


class ImageFolder(ShardFormat):
    name = "imagefolder"
    suffixes = IMAGE_EXTS
    label = "images with metadata.jsonl/.csv"

    def select(self, files):
        # The images, and the metadata files by their names (notes.csv is not one).
        images = set(super().select(files))
        return [f for f in files if f in images or is_metadata(f)]

    def detects(self, files):
        # Images without a metadata file are a caption folder (next in the registry).
        return any(is_metadata(f) for f in files)

    def count_rows(self, data, files, storage):
        """Metadata lines whose image is not in the folder: refused when they are more than
        data.max_bad_fraction of the lines, else left out with a warning naming them (the
        workers would have failed on the first such read, Ray and the model already up).
        Lines of several captions with data.cache=latents: refused
        (``cached_captions_problem``)."""
        missing: list[tuple[str, str]] = []
        several: list[tuple[str, str]] = []
        n = len(_data_rows(data, storage, files, missing, several))
        if problem := cached_captions_problem(data, several):
            raise ValueError(problem)
        if missing:
            share = len(missing) / (n + len(missing))
            what = (f"{len(missing)} of {n + len(missing)} lines of {missing[0][0]}"
                    f"{' and the other metadata files' if len({m for m, _ in missing}) > 1 else ''}"
                    f" name an image that is not in the folder (e.g. "
                    f"{', '.join(repr(f) for _, f in missing[:3])})")
            if share > data.max_bad_fraction:
                raise ValueError(f"{what}; {share:.1%} of the rows, over data.max_bad_fraction="
                                 f"{data.max_bad_fraction:g}. Restore the images or remove "
                                 "their lines")
            log.warning("%s: those lines are left out", what)
        return n, None

    def iter_rows(self, data, files, storage):
        for row in _data_rows(data, storage, files):
            yield _row(data, storage, row)

    def sample_rows(self, data, files, storage, k):
        # Images spread over the one metadata list (read once), not the first k of it.
        rows = _data_rows(data, storage, files)
        for i in spread(len(rows), k):
            yield _row(data, storage, rows[i])

    def units(self, data, files, storage, rows_per_unit, repeats=None):
        # One metadata list for the folder, not rows per file: slices of that list.
        n = len(_data_rows(data, storage, files))
        return [(0, s, s + rows_per_unit) for s in range(0, n, rows_per_unit)]

    def iter_unit(self, data, files, storage, index, start, stop, keep=None):
        rows = _data_rows(data, storage, files)
        for j, row in enumerate(itertools.islice(rows, start, None if stop < 0 else stop)):
            if keep is None or keep(j):  # an image left out is not read
                yield _row(data, storage, row)

    def read_dataset(self, data, files, file_rows, storage, seed, shuffle, **map_args):
        import ray

        rows = _data_rows(data, storage, files)
        if shuffle:
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
