"""``raylora shards build``: an image folder → sized parquet or WebDataset shards on any URI.

Captions come from ``metadata.jsonl`` or ``metadata.csv`` (``file_name``, ``text``) or a ``.txt`` file
beside each image. An image's sidecar loss mask (``KEY.mask.png``) and control images
(``KEY.control.<ext>``, an edit pair's input; ``KEY.control_2.<ext>``, ... for the others
of several) travel with it into its shard, where the readers look for them (tar members
beside the image; parquet columns ``mask``, ``control_image``, ``control_image_2``, ...,
the defaults of data.mask_column and data.control_column). Each shard is written by one Ray task, so a large folder is sharded in
parallel across the cluster; a ``manifest.json`` (count, bytes, schema, per-shard counts)
is written last, when every shard exists.
"""

from __future__ import annotations

import json
import logging
import posixpath

from raylora.config import MAX_CONTROL_INPUTS, control_key
from raylora.data import formats
from raylora.data.formats.imagefolder import is_metadata
from raylora.storage import Storage, join, normalize

log = logging.getLogger("raylora.data")


def collect_items(store: Storage, src: str) -> list[dict]:
    """``[{"key", "uri", "text"}]`` for every captioned image under ``src``, sorted by key.
    The files are those training reads from the folder (``Storage.data_files``: no hidden
    files or folders, no macOS ``._*`` companions, no job markers). ``text``: a list where
    a metadata line has several captions (``raylora.data.captions.caption_list``)."""
    from raylora.data.captions import caption_list
    from raylora.data.formats.captionfolder import below_root

    src = normalize(src)
    files = store.data_files(src)
    if not files:
        raise FileNotFoundError(f"{src}: no files found")
    if any(is_metadata(f) for f in files):
        items = formats.imagefolder_rows(store, files, "text",
                                         key_name="raylora shards build reads the caption key")
    else:
        items = _caption_folder_items(store, src, files)
    if not items:
        raise FileNotFoundError(
            f"{src}: no captioned images (need {formats.METADATA}, metadata.csv or a .txt "
            "beside each image)"
        )
    present = set(files)
    for it in items:  # keys relative to the source folder, stable across machines
        # (a hub listing names files at a commit, src names none: below_root compares both)
        it["key"] = posixpath.splitext(below_root([src], it["key"]) or it["key"][len(src) + 1:])[0]
        # several captions: a list, which a parquet shard keeps as one (list<string>)
        it["text"] = caption_list(it["text"]) or it["text"]
        if formats.mask_uri(it["uri"]) in present:
            it["mask_uri"] = formats.mask_uri(it["uri"])
        for i in range(MAX_CONTROL_INPUTS):  # control_uri, control_uri_2, ...
            control = [u for u in formats.control_uris(it["uri"], i) if u in present]
            if control:
                it[control_key("control_uri", i)] = control[0]
    return sorted(items, key=lambda it: it["key"])


def _caption_folder_items(store: Storage, src: str, files: list[str]) -> list[dict]:
    """A caption folder's captioned images as training reads them: the ``.txt`` beside an
    image, else the class tokens of a kohya ``N_name`` folder it is in (those images were
    left out). A shard holds each image once: the folder's repeats are not carried."""
    from raylora.data.formats.captionfolder import first_folder, kohya_folder

    texts = {f[: -len(".txt")] for f in files if f.endswith(".txt")}
    items, repeated = [], set()
    for f in files:
        stem, ext = posixpath.splitext(f)
        if ext.lower() not in formats.IMAGE_EXTS or formats.is_mask_file(f) or formats.is_control_file(f):
            continue
        first = first_folder([src], f)
        folder = kohya_folder(first)
        if stem in texts:
            raw = store.read_bytes(stem + ".txt")
            try:
                text = raw.decode("utf-8-sig").strip()
            except UnicodeDecodeError as exc:  # training drops it as caption_not_utf8
                raise ValueError(f"{stem}.txt: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                 "save it as UTF-8") from None
        elif folder is not None:
            text = folder[1]
        else:
            continue
        if folder is not None and folder[0] > 1:
            repeated.add(first)
        items.append({"key": stem, "uri": f, "text": text})
    if repeated:
        log.warning("%s: kohya repeats (%s) are not carried into shards: each image is written "
                    "once; weigh the shards with data.sources[i].weight instead",
                    src, ", ".join(sorted(repeated)))
    return items


def write_shard(store: Storage, dest: str, fmt: str, index: int, items: list[dict]) -> dict:
    """Write one shard; returns ``{"name", "count", "bytes"}``."""
    name, data = formats.get_format(fmt).write_shard(store, index, items)
    store.write_bytes(join(dest, name), data)
    return {"name": name, "count": len(items), "bytes": len(data)}


class _WriteShard:
    def __init__(self, endpoint_url, region, dest, fmt):
        self.store = Storage(endpoint_url, region)
        self.dest, self.fmt = dest, fmt

    def __call__(self, row: dict) -> dict:
        return write_shard(self.store, self.dest, self.fmt, int(row["index"]), json.loads(row["items"]))


def checked_items(src: str, dest: str, fmt: str, shard_size: int, store: Storage) -> list[dict]:
    """The arguments checked, and ``src``'s captioned images (``collect_items``), without
    Ray: a source with nothing to shard or a destination that cannot be written is named
    before a cluster is joined or started (each costs seconds; the shard tasks failed on
    the destination only once they ran)."""
    if fmt not in formats.writable_formats():
        raise ValueError(f"--format: {fmt!r} is not {' or '.join(formats.writable_formats())}")
    if shard_size <= 0:
        raise ValueError(f"--shard-size: must be positive, got {shard_size}")
    items = collect_items(store, src)
    several = [it["key"] for it in items if isinstance(it["text"], list)]
    if several and fmt != "parquet":
        raise ValueError(f"{src}: {len(several)} image(s) have several captions in their "
                         f"metadata line (e.g. {several[0]}); a {fmt} shard holds one caption "
                         "per image: build --format parquet (a list column, one caption drawn "
                         "per read in training)")
    if problem := store.write_problem(normalize(dest)):
        raise ValueError(f"dest: {problem}")
    there = [f for f in store.list_files(normalize(dest)) if not posixpath.basename(f).startswith(".")]
    if there:
        # a reader of the folder would read them beside the new shards (old shards past
        # the new count, the other format's): trained twice, or instead
        raise ValueError(f"dest: {normalize(dest)} already holds {len(there)} file(s) (e.g. "
                         f"{', '.join(posixpath.basename(f) for f in there[:3])}); give an empty "
                         "or new folder, or remove them first")
    return items


def build_shards(
    src: str, dest: str, fmt: str, shard_size: int, store: Storage | None = None,
    items: list[dict] | None = None,
) -> dict:
    """Shard ``src`` into ``dest`` with Ray Data (one task per shard); returns the manifest.
    ``items``: ``checked_items``' answer, when the caller checked before starting Ray."""
    import ray

    store = store or Storage()
    if items is None:
        items = checked_items(src, dest, fmt, shard_size, store)
    dest = normalize(dest)
    chunks = [items[i : i + shard_size] for i in range(0, len(items), shard_size)]
    rows = [{"index": i, "items": json.dumps(c)} for i, c in enumerate(chunks)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    stats = ds.map(
        _WriteShard,
        fn_constructor_kwargs=dict(
            endpoint_url=store.endpoint_url, region=store.region, dest=dest, fmt=fmt
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4),
        num_cpus=0.5,
    ).take_all()
    shards = sorted(stats, key=lambda s: s["name"])
    manifest = {
        "format": fmt,
        "count": sum(s["count"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "schema": formats.get_format(fmt).manifest_schema,
        "source": normalize(src),
        "shards": shards,
    }
    store.write_bytes(join(dest, formats.MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest
