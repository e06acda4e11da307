"""The three shard formats people already have, read without Ray.

- parquet: an image column of encoded bytes (or a datasets struct ``{bytes, path}``) and a
  caption column.
- webdataset: tar files as img2dataset writes them: ``KEY.jpg|jpeg|png|webp`` +
  ``KEY.txt`` (+ ``KEY.json``). Only image bytes, UTF-8 text and JSON are read: nothing in
  a shard is ever unpickled or executed.
- imagefolder: images plus ``metadata.jsonl`` lines ``{"file_name": ..., "text": ...}``
  (Hugging Face imagefolder), in the same folder or a parent.

Every reader yields rows ``{"key", "image", "text"}`` so the rest of the pipeline does not
care which format it came from.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator

from raylora.storage import Storage

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
PARQUET_EXTS = (".parquet", ".pq")
TAR_EXTS = (".tar",)
METADATA = "metadata.jsonl"
MANIFEST = "manifest.json"


def detect_format(files: list[str]) -> str:
    """Format of the files a data URI matched (the majority wins over stray files)."""
    names = [f.lower() for f in files]
    if any(n.endswith(PARQUET_EXTS) for n in names):
        return "parquet"
    if any(n.endswith(TAR_EXTS) for n in names):
        return "webdataset"
    if any(n.endswith(IMAGE_EXTS) or n.endswith("/" + METADATA) for n in names):
        return "imagefolder"
    raise ValueError(
        f"cannot detect the data format of {files[:3]}: expected .parquet, .tar or image files"
    )


# Marks a caption whose bytes were not UTF-8. Rows travel through Arrow, whose string
# columns cannot hold the raw bytes (and a column of mixed str/bytes has no Arrow type),
# so the caption stays a str with this prefix and the validating decode drops the row.
NOT_UTF8 = "\x00raylora:not-utf8\x00"


def decode_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return NOT_UTF8 + data.decode("latin-1")


def split_key(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    dirname, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(dirname, stem), "." + ext.lower() if ext else ""


def iter_tar_samples(fileobj, source: str) -> Iterator[dict]:
    """Rows from one WebDataset tar, in file order. Samples without an image are skipped."""
    current: dict | None = None
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = split_key(member.name)
            if current is None or current["key"] != key:
                if current is not None and current.get("image") is not None:
                    yield _finish(current, source)
                current = {"key": key, "image": None, "text": None, "json": None}
            data = tar.extractfile(member).read()
            if ext in IMAGE_EXTS and current["image"] is None:
                current["image"] = data
            elif ext == ".txt":
                current["text"] = decode_text(data)
            elif ext == ".json":
                try:
                    current["json"] = json.loads(data)
                except ValueError:
                    current["json"] = None
            # Anything else (.pyd, .pickle, .cls, ...) is ignored on purpose.
        if current is not None and current.get("image") is not None:
            yield _finish(current, source)


def _finish(sample: dict, source: str) -> dict:
    text = sample["text"]
    if text is None and isinstance(sample["json"], dict):
        text = sample["json"].get("caption") or sample["json"].get("text")
    return {"key": f"{source}#{sample['key']}", "image": sample["image"], "text": text or ""}


def count_tar_samples(fileobj) -> int:
    keys = set()
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            if member.isfile():
                key, ext = split_key(member.name)
                if ext in IMAGE_EXTS:
                    keys.add(key)
    return len(keys)


def imagefolder_rows(storage: Storage, files: list[str], caption_key: str) -> list[dict]:
    """(image URI, caption) rows of an imagefolder, from its metadata.jsonl file(s).

    ``file_name`` is relative to the folder holding the metadata file. Images without a
    metadata line are not training data (no caption) and are left out.
    """
    metas = [f for f in files if posixpath.basename(f) == METADATA]
    if not metas:
        raise FileNotFoundError(
            f"{posixpath.dirname(files[0])}: imagefolder without {METADATA} "
            "(lines of {\"file_name\": ..., \"text\": ...})"
        )
    rows = []
    for meta in metas:
        base = posixpath.dirname(meta)
        for i, line in enumerate(storage.read_bytes(meta).decode("utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                name = rec["file_name"]
            except (ValueError, KeyError):
                raise ValueError(f"{meta}:{i + 1}: not a JSON line with a file_name") from None
            rows.append(
                {"key": posixpath.join(base, name), "uri": posixpath.join(base, name),
                 "text": str(rec.get(caption_key) or "")}
            )
    return rows


def read_manifest(storage: Storage, root: str) -> dict | None:
    """The shard builder's manifest beside the shards, if there is one."""
    uri = posixpath.join(root.rstrip("/"), MANIFEST)
    try:
        if storage.exists(uri):
            return json.loads(storage.read_bytes(uri))
    except (OSError, ValueError):
        return None
    return None
