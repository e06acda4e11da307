"""The shard formats people already have, one registry entry each.

- parquet: an image column of encoded bytes (or a datasets struct ``{bytes, path}``) and a
  caption column (``raylora.data.formats.parquet``).
- webdataset: tar files as img2dataset writes them (``raylora.data.formats.webdataset``).
- imagefolder: images plus ``metadata.jsonl`` or ``metadata.csv`` (``raylora.data.formats.imagefolder``).
- captionfolder: images with a same-stem ``.txt`` caption each, kohya ``N_name`` folders
  (``raylora.data.formats.captionfolder``).

Each entry is a ``ShardFormat`` (``raylora.data.formats.base``): it picks its files out of
a listing, counts rows, reads rows as ``{"key", "image", "text"}`` (so the rest of the
pipeline does not care which format they came from, and bad samples are reported by the
same ``key``), and writes shards where it can. A new format is one module with one class
and one line in ``FORMATS`` (and its name in ``data.format``'s choices).
"""

from __future__ import annotations

from raylora.data.formats.base import (
    CONTROL_INFIX, IMAGE_EXTS, MANIFEST, MASK_SUFFIX, NOT_UTF8, ShardFormat, control_index,
    control_infix, control_names, control_uris, decode_text, image_bytes, is_control_file,
    is_mask_file, mask_uri, read_manifest,
)
from raylora.data.formats.captionfolder import CaptionFolder
from raylora.data.formats.imagefolder import METADATA, ImageFolder, imagefolder_rows
from raylora.data.formats.parquet import Parquet
from raylora.data.formats.webdataset import WebDataset

# In detection order: a listing with any parquet file is parquet, then tar, then images
# with a metadata.jsonl/.csv (imagefolder), then images alone (captionfolder: captions beside
# them, or kohya folder names).
FORMATS: dict[str, ShardFormat] = {
    f.name: f for f in (Parquet(), WebDataset(), ImageFolder(), CaptionFolder())}

__all__ = [
    "CONTROL_INFIX", "FORMATS", "IMAGE_EXTS", "MANIFEST", "MASK_SUFFIX", "control_index",
    "control_infix", "control_names", "control_uris",
    "is_control_file", "is_mask_file", "mask_uri", "METADATA", "NOT_UTF8", "ShardFormat", "decode_text",
    "detect_format", "get_format", "image_bytes", "imagefolder_rows", "read_manifest", "writable_formats",
]


def get_format(name: str) -> ShardFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"data.format: {name!r} is not one of {', '.join(FORMATS)}") from None


def detect_format(files: list[str]) -> str:
    """Format of the files a data URI matched (the first format that sees its files wins
    over stray files of later ones)."""
    for fmt in FORMATS.values():
        if fmt.detects(files):
            return fmt.name
    labels = [f.label for f in FORMATS.values()]
    raise ValueError(
        f"cannot detect the data format of {files[:3]}: expected "
        f"{', '.join(labels[:-1])} or {labels[-1]}"
    )


def writable_formats() -> list[str]:
    """Formats ``raylora shards build`` can write."""
    return [name for name, f in FORMATS.items() if f.writable]
