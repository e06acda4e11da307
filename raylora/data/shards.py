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

from raylora.config import MAX_CONTROL_INPUTS, DataSection, control_key
from raylora.data import formats
from raylora.data.formats.imagefolder import is_metadata
from raylora.storage import Storage, join, normalize

log = logging.getLogger("raylora.data")


def collect_items(store: Storage, src: str, missing: list[tuple[str, str]] | None = None,
                  uncaptioned: list[str] | None = None) -> list[dict]:
    """``[{"key", "uri", "text"}]`` for every captioned image under ``src``, sorted by key.
    The files are those training reads from the folder (``Storage.data_files``: no hidden
    files or folders, no macOS ``._*`` companions, no job markers). ``text``: a list where
    a metadata line has several captions (``raylora.data.captions.caption_list``).
    What is left out is appended to ``missing`` (``(metadata file, file_name)`` of a line
    whose image is not there) and ``uncaptioned`` (a caption folder's images without a
    caption): ``checked_items`` judges them as training does."""
    from raylora.data.captions import caption_list
    from raylora.data.formats.captionfolder import below_root

    src = normalize(src)
    files = store.data_files(src)
    if not files:
        raise FileNotFoundError(f"{src}: no files found")
    if any(is_metadata(f) for f in files):
        items = formats.imagefolder_rows(store, files, "text", missing,
                                         key_name="raylora shards build reads the caption key")
    else:
        items = _caption_folder_items(store, src, files, uncaptioned)
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


def _caption_folder_items(store: Storage, src: str, files: list[str],
                          uncaptioned: list[str] | None = None) -> list[dict]:
    """A caption folder's captioned images as training reads them: the ``.txt`` beside an
    image, else the class tokens of a kohya ``N_name`` folder it is in; the others are
    appended to ``uncaptioned``. A shard holds each image once: the folder's repeats are
    not carried. Keys are the image URIs, as an image folder's (``collect_items`` cuts
    the extension: a stem's own dots stay, ``IMG_1.v1.jpg`` is not ``IMG_1.v2.jpg``)."""
    from raylora.data.formats.captionfolder import CAPTION_EXTENSIONS, first_folder, kohya_folder

    texts = {f[: -len(".txt")] for f in files if f.endswith(".txt")}
    present = set(files)
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
            # a caption of another extension (kohya's default .caption) would be lost to
            # the class tokens, as training refuses it (CaptionFolder.check_listing)
            other = next((stem + e for e in CAPTION_EXTENSIONS if stem + e in present), None)
            if other is not None:
                raise ValueError(f"{other}: a caption file that shards build does not read "
                                 "(it reads .txt): rename the captions to .txt; else the "
                                 f"image would be written with its folder's class tokens, {folder[1]!r}")
            text = folder[1]
        else:
            if uncaptioned is not None:
                uncaptioned.append(f)
            continue
        if folder is not None and folder[0] > 1:
            repeated.add(first)
        items.append({"key": f, "uri": f, "text": text})
    if repeated:
        log.warning("%s: kohya repeats (%s) are not carried into shards: each image is written "
                    "once; weigh the shards with data.sources[i].weight instead",
                    src, ", ".join(sorted(repeated)))
    return items


def write_shard(store: Storage, dest: str, fmt: str, index: int, items: list[dict],
                schema=None) -> dict:
    """Write one shard; returns ``{"name", "count", "bytes"}``. ``schema``: a parquet
    build's columns (``parquet.shard_schema`` of all its items), the same in every shard."""
    extra = {} if schema is None else {"schema": schema}
    name, data = formats.get_format(fmt).write_shard(store, index, items, **extra)
    store.write_bytes(join(dest, name), data)
    return {"name": name, "count": len(items), "bytes": len(data)}


class _WriteShard:
    def __init__(self, endpoint_url, region, dest, fmt, schema=None):
        self.store = Storage(endpoint_url, region)
        self.dest, self.fmt, self.schema = dest, fmt, schema

    def __call__(self, row: dict) -> dict:
        return write_shard(self.store, self.dest, self.fmt, int(row["index"]),
                           json.loads(row["items"]), self.schema)


# What training refuses by default (data.max_bad_fraction): a build is held to it too.
MAX_BAD_FRACTION = DataSection.model_fields["max_bad_fraction"].default


def left_out_problem(src: str, kept: int, missing: list[tuple[str, str]], uncaptioned: list[str],
                     max_bad_fraction: float = MAX_BAD_FRACTION) -> tuple[str, bool] | None:
    """(what ``collect_items`` left out of ``src``, whether that refuses the build: more
    than ``max_bad_fraction`` of its images), or None when nothing was. Training warns
    about such images or refuses the folder: a build dropped them without a word (9 of 10
    images gone gave a shard of one)."""
    if missing:
        total = kept + len(missing)
        metas = {m for m, _ in missing}
        what = (f"{src}: {len(missing)} of {total} lines of {missing[0][0]}"
                f"{' and the other metadata files' if len(metas) > 1 else ''} name an image "
                f"that is not in the folder (e.g. {', '.join(repr(f) for _, f in missing[:3])})")
        fix = "Restore the images or remove their lines"
        share = len(missing) / total
    elif uncaptioned:
        total = kept + len(uncaptioned)
        what = (f"{src}: {len(uncaptioned)} of {total} images have no caption: no .txt file "
                "beside them and not in a kohya N_name folder (e.g. "
                f"{', '.join(uncaptioned[:3])})")
        fix = "Caption them (a .txt beside each) or remove them"
        share = len(uncaptioned) / total
    else:
        return None
    if share > max_bad_fraction:
        return (f"{what}; {share:.1%} of them, over --max-bad-fraction={max_bad_fraction:g} "
                f"(default data.max_bad_fraction's, where training refuses the folder); nothing "
                f"written. {fix}"), True
    return f"{what}: left out of the shards", False


def checked_items(src: str, dest: str, fmt: str, shard_size: int, store: Storage,
                  max_bad_fraction: float = MAX_BAD_FRACTION) -> list[dict]:
    """The arguments checked, and ``src``'s captioned images (``collect_items``), without
    Ray: a source with nothing to shard or a destination that cannot be written is named
    before a cluster is joined or started (each costs seconds; the shard tasks failed on
    the destination only once they ran). Images left out (``left_out_problem``): a
    warning, or refused over ``max_bad_fraction``."""
    if fmt not in formats.writable_formats():
        raise ValueError(f"--format: {fmt!r} is not {' or '.join(formats.writable_formats())}")
    if shard_size <= 0:
        raise ValueError(f"--shard-size: must be positive, got {shard_size}")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"--max-bad-fraction: between 0 and 1, got {max_bad_fraction:g}")
    missing: list[tuple[str, str]] = []
    uncaptioned: list[str] = []
    items = collect_items(store, src, missing, uncaptioned)
    if found := left_out_problem(normalize(src), len(items), missing, uncaptioned,
                                 max_bad_fraction):
        what, refused = found
        if refused:
            raise ValueError(what)
        log.warning("%s", what)
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

    from raylora.data.formats import parquet

    store = store or Storage()
    if items is None:
        items = checked_items(src, dest, fmt, shard_size, store)
    dest = normalize(dest)
    # Decided once from every item, not per shard task: see parquet.shard_schema
    schema = parquet.shard_schema(items) if fmt == "parquet" else None
    chunks = [items[i : i + shard_size] for i in range(0, len(items), shard_size)]
    rows = [{"index": i, "items": json.dumps(c)} for i, c in enumerate(chunks)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    stats = ds.map(
        _WriteShard,
        fn_constructor_kwargs=dict(
            endpoint_url=store.endpoint_url, region=store.region, dest=dest, fmt=fmt,
            schema=schema,
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4),
        num_cpus=0.5,
    ).take_all()
    shards = sorted(stats, key=lambda s: s["name"])
    manifest = {
        "format": fmt,
        "count": sum(s["count"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "schema": parquet.described(schema) if schema is not None else
        formats.get_format(fmt).manifest_schema,
        "source": normalize(src),
        "shards": shards,
    }
    store.write_bytes(join(dest, formats.MANIFEST), json.dumps(manifest, indent=2).encode())
    return manifest
