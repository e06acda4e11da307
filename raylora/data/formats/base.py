"""What every shard format provides, and the pieces the formats share.

A format is one ``ShardFormat`` object in the registry (``raylora.data.formats``). The rest
of raylora asks it, by name, to pick its files out of a listing, count their rows, read
them (plainly, in file order, or as a Ray dataset) and, where it can, write a shard. Rows
are ``{"key", "image", "text"}`` (and ``mask``, encoded bytes or None, with
``data.masked_loss``; ``control``, likewise, with ``data.control_images``, and ``control_2``
... ``control_N`` with data.control_inputs N > 1) whatever the format: ``key`` says where
the sample is (file, and row or sample name), so the validating decode
(``raylora.data.decode``) reports a bad sample at the same kind of place for every format.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raylora.storage import Storage

if TYPE_CHECKING:  # the registry is imported by Ray tasks that need no config models
    from raylora.config import DataSection

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MANIFEST = "manifest.json"
# A sample's loss mask beside its image (data.masked_loss): KEY.png + KEY.mask.png, in a
# tar or a folder. Lossless only: JPEG ringing would leak weight across a mask's edges.
MASK_SUFFIX = ".mask.png"

# A sample's control image beside its image (data.control_images, the input of an edit
# pair): KEY.control.<one of IMAGE_EXTS>, in a tar or a folder. Any image format: it is an
# input the VAE encodes, as lossy as the user's photos. Input k ≥ 2 of a sample with
# several (data.control_inputs): KEY.control_k.<ext> (raylora.config.control_key).
CONTROL_INFIX = ".control"
# The stem's end of any input's sidecar, for telling sidecars apart without the config:
# ``.control`` and ``.control_<digits>`` (``_0``/``_1`` too: never a training image).
_CONTROL_STEM = re.compile(re.escape(CONTROL_INFIX) + r"(?:_(\d+))?$")

# Marks a caption whose bytes were not UTF-8. Rows travel through Arrow, whose string
# columns cannot hold the raw bytes (and a column of mixed str/bytes has no Arrow type),
# so the caption stays a str with this prefix and the validating decode drops the row.
NOT_UTF8 = "\x00raylora:not-utf8\x00"


def decode_text(data: bytes) -> str:
    """A caption file's text. ``utf-8-sig``: Notepad and other Windows tools start a file
    with a byte-order mark, which would otherwise lead the caption (``\ufeffohwx`` is
    another token than the trigger word ``ohwx``), as the metadata files are read."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return NOT_UTF8 + data.decode("latin-1")


def image_bytes(value: Any) -> bytes:
    """Encoded bytes of an image cell (raw bytes or a Hugging Face ``{bytes, path}`` struct)."""
    if isinstance(value, dict):
        value = value.get("bytes")
    if value is None:
        return b""
    return bytes(value)


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` of the places ``0 .. n-1``, evenly spaced, the first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(j * (n - 1) / (k - 1)) for j in range(k)}) if k > 1 else [0]


# Files the driver reads at once when it plans (parquet footers, tar scans, sidecars): one
# after another, each is a round trip to the store (1000 shards × 2 requests × 20 ms: 40 s).
PLAN_THREADS = 16


def concurrently(fn: Callable, items: Iterable, threads: int = PLAN_THREADS) -> list:
    """``[fn(x) for x in items]``, ``threads`` at a time, in order; the first error raised
    is raised (by then the other calls in flight have ended)."""
    items = list(items)
    if len(items) <= 1 or threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


# A shard's names: plain tars, and gzipped ones (read as a stream all the same).
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def tar_stem(tar: str) -> str:
    """``00000`` of ``00000.tar`` / ``00000.tar.gz`` / ``00000.tgz``."""
    lower = tar.lower()
    return next(tar[: -len(s)] for s in (".tar.gz", ".tgz", ".tar") if lower.endswith(s))


def img2dataset_metadata(files: list[str]) -> set[str]:
    """The parquet files of a listing that img2dataset wrote beside its shards: per-sample
    metadata (url, caption, status, size; no image bytes). Its webdataset output is
    ``00000.tar`` + ``00000.parquet`` + ``00000_stats.json``, its files output a folder
    ``00000/`` + ``00000.parquet``: such a parquet is not a parquet shard to train on."""
    tars = {tar_stem(f) for f in files if f.lower().endswith(TAR_SUFFIXES)}
    folders = {f.rsplit("/", 1)[0] for f in files if "/" in f}
    return {f for f in files if f.lower().endswith(".parquet")
            and (f[:-8] in tars or f[:-8] in folders)}


def read_manifest(storage: Storage, root: str) -> dict | None:
    """The shard builder's manifest beside the shards, if there is one."""
    uri = posixpath.join(root.rstrip("/"), MANIFEST)
    try:
        if storage.exists(uri):
            return json.loads(storage.read_bytes(uri))
    except (OSError, ValueError):
        return None
    return None


def is_mask_file(name: str) -> bool:
    """A sidecar mask: never a training image itself, whether masks are on or not."""
    return name.lower().endswith(MASK_SUFFIX)


def is_control_file(name: str) -> bool:
    """A sidecar control image of any input (``cat.control.png``, ``cat.control_2.jpg``):
    never a training image itself."""
    stem, ext = posixpath.splitext(name.lower())
    return ext in IMAGE_EXTS and _CONTROL_STEM.search(stem) is not None


def control_index(name: str) -> int | None:
    """The input (0-based) whose sidecar ``name`` is: ``cat.control.png`` 0,
    ``cat.control_2.png`` 1 (a tar member's ``.control_2.png`` likewise); None for any
    other name, and for ``.control_0``/``.control_1``, which no input is named."""
    stem, ext = posixpath.splitext(name.lower())
    m = _CONTROL_STEM.search(stem) if ext in IMAGE_EXTS else None
    if m is None or m.group(1) is None:
        return None if m is None else 0
    k = int(m.group(1))
    return k - 1 if k >= 2 else None


def control_infix(i: int) -> str:
    """Input ``i``'s sidecar infix: ``.control``, ``.control_2``, ..."""
    from raylora.config import control_key  # the registry imports no config at load

    return control_key(CONTROL_INFIX, i)


def control_names(data: DataSection) -> list[str]:
    """The row keys of a sample's control images (data.control_images; else none):
    ``control``, ``control_2``, ... one per data.control_inputs."""
    from raylora.config import control_key

    return [control_key("control", i) for i in range(data.references())]


def control_uris(image: str, i: int = 0) -> list[str]:
    """Where an image file's sidecar control image (input ``i``) may be, in the order
    looked for: its own extension first (``cat.jpg`` → ``cat.control.jpg``, input 2's
    ``cat.control_2.jpg``), then the others."""
    stem, ext = posixpath.splitext(image)
    infix = control_infix(i)
    return [stem + infix + e for e in _own_first(ext)]


def item_controls(item: dict) -> list[tuple[int, str]]:
    """(input index, URI) of each control image a shard item (``raylora.data.shards``)
    carries: its ``control_uri`` (index 0), ``control_uri_2`` (1), ..."""
    from raylora.config import MAX_CONTROL_INPUTS, control_key

    keys = [(i, control_key("control_uri", i)) for i in range(MAX_CONTROL_INPUTS)]
    return [(i, item[k]) for i, k in keys if item.get(k)]


def _own_first(ext: str) -> list[str]:
    # Upper-case too: a camera's (or Windows') k.control.JPG is an image the listing
    # leaves out of training as a control, and must be found as one.
    return [ext] + [e for e in IMAGE_EXTS + tuple(x.upper() for x in IMAGE_EXTS) if e != ext]


def control_candidates(data: DataSection, image: str, i: int = 0) -> list[str]:
    """Where an image file's control image (input ``i``) may be, in the order looked for:
    its sidecars (``control_uris``), or with data.control_uri the same relative path and
    stem in input ``i``'s folder, its own extension first (``{data.uri}/a/cat.jpg`` →
    ``{control_uri}/a/cat.jpg``, ``.../a/cat.png``, ...)."""
    folders = data.control_folders()
    if not folders:
        return control_uris(image, i)
    from raylora.data.formats.captionfolder import below_root, data_roots
    from raylora.storage import normalize

    rel = below_root(data_roots(data.uri, beneath=[image]), image) or posixpath.basename(image)
    stem, ext = posixpath.splitext(rel)
    base = normalize(folders[i]).rstrip("/")
    return [f"{base}/{stem}{e}" for e in _own_first(ext)]


def sidecar_control(storage: Storage, image: str, data: DataSection, i: int = 0) -> bytes | None:
    """The encoded control image (input ``i``) of an image file (``control_candidates``),
    None when it has none (the validating decode drops the row as missing_control). One
    read when it has the image's extension; a missing one costs a read per extension (rows
    are read without their folder's listing)."""
    for uri in control_candidates(data, image, i):
        try:
            return storage.read_bytes(uri)
        except FileNotFoundError:
            continue
    return None


def mask_uri(image: str) -> str:
    """Where an image file's sidecar mask is: ``cat.png`` → ``cat.mask.png``."""
    return posixpath.splitext(image)[0] + MASK_SUFFIX


def sidecar_mask(storage: Storage, image: str) -> bytes | None:
    """The encoded sidecar mask of an image file, None when it has none (it trains
    unmasked). The one place folder formats look for masks."""
    try:
        return storage.read_bytes(mask_uri(image))
    except FileNotFoundError:
        return None


def mask_companions(data: DataSection, files: list[str], listing: list[str]) -> list[str]:
    """The sidecar masks in ``listing`` of image ``files`` (data.masked_loss; else none)."""
    if not data.masked_loss:
        return []
    present = set(listing)
    return [m for m in map(mask_uri, files) if m in present]


def with_mask(data: DataSection, row: dict, mask, controls=None) -> dict:
    """``row`` with its ``mask`` (encoded bytes or None) when data.masked_loss is on, and
    its control images likewise (``control_names``: ``control``, ``control_2``, ...) when
    data.control_images is; as it was otherwise (no extra column, nothing else read).
    ``mask`` may be a function, called only then; ``controls`` a list (one per input) or
    a function of the input's index, called only then (None: every input missing)."""
    if data.masked_loss:
        row = {**row, "mask": mask() if callable(mask) else mask}
    if data.control_images:
        read = controls if callable(controls) else \
            (lambda i: None if controls is None else controls[i])
        row = {**row, **{name: read(i) for i, name in enumerate(control_names(data))}}
    return row


def with_sidecars(data: DataSection, row: dict, storage: Storage, image: str) -> dict:
    """``with_mask`` for an image file: its sidecar mask and control images, read only
    when their keys are on. The one place folder formats look for them."""
    return with_mask(data, row, lambda: sidecar_mask(storage, image),
                     lambda i: sidecar_control(storage, image, data, i))


@functools.lru_cache(maxsize=4)
def process_storage(endpoint_url: str | None, region: str | None) -> Storage:
    """One per process and endpoint, for Ray stages: it keeps its filesystem client
    between tasks."""
    return Storage(endpoint_url, region)


class ShardFormat:
    """One shard format. Subclasses set ``name``, ``suffixes`` and ``label`` and implement
    ``count_rows``, ``iter_rows`` and ``read_dataset``; ``write_shard`` where shards of the
    format can be built (``raylora shards build``)."""

    name: str
    suffixes: tuple[str, ...]  # of the files that belong to a dataset of this format
    label: str  # how the detection error names its files
    writable = False
    manifest_schema: dict = {}

    def detects(self, files: list[str]) -> bool:
        """Whether a listing is of this format (the registry asks the formats in order)."""
        return bool(self.select(files))

    def select(self, files: list[str]) -> list[str]:
        """The files of a listing that this format reads (stray files dropped)."""
        return [f for f in files if f.lower().endswith(self.suffixes) and not is_mask_file(f)
                and not is_control_file(f)]

    def check_listing(self, data: DataSection, files: list[str], listing: list[str]) -> None:
        """Problems the listing shows before any file is read (``files``: this format's
        part of ``listing``). Raises ValueError naming them."""

    def companions(self, data: DataSection, files: list[str], listing: list[str]) -> list[str]:
        """Files of the listing besides ``files`` that rows are read from (a caption
        folder's caption files, sidecar masks): a change to them is a
        change to the data. Control images are found by ``raylora.data.plan.control_files``,
        beside the images or in data.control_uri's folder."""
        return mask_companions(data, files, listing)

    def repeats(self, data: DataSection, files: list[str]) -> list[int] | None:
        """Times each file's rows count in an epoch, where the data says so (a caption
        folder's kohya ``N_name`` folders); None: once each."""
        return None

    def count_rows(self, data: DataSection, files: list[str],
                   storage: Storage) -> tuple[int, list[int] | None]:
        """(rows, rows per file or None), checking what can be checked before any worker
        starts. Raises FileNotFoundError / ValueError / OSError naming the file at fault."""
        raise NotImplementedError

    def iter_rows(self, data: DataSection, files: list[str], storage: Storage) -> Iterator[dict]:
        """Rows ``{key, image, text}`` in file order, one file open at a time, without Ray."""
        raise NotImplementedError

    def read_dataset(self, data: DataSection, files: list[str], file_rows: list[int] | None,
                     storage: Storage, seed: int, shuffle: bool, **map_args):
        """The rows as a lazy ``ray.data.Dataset`` with columns ``key``, ``image`` (encoded
        bytes or a ``{bytes, path}`` struct), ``text``. ``shuffle``: a new seeded file (or
        part) order every epoch, else file order. ``map_args``: ``compute`` and
        ``num_cpus`` for a read stage that Ray Data can fuse with the next one."""
        raise NotImplementedError

    def units(self, data: DataSection, files: list[str], storage: Storage,
              rows_per_unit: int, repeats: list[int] | None = None) -> list[tuple[int, int, int]]:
        """Pieces that read independently, in source order: ``(file index, start, stop)``,
        rows ``start`` to ``stop`` counted from the first row of file ``index`` (stop -1:
        to the end of that file). One per file unless the format's files are not one
        piece each (imagefolder: slices of one row list; captionfolder: runs of images).
        The rows of a unit have the same ``repeats`` (the plan's, where given: a worker's
        share of a file's copies under data.sharding=files; else the files' own)."""
        return [(i, 0, -1) for i in range(len(files))]

    def iter_unit(self, data: DataSection, files: list[str], storage: Storage,
                  index: int, start: int, stop: int,
                  keep: Callable[[int], bool] | None = None) -> Iterator[dict]:
        """The rows of one of ``units``, in order; with ``keep``, only those at the places
        (0: the unit's first row) it says yes to: a partial copy (``raylora.data.plan``)."""
        rows = itertools.islice(self.iter_rows(data, [files[index]], storage), start,
                                None if stop < 0 else stop)
        return rows if keep is None else (r for j, r in enumerate(rows) if keep(j))

    def sample_rows(self, data: DataSection, files: list[str], storage: Storage,
                    k: int) -> Iterator[dict]:
        """Up to about ``k`` rows spread over the data, for the driver's check that some of
        them decode (``raylora.data.plan.sample_problems``): the first rows of up to ``k``
        files evenly spaced in the listing, so that one bad shard among good ones is not
        all it sees."""
        picks = spread(len(files), k)
        per = -(-k // max(1, len(picks)))
        for i in picks:
            with contextlib.closing(self.iter_rows(data, [files[i]], storage)) as rows:
                yield from itertools.islice(rows, per)

    def write_shard(self, storage: Storage, index: int, items: list[dict]) -> tuple[str, bytes]:
        """Shard number ``index`` of ``items`` (``{key, uri, text}``): (file name, bytes)."""
        raise ValueError(f"{self.name} shards cannot be written")
