"""WebDataset: tar files as img2dataset writes them, ``KEY.jpg|jpeg|png|webp`` +
``KEY.txt`` (+ ``KEY.json``, + ``KEY.mask.png`` for data.masked_loss, + ``KEY.control.<ext>``,
``KEY.control_2.<ext>``, ... for data.control_images). Only image bytes, UTF-8 text and JSON are read: nothing in
a shard is ever unpickled or executed. A row's key is ``{file}#{KEY}``."""

from __future__ import annotations

import io
import json
import logging
import posixpath
import tarfile
from collections import Counter
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from raylora.data.formats.base import (
    IMAGE_EXTS, MASK_SUFFIX, TAR_SUFFIXES, ShardFormat, concurrently, control_index, control_infix,
    control_names, decode_text, item_controls, read_manifest, tar_stem,
)
from raylora.storage import Storage

log = logging.getLogger("raylora.data")


def split_key(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    dirname, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(dirname, stem), "." + ext.lower() if ext else ""


def iter_tar_samples(fileobj, source: str, masks: bool = False,
                     controls: Sequence[str] = ()) -> Iterator[dict]:
    """Rows from one WebDataset tar, in file order. Samples without an image are skipped.
    ``masks``: rows get a ``mask`` (the ``KEY.mask.png`` bytes, or None); ``controls``: the
    row keys of the control images (``control_names``), each the bytes of its input's
    member (``KEY.control.<image ext>``, ``KEY.control_2.<image ext>``, ...) or None."""
    current: dict | None = None
    closed: set[str] = set()
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = split_key(member.name)
            if current is None or current["key"] != key:
                if current is not None:
                    closed.add(current["key"])
                    if current.get("image") is not None:
                        yield _finish(current, source, masks, controls)
                _check_adjacent(closed, key, member.name, source)
                current = {"key": key, "image": None, "text": None, "json": None, "mask": None,
                           "controls": {}}
            data = tar.extractfile(member).read()
            # split_key keeps every dot: a sidecar is never taken for the image
            if ext == MASK_SUFFIX:
                current["mask"] = data
            elif (i := control_index(ext)) is not None:
                current["controls"][i] = data
            elif ext in IMAGE_EXTS and current["image"] is None:
                current["image"] = data
            elif ext == ".txt":
                # Stripped as a caption folder's .txt is: `echo "a cat" > KEY.txt` ends it in
                # a newline, a token of its own to the Qwen and Gemma text encoders.
                current["text"] = decode_text(data).strip()
            elif ext == ".json":
                try:
                    current["json"] = json.loads(data)
                except ValueError:
                    current["json"] = None
            # Anything else (.pyd, .pickle, .cls, ...) is ignored on purpose.
        if current is not None and current.get("image") is not None:
            yield _finish(current, source, masks, controls)


def _check_adjacent(closed: set[str], key: str, name: str, source: str) -> None:
    """Refuse a member whose sample ended before it: a tar read as a stream groups a sample's
    members only while they follow each other, as webdataset reads them (``tar cf x.tar
    *.jpg *.txt`` trained every image on the empty caption, with caption dropout on
    without a word)."""
    if key in closed:
        raise ValueError(
            f"{source}: {name} is apart from the other files of sample {key!r}: the files of "
            "a sample (KEY.jpg, KEY.txt, ...) must be adjacent in a WebDataset tar, as "
            "webdataset reads them. Write it again with them together (`tar --sort=name -cf x.tar -C FOLDER .`), or "
            "build shards from the folder with `raylora shards build`")


def _finish(sample: dict, source: str, masks: bool = False, controls: Sequence[str] = ()) -> dict:
    from raylora.data.captions import joined_captions

    text = sample["text"]
    if text is None and isinstance(sample["json"], dict):
        # Several captions ("caption": [...]) travel joined, as a parquet list column's and
        # a metadata.jsonl list's do, and the preprocess stage draws one per read. As a
        # list, Ray Data's read stage (str()) trained its Python text, and the latent
        # cache kept the one drawn at its build (now refused: several_captions_problem).
        text = joined_captions(sample["json"].get("caption") or sample["json"].get("text"))
    row = {"key": f"{source}#{sample['key']}", "image": sample["image"], "text": text or ""}
    if masks:
        row["mask"] = sample["mask"]
    for i, name in enumerate(controls):
        row[name] = sample["controls"].get(i)
    return row


# Bytes per read of a tar on the driver (row counts, held-out rows, samples). tarfile reads
# a stream 10 KiB at a time, and each read of an object-store file is its own ranged GET:
# planning 16 tars of 3 MiB in moto took 6224 GETs and 21.7 s before.
TAR_BUFFER = 8 << 20


def _tar_stream(storage: Storage, uri: str):
    return pa.input_stream(storage.open_input(uri), buffer_size=TAR_BUFFER)


def several_captions_problem(data, row: dict) -> str | None:
    """Why ``row`` (read with ``data``) cannot train: several captions (``KEY.json``'s
    ``"caption": [...]``) with data.cache=latents, which encodes one caption per image for
    good (one drawn at the build, the others never trained); as a parquet list column and a
    metadata.jsonl list are refused. None otherwise."""
    from raylora.data.captions import caption_list

    if data.cache != "latents" or caption_list(row["text"]) is None:
        return None
    return (f"{row['key']}: several captions (a list in its .json); data.cache: latents "
            "encodes one caption per image for good: train uncached (data.cache: none, a "
            "caption drawn per read), or keep one caption per image")


# img2dataset writes ``00000_stats.json`` beside ``00000.tar`` once the tar is closed; its
# ``successes`` are the samples in the tar (a failed download or resize writes none).
STATS_SUFFIX = "_stats.json"
# A tar newer than its _stats.json by more than this was written again after img2dataset
# counted it (filtered, re-downloaded): it is read to count it. Within it: copies and
# uploads of many files at once that end in another order than they began.
STATS_SLACK_S = 60.0
# Tars read whole to count them whose size gets a line in the log (what planning waits on).
SCAN_NOTE_BYTES = 1 << 30


def stats_uri(tar: str) -> str:
    return tar_stem(tar) + STATS_SUFFIX


def stats_count(storage: Storage, tar: str, infos: dict[str, pafs.FileInfo]) -> tuple[int | None, str]:
    """(samples, "") from the tar's img2dataset ``_stats.json``, or (None, why not)."""
    side = infos.get(stats_uri(tar))
    if side is None:
        return None, "no _stats.json"
    mine = infos.get(tar)
    if side.mtime is None or mine is None or mine.mtime is None:
        return None, "no modification times to compare"
    if (mine.mtime - side.mtime).total_seconds() > STATS_SLACK_S:
        return None, "tar newer than its _stats.json"
    try:
        stats = json.loads(storage.read_bytes(stats_uri(tar)))
    except (OSError, ValueError):
        return None, "_stats.json unreadable"
    n, total = (stats.get("successes"), stats.get("count")) if isinstance(stats, dict) else (None, None)
    if type(n) is not int or n < 0 or (total is not None and (type(total) is not int or total < n)):
        return None, "_stats.json without a sample count"
    return n, ""


def count_tar_samples(fileobj, source: str = "the tar") -> int:
    """Samples (keys with an image) in a tar; members of a sample apart from each other are
    refused here as ``iter_tar_samples`` refuses them, before Ray starts: this read is
    the one the driver makes of the whole tar."""
    keys, closed, last = set(), set(), None
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            if member.isfile():
                key, ext = split_key(member.name)
                if key != last:
                    if last is not None:
                        closed.add(last)
                    _check_adjacent(closed, key, member.name, source)
                    last = key
                if ext in IMAGE_EXTS:
                    keys.add(key)
    return len(keys)


def _tar_rows(row: dict, uris: dict[str, str]) -> list[dict]:
    """flat_map stage: one tar file's bytes → its samples, keyed by the file's URI (Ray
    gives the path inside the filesystem: ``bucket/key`` for S3)."""
    return list(iter_tar_samples(io.BytesIO(row["bytes"]), uris.get(row["path"], row["path"])))


class WebDataset(ShardFormat):
    name = "webdataset"
    suffixes = TAR_SUFFIXES
    label = ".tar (.tar.gz)"
    writable = True
    manifest_schema = {"KEY.<image ext>": "encoded image", "KEY.txt": "caption",
                       "KEY.json": "{key, caption}",
                       "KEY.mask.png": "loss mask, where the source image has one",
                       "KEY.control.<image ext>": "control image, where the source image has one",
                       "KEY.control_k.<image ext>": "input k's control image (k ≥ 2), where the "
                                                    "source image has one"}

    def count_rows(self, data, files, storage):
        """Samples per tar: from the shard builder's manifest when present, else from
        img2dataset's ``_stats.json`` beside each tar, else by reading the tar (every
        byte of it: its members' headers are spread through it). With data.cache=latents
        the rows the plan's sample check reads are read first: one with several captions
        is refused (``several_captions_problem``) as a problem of the plan, not a stack
        trace from that check (``iter_rows`` refuses those it reads later: held-out rows,
        the bucket scan, the cache's build)."""
        if data.cache == "latents":
            from raylora.data.plan import SAMPLE_ROWS

            for _ in self.sample_rows(data, files, storage, SAMPLE_ROWS):
                pass
        return self._count_rows(data, files, storage)

    def _count_rows(self, data, files, storage):
        roots = {f.rsplit("/", 1)[0] for f in files}
        if len(roots) == 1:
            manifest = read_manifest(storage, roots.pop())
            if manifest and manifest.get("format") == self.name:
                listed = {s["name"]: s["count"] for s in manifest.get("shards", [])}
                names = [f.rsplit("/", 1)[1] for f in files]
                if all(n in listed for n in names):
                    counts = [listed[n] for n in names]
                    return sum(counts), counts
        infos = storage.beside(files)  # the tars' and sidecars' sizes and times
        found = concurrently(lambda f: stats_count(storage, f, infos), files)

        def scan(f: str) -> int:
            with _tar_stream(storage, f) as fh:
                return count_tar_samples(fh, f)

        missing = [f for f, (n, _) in zip(files, found) if n is None]
        scanned = dict(zip(missing, concurrently(scan, missing)))
        counts = [scanned[f] if n is None else n for f, (n, _) in zip(files, found)]
        size = sum(infos[f].size or 0 for f in missing if f in infos)
        if missing and size >= SCAN_NOTE_BYTES:  # why planning takes this long, and what avoids it
            why = Counter(w for n, w in found if n is None)
            log.info("webdataset: %d of %d tar(s) (%.1f GB) read whole to count their samples "
                     "(%s); a manifest.json (raylora shards build) or img2dataset's "
                     "_stats.json beside them is read instead", len(missing), len(files),
                     size / 1e9,
                     ", ".join(f"{k}: {v}" for k, v in why.most_common()))
        return sum(counts), counts

    def iter_rows(self, data, files, storage):
        for f in files:
            with _tar_stream(storage, f) as fh:
                for row in iter_tar_samples(fh, f, data.masked_loss, control_names(data)):
                    if problem := several_captions_problem(data, row):
                        raise ValueError(problem)
                    yield row

    def read_dataset(self, data, files, file_rows, storage, seed, shuffle, **map_args):
        # map_args are for the parquet read stage; a tar is one read task whatever they say.
        import ray
        from ray.data import FileShuffleConfig

        from raylora.storage import fs_path

        shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True) if shuffle else None
        fs, _ = storage.fs(files[0])
        paths = [fs_path(f) for f in files]
        ds = ray.data.read_binary_files(paths, filesystem=fs, include_paths=True, shuffle=shuffle)
        return ds.flat_map(_tar_rows, fn_kwargs={"uris": dict(zip(paths, files))})

    def write_shard(self, storage, index, items):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, it in enumerate(items):
                # img2dataset-style keys: the sample's index, zero-padded, shard-prefixed.
                key = f"{index:05d}{i:04d}"
                ext = posixpath.splitext(it["uri"])[1].lower()
                sidecars = [(MASK_SUFFIX, it.get("mask_uri"))] + [
                    (control_infix(c) + posixpath.splitext(uri)[1].lower(), uri)
                    for c, uri in item_controls(it)]
                for suffix, payload in (
                    (ext, storage.read_bytes(it["uri"])),
                    (".txt", it["text"].encode("utf-8")),
                    (".json", json.dumps({"key": it["key"], "caption": it["text"]}).encode()),
                    *((sfx, storage.read_bytes(uri)) for sfx, uri in sidecars if uri),
                ):
                    info = tarfile.TarInfo(key + suffix)
                    info.size = len(payload)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(payload))
        return f"shard-{index:05d}.tar", buf.getvalue()
