"""Caption folder: images with their captions beside them in same-stem text files
(``cat.png`` + ``cat.txt``; the extension is ``data.caption_extension``), as kohya-ss
sd-scripts, SimpleTuner and ai-toolkit read them; local or in object storage. A row's key
is the image's URI; a caption is its file's text with surrounding whitespace stripped.

kohya's folder names are understood: a first-level subfolder of the data URI named
``N_name`` (``10_mychar``) holds images that count N times in every epoch (the plan
repeats them, ``raylora.data.plan``), and ``name`` is the caption of those of its images
that have no caption file (kohya's class tokens: DreamBooth-style training without
caption files). Other folders count once, at any depth.

An image without a caption file outside such a folder has no caption: the validating
decode counts it as ``missing_caption`` (or trains it on the empty prompt when
``data.caption_dropout`` > 0), as it does a WebDataset sample without text, rather than
training it silently on the empty prompt as kohya does. The driver refuses a folder
whose share of such reads is over ``data.max_bad_fraction`` before anything starts.

Each image is a file of one row, so ``data.sharding=files`` deals the images out to the
workers.
"""

from __future__ import annotations

import logging
import posixpath
import re

import numpy as np

from raylora.data.formats.base import (
    IMAGE_EXTS, ShardFormat, decode_text, mask_companions, process_storage, with_sidecars,
)
from raylora.storage import normalize

log = logging.getLogger("raylora.data")

# Caption-file extensions in use (kohya's default .caption, taggers' .txt and .tags, .cap):
# a same-stem file of one beside an image is a caption, of whatever extension.
CAPTION_EXTENSIONS = (".txt", ".caption", ".cap", ".tags")

# kohya's subfolder name: repeats, underscore, class tokens.
KOHYA_FOLDER = re.compile(r"(\d+)_(.+)")


def data_roots(uri: str | list[str], beneath: list[str] | None = None, store=None) -> list[str]:
    """The folders a data URI names (a glob: the folder before its first wildcard), each
    without a trailing slash, longest first.

    A ``[`` is read as ``Storage.expand`` reads it: a folder named "photos [2023]" is that
    folder, and a glob inside one is rooted there. Whether such a folder is there is told
    by ``beneath`` (files known to be the data's: a folder holding one is there), else
    asked of ``store`` (the run's ``Storage``, with its endpoint). A default Storage asked
    an ``s3://`` URI of AWS, not the config's ``storage.endpoint_url``: 31 s to fail here,
    the root taken as the bucket, and that for every row a worker read with
    data.control_uri."""
    roots = []
    for u in [uri] if isinstance(uri, str) else uri:
        u = normalize(u)
        if "[" in u:
            from raylora.storage import Storage, glob_root

            there = _holds(beneath) if beneath is not None else (store or Storage())._there
            root = u if there(u) else glob_root(u, there)[0]
        else:
            wild = [u.index(c) for c in "*?" if c in u]
            root = u[: min(wild)].rsplit("/", 1)[0] if wild else u
        roots.append(root.rstrip("/"))
    return sorted(roots, key=len, reverse=True)


def _unpinned(uri: str) -> str:
    """A hub URI without its revision (a listing pins its files to a commit, the root a
    user wrote names none, or a branch); any other URI as it is."""
    if uri.startswith("hf://"):
        from raylora.hubfs import unpinned

        return unpinned(uri)
    return uri


def _holds(files: list[str]):
    """``there(path)`` for ``data_roots``: whether ``path`` is one of ``files`` or a folder
    holding one (hub names compared without the revision)."""
    names = [_unpinned(normalize(f)) for f in files]

    def there(path: str) -> bool:
        path = _unpinned(path).rstrip("/")
        return any(f == path or f.startswith(path + "/") for f in names)
    return there


def root_holding(uri: str | list[str], place: str, store=None) -> str | None:
    """The folder of ``data_roots(uri)`` that is ``place`` or holds it (a normalized
    path or URI), None if none does: what is written there would be read as data.
    ``store``: the run's Storage (a ``[`` in ``uri`` is asked of it)."""
    place = place.rstrip("/")
    return next((r for r in data_roots(uri, store=store) if place == r or place.startswith(r + "/")), None)


def below_root(roots: list[str], uri: str) -> str | None:
    """``uri``'s path below the first of ``roots`` that holds it; None if none does. A hub
    listing names its files at a commit (``hf://datasets/o/n@<sha>/...``) where the root
    the user wrote names none (or a branch): they are compared without the revision."""
    if uri.startswith("hf://"):
        uri, roots = _unpinned(uri), [_unpinned(r) for r in roots]
    root = next((r for r in roots if uri.startswith(r + "/")), None)
    return uri[len(root) + 1:] if root is not None else None


def first_folder(roots: list[str], uri: str) -> str | None:
    """The folder right below the data root that ``uri`` is in (None: in the root)."""
    parts = (below_root(roots, uri) or "").split("/")
    return parts[0] if len(parts) > 1 else None


def kohya_folder(name: str | None) -> tuple[int, str] | None:
    """``(repeats, class tokens)`` of a kohya ``N_name`` folder name, else None."""
    m = KOHYA_FOLDER.fullmatch(name or "")
    return (int(m.group(1)), m.group(2)) if m else None


def caption_uri(image: str, extension: str) -> str:
    return posixpath.splitext(image)[0] + extension


class CaptionFolder(ShardFormat):
    name = "captionfolder"
    suffixes = IMAGE_EXTS
    label = "images with .txt captions"

    def detects(self, files):
        # After imagefolder in the registry: a metadata.jsonl/.csv makes a folder imagefolder.
        return any(f.lower().endswith(IMAGE_EXTS) for f in files)

    def _folders(self, data, files: list[str]) -> list[tuple[int, str] | None]:
        roots = data_roots(data.uri, beneath=files)
        return [kohya_folder(first_folder(roots, f)) for f in files]

    def repeats(self, data, files):
        out = []
        for f, k in zip(files, self._folders(data, files)):
            if k is not None and k[0] < 1:
                raise ValueError(f"{posixpath.dirname(f)}: a kohya folder name N_name needs "
                                 f"N >= 1 (times its images count per epoch), not {k[0]}")
            out.append(k[0] if k else 1)
        return out if any(r != 1 for r in out) else None

    def companions(self, data, files, listing):
        present = set(listing)
        captions = [c for c in (caption_uri(f, data.caption_extension) for f in files) if c in present]
        return captions + mask_companions(data, files, listing)

    def check_listing(self, data, files, listing):
        """Images with neither a caption file nor class tokens: refused up front when their
        reads (repeats counted) are more than data.max_bad_fraction of all."""
        present = set(listing)
        folders = self._folders(data, files)
        weights = [k[0] if k else 1 for k in folders]
        self._refuse_captions_of_another_extension(data, files, folders, present)
        missing = [(f, w) for f, w, k in zip(files, weights, folders)
                   if k is None and caption_uri(f, data.caption_extension) not in present]
        if not missing or data.captions_optional:  # class images take their prompt
            return
        what = (f"{len(missing)} of {len(files)} images have no caption: no "
                f"{data.caption_extension} file beside them and not in a kohya N_name folder "
                f"(e.g. {', '.join(f for f, _ in missing[:3])})")
        others = sorted({posixpath.splitext(f)[1] for f in listing
                         if not f.lower().endswith(IMAGE_EXTS)} - {""})
        if len(missing) == len(files) and others:
            # no image has a caption file, but other files are there: a caption extension
            # the folder does not use, most likely, and caption dropout would have trained
            # every image on the empty prompt without a word. (A folder of images alone,
            # such as DreamBooth class images taking their prompt, is not this.)
            raise ValueError(f"{what}: none has a caption (data.caption_extension is "
                             f"{data.caption_extension}; other files here end in "
                             f"{', '.join(others)})")
        if data.caption_dropout:
            log.warning("%s: with data.caption_dropout they train on the empty prompt", what)
            return
        share = sum(w for _, w in missing) / sum(weights)
        if share > data.max_bad_fraction:
            raise ValueError(
                f"{what}; {share:.1%} of the reads, over data.max_bad_fraction="
                f"{data.max_bad_fraction:g}. Add the caption files, move the images into an "
                "N_name folder (name becomes their caption), or set data.caption_dropout > 0 "
                "to train them on the empty prompt")
        log.warning("%s: they are dropped as missing_caption", what)

    def _refuse_captions_of_another_extension(self, data, files, folders, present) -> None:
        """Images in kohya ``N_name`` folders without a caption file but with a same-stem
        caption of another extension beside them (``cat.caption``, kohya's default, with
        data.caption_extension .txt): each trained on its folder's class tokens, its own
        caption unread, without a word. (Outside such folders these images have no
        caption, which the check below refuses.)"""
        ext = data.caption_extension
        stray = [(f, e) for f, k in zip(files, folders)
                 if k is not None and caption_uri(f, ext) not in present
                 for e in CAPTION_EXTENSIONS if e != ext and caption_uri(f, e) in present]
        if stray:
            found = sorted({e for _, e in stray})
            raise ValueError(
                f"{len(stray)} image(s) in kohya N_name folders have no {ext} caption but a "
                f"{'/'.join(found)} file beside them (e.g. {caption_uri(stray[0][0], found[0])}), "
                f"unread: they would train on their folder's class tokens. Set "
                f"data.caption_extension: {found[0]} (kohya's --caption_extension), or remove "
                "those files to train on the class tokens")

    def count_rows(self, data, files, storage):
        return len(files), [1] * len(files)

    def row(self, data, storage, image: str, tokens: str | None) -> dict:
        """One image's row: its bytes and its caption (the caption file's text, else the
        kohya folder's class tokens, else None)."""
        try:
            text = decode_text(storage.read_bytes(caption_uri(image, data.caption_extension))).strip()
        except FileNotFoundError:
            text = tokens
        row = {"key": image, "image": storage.read_bytes(image), "text": text}
        return with_sidecars(data, row, storage, image)

    def iter_rows(self, data, files, storage):
        for f, k in zip(files, self._folders(data, files)):
            yield self.row(data, storage, f, k[1] if k else None)

    def units(self, data, files, storage, rows_per_unit, repeats=None):
        # Runs of consecutive images with the same repeats (a unit is read as many times
        # as its rows count), at most rows_per_unit long: (first image, 0, images).
        reps = repeats or self.repeats(data, files) or [1] * len(files)
        out, start = [], 0
        for i in range(1, len(files) + 1):
            if i == len(files) or reps[i] != reps[start] or i - start == rows_per_unit:
                out.append((start, 0, i - start))
                start = i
        return out

    def iter_unit(self, data, files, storage, index, start, stop, keep=None):
        # One row per image: rows start..stop from image ``index`` are images. An image
        # left out (keep) is not read.
        places = range(index + start, index + (stop if stop >= 0 else 1))
        return self._rows(data, files, storage,
                          [i for j, i in enumerate(places) if keep is None or keep(j)])

    def _rows(self, data, files, storage, indices):
        folders = self._folders(data, [files[i] for i in indices])
        for i, k in zip(indices, folders):
            yield self.row(data, storage, files[i], k[1] if k else None)

    def read_dataset(self, data, files, file_rows, storage, seed, shuffle, **map_args):
        import ray

        order = np.random.default_rng(seed).permutation(len(files)) if shuffle else range(len(files))
        items = [{"index": int(i)} for i in order]
        blocks = max(1, min(64, len(items) // 64))
        return ray.data.from_items(items, override_num_blocks=blocks).map_batches(
            _read_images, batch_size=64,
            fn_kwargs={"data": data.model_dump(), "files": files,
                       "endpoint_url": storage.endpoint_url, "region": storage.region},
            compute=ray.data.TaskPoolStrategy(size=min(2, blocks)), num_cpus=0.25,
        )


def _read_images(batch: dict[str, np.ndarray], data: dict, files: list[str],
                 endpoint_url: str | None, region: str | None) -> dict[str, np.ndarray]:
    """map_batches stage of ``read_dataset``: image indices → rows."""
    from raylora.config import DataSection

    section, store = DataSection.model_validate(data), process_storage(endpoint_url, region)
    rows = list(CaptionFolder()._rows(section, files, store, [int(i) for i in batch["index"]]))
    return {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]} if rows else \
        {k: np.array([], dtype=object) for k in ("key", "image", "text")}
